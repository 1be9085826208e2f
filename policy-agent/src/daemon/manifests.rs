//! The manifest-directory source: inotify wakes it when a file is written,
//! moved in or removed (with a slow poll as a safety net); once the
//! directory has been quiet for the settle time it re-reads only the files
//! that changed and publishes the new state.
use std::{
    collections::BTreeMap,
    os::fd::{AsRawFd, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use tokio::{io::unix::AsyncFd, sync::mpsc::UnboundedSender};
use tracing::{info, warn};

use super::SourceState;
use crate::{
    enforce::Problem,
    k8s::manifests::{LoadedManifests, load_text},
};

type Stamp = (u64, Option<SystemTime>);

/// Parsed files, re-parsed only when their size or mtime changes.
#[derive(Default)]
struct Cache {
    files: BTreeMap<PathBuf, (Stamp, LoadedManifests)>,
}

fn manifest_files(dir: &Path) -> BTreeMap<PathBuf, Stamp> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| {
                    matches!(
                        e.path().extension().and_then(|x| x.to_str()),
                        Some("yaml" | "yml")
                    )
                })
                .filter_map(|e| {
                    e.metadata()
                        .ok()
                        .filter(|m| m.is_file())
                        .map(|m| (e.path(), (m.len(), m.modified().ok())))
                })
                .collect()
        })
        .unwrap_or_default()
}

impl Cache {
    /// Re-reads what changed; `None` when nothing did.
    fn refresh(&mut self, dir: &Path) -> Option<()> {
        let now = manifest_files(dir);
        let mut changed =
            self.files.len() != now.len() || self.files.keys().any(|k| !now.contains_key(k));
        self.files.retain(|k, _| now.contains_key(k));
        for (path, stamp) in now {
            if self.files.get(&path).is_some_and(|(s, _)| *s == stamp) {
                continue;
            }
            let mut loaded = LoadedManifests::default();
            match std::fs::read_to_string(&path) {
                Ok(text) => load_text(&path, &text, &mut loaded),
                Err(source) => loaded.errors.push(crate::k8s::ManifestError::Read {
                    path: path.clone(),
                    source,
                }),
            }
            self.files.insert(path, (stamp, loaded));
            changed = true;
        }
        changed.then_some(())
    }

    fn state(&self, node: &str) -> SourceState {
        let mut all = LoadedManifests::default();
        let mut problems = Vec::new();
        for (_, loaded) in self.files.values() {
            all.namespaces.extend(loaded.namespaces.iter().cloned());
            all.pods.extend(loaded.pods.iter().cloned());
            all.policies.extend(loaded.policies.iter().cloned());
            problems.extend(loaded.errors.iter().map(|e| Problem {
                object: "manifest".into(),
                reason: e.to_string(),
            }));
        }
        let state = all.cluster_state(node, Vec::new());
        // Problems found across files (duplicates, unconvertible objects).
        problems.extend(all.errors.iter().map(|e| Problem {
            object: "manifest".into(),
            reason: e.to_string(),
        }));
        for p in &problems {
            warn!(problem = %p, "manifest");
        }
        SourceState { state, problems }
    }
}

/// An inotify instance watching `dir`, or None where inotify is missing.
fn inotify(dir: &Path) -> Option<AsyncFd<OwnedFd>> {
    // SAFETY: plain syscalls; the fd is owned right away.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    let mask = libc::IN_CLOSE_WRITE
        | libc::IN_MOVED_TO
        | libc::IN_MOVED_FROM
        | libc::IN_DELETE
        | libc::IN_CREATE
        | libc::IN_MODIFY
        | libc::IN_ATTRIB;
    // SAFETY: valid fd and NUL-terminated path.
    if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) } < 0 {
        return None;
    }
    // SAFETY: the fd is an inotify instance this function owns and hands
    // to the AsyncFd; nothing else reads or closes it.
    unsafe { AsyncFd::register(fd) }.ok()
}

/// Waits for the next inotify event (draining what is queued).
async fn next_event(fd: &AsyncFd<OwnedFd>) {
    loop {
        let Ok(mut guard) = fd.readable().await else {
            return;
        };
        let mut buf = [0u8; 4096];
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::read(fd.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            return;
        }
        guard.clear_ready();
    }
}

/// Publishes the directory's state at start and after every settled change.
pub async fn watch(
    dir: PathBuf,
    node: String,
    settle: Duration,
    poll: Duration,
    tx: UnboundedSender<SourceState>,
) {
    let mut cache = Cache::default();
    cache.refresh(&dir);
    if tx.send(cache.state(&node)).is_err() {
        return;
    }
    let notify = inotify(&dir);
    if notify.is_none() {
        warn!(dir = %dir.display(), "inotify unavailable; polling for changes");
    }
    // Without inotify the poll is the only trigger.
    let safety_net = if notify.is_some() {
        poll.max(Duration::from_secs(2))
    } else {
        poll
    };
    loop {
        match &notify {
            Some(fd) => {
                tokio::select! {
                    () = next_event(fd) => {
                        // Let a burst of writes (an editor, a `cp` of many
                        // files) settle, so a half-written file is never read.
                        while tokio::time::timeout(settle, next_event(fd)).await.is_ok() {}
                    }
                    () = tokio::time::sleep(safety_net) => {}
                }
            }
            None => tokio::time::sleep(safety_net).await,
        }
        if cache.refresh(&dir).is_some() {
            info!(dir = %dir.display(), "manifests changed");
            if tx.send(cache.state(&node)).is_err() {
                return;
            }
        }
    }
}
