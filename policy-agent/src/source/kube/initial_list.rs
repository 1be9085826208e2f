//! How a watcher reads a kind in full: as a streamed list where the API
//! server offers one, in pages where it does not.
//!
//! A streamed list is a watch that starts with the current objects and
//! marks their end. The API reference (`WatchList`, the `sendInitialEvents`
//! parameter) says: "the watch stream will begin with synthetic events to
//! produce the current state of objects in the collection. Once all such
//! events have been sent, a synthetic "Bookmark" event will be sent. The
//! bookmark will report the ResourceVersion (RV) corresponding to the set
//! of objects, and be marked with `"k8s.io/initial-events-end": "true"`
//! annotation." The server then sends no list body at all: it streams from
//! its watch cache, and a start or a re-list after `410 Gone` costs it no
//! more than a watch.
//!
//! Servers without it answer in one of two ways, and each turns this kind
//! to paged list and watch for good, said once:
//! - they refuse the parameters (422 Invalid or 400 Bad Request: the
//!   feature gate is off, or the server predates it);
//! - they ignore them and send a plain watch, whose end-of-list bookmark
//!   never comes. A streamed list is sent back to back, so a list that goes
//!   quiet for [`QUIET_BEFORE_PAGES`] before its end is taken for this.
//!   A server that is only slow costs one paged list, never a wrong state:
//!   what was streamed is dropped with the list it began (the paged list
//!   starts over, and the stores publish a list only once it is complete).
use std::{fmt::Debug, time::Duration};

use futures::{StreamExt as _, stream::BoxStream};
use kube::{
    Api, Resource,
    runtime::{
        WatchStreamExt as _,
        watcher::{self, Event},
    },
};
use serde::de::DeserializeOwned;
use tracing::warn;

use super::service_cidrs::status_code;

/// A streamed list quiet this long before its end: the server ignored the
/// request for one.
pub(super) const QUIET_BEFORE_PAGES: Duration = Duration::from_secs(5);

/// A kind's watch events and failures (the stream never ends; failures are
/// retried with backoff).
pub(super) type Events<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// The events of `api`'s kind (`kind` names it in logs): a streamed list,
/// then its changes; paged list and watch where the server has no
/// streamed lists.
pub(super) fn events<K>(api: Api<K>, kind: &'static str) -> Events<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let streamed = watch(api.clone(), watcher::Config::default().streaming_lists());
    let state = State {
        api,
        kind,
        inner: streamed,
        streaming: true,
        listing: false,
    };
    futures::stream::unfold(state, State::next).boxed()
}

fn watch<K>(api: Api<K>, config: watcher::Config) -> Events<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watcher::watcher(api, config).default_backoff().boxed()
}

struct State<K> {
    api: Api<K>,
    kind: &'static str,
    inner: Events<K>,
    /// Still asking for streamed lists.
    streaming: bool,
    /// Inside a list (its start seen, not its end): only then does a quiet
    /// stream mean anything. Never during backoff after a failure.
    listing: bool,
}

impl<K> State<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    async fn next(mut self) -> Option<(Result<Event<K>, watcher::Error>, Self)> {
        loop {
            let item = if self.streaming && self.listing {
                match tokio::time::timeout(QUIET_BEFORE_PAGES, self.inner.next()).await {
                    Ok(item) => item?,
                    Err(_) => {
                        self.in_pages(&format!(
                            "its streamed list went quiet for {QUIET_BEFORE_PAGES:?} before its end (the server ignores sendInitialEvents)"
                        ));
                        continue;
                    }
                }
            } else {
                self.inner.next().await?
            };
            match &item {
                Ok(Event::Init | Event::InitApply(_)) => self.listing = true,
                Ok(_) => self.listing = false,
                Err(e) if self.streaming && refuses_streamed_lists(e) => {
                    self.in_pages(&format!("the server refused a streamed list: {e}"));
                    continue;
                }
                Err(_) => self.listing = false,
            }
            return Some((item, self));
        }
    }

    /// Turns this kind to paged list and watch, for good.
    fn in_pages(&mut self, why: &str) {
        warn!(
            kind = self.kind,
            "{why}; listing this kind in pages instead"
        );
        self.streaming = false;
        self.listing = false;
        self.inner = watch(self.api.clone(), watcher::Config::default());
    }
}

/// Whether the start of a streamed list failed on its parameters: 422
/// (validation: `sendInitialEvents` without the feature, or
/// `resourceVersionMatch` on a watch of an older server) or 400.
fn refuses_streamed_lists(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchStartFailed(_))
        && matches!(status_code(error), Some(400 | 422))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kube::core::Status;

    use super::*;

    fn start_failed(code: u16) -> watcher::Error {
        let status = Status::failure("no", "Invalid").with_code(code);
        watcher::Error::WatchStartFailed(kube::Error::Api(status.boxed()))
    }

    #[test]
    fn only_a_refused_start_turns_to_pages() {
        assert!(refuses_streamed_lists(&start_failed(422)));
        assert!(refuses_streamed_lists(&start_failed(400)));
        // Outages, RBAC and absent APIs are retried as they are.
        for code in [403, 404, 410, 500, 503] {
            assert!(!refuses_streamed_lists(&start_failed(code)), "{code}");
        }
        let mid_stream = watcher::Error::WatchFailed(kube::Error::Api(
            Status::failure("no", "Invalid").with_code(422).boxed(),
        ));
        assert!(!refuses_streamed_lists(&mid_stream));
    }
}
