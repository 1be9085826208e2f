//! Whether anything runs before the classifiers: checked on each pod's
//! interface at its attach and on every full pass (which fixes what it
//! can and reports the rest), and watched in between, cheaply, for
//! programs attached to a running pod's interface.
use std::collections::BTreeMap;

use policy_common::endpoint::{ATTACH_ANY_UPLINK, ATTACH_POD};
use tracing::warn;

use super::{error::Error, loader::PinnedClassifier};
use crate::{
    cluster::{ObjectKind, PodRef, Problem},
    datapath::{Interface, SyncReport},
};

/// Runs the order check on a pod's interface (see
/// [`PinnedClassifier::check_order`]) and reports what it found: on every
/// full pass, and right after a new pod's attach (a foreign TCX program
/// already on the veth would run ahead of the netlink filters until then).
pub fn check_order(
    dp: &mut PinnedClassifier,
    pod: &PodRef,
    iface: &Interface,
    report: &mut SyncReport,
) {
    let check = dp.check_order(iface.ifindex);
    match check.moved {
        Some(Ok(leftovers)) => {
            warn!(pod = %pod, interface = %iface.name, "foreign TCX programs ran before the classifier's filters: moved to TCX links, first in the chain");
            for e in leftovers {
                warn!(pod = %pod, interface = %iface.name, error = %e, "filter left after the move to TCX");
            }
        }
        Some(Err(e)) => report.problems.push(Problem::object(
            ObjectKind::Pod,
            pod.clone(),
            format!(
                "moving {} to TCX, ahead of foreign programs: {e}",
                iface.name
            ),
        )),
        None => {}
    }
    for (hook, what) in check.ahead {
        warn!(pod = %pod, interface = %iface.name, hook = hook.name(), ahead = %what, "foreign programs run before the classifier");
        report.problems.push(Problem::object(
            ObjectKind::Pod,
            pod.clone(),
            format!(
                "{what} run before the classifier at {} {}: they can pass packets unjudged",
                iface.name,
                hook.name()
            ),
        ));
    }
}

/// What ran before the classifiers at the last look, by interface and
/// hook (only where something did).
pub type OrderSnapshot = BTreeMap<u32, Vec<String>>;

/// What runs before the classifiers on every interface that carries a
/// pod's or the uplink's: queries only, nothing is moved.
pub fn snapshot(dp: &mut PinnedClassifier) -> Result<OrderSnapshot, Error> {
    let meta = dp.maps.read_meta()?;
    let mut out = OrderSnapshot::new();
    for (ifindex, m) in meta {
        if m.attach & (ATTACH_POD | ATTACH_ANY_UPLINK) == 0 {
            continue;
        }
        let ahead: Vec<String> = dp
            .foreign_ahead(ifindex)
            .into_iter()
            .map(|(hook, what)| format!("{}: {what}", hook.name()))
            .collect();
        if !ahead.is_empty() {
            out.insert(ifindex, ahead);
        }
    }
    Ok(out)
}

/// Between full passes: whether what runs ahead changed since the last
/// look. A change (a foreign program attached to a running pod's
/// interface, or one gone) asks for a full pass; what a full pass could
/// not fix stays as it was and asks for nothing more.
#[derive(Default)]
pub struct OrderWatch {
    seen: Option<OrderSnapshot>,
}

impl OrderWatch {
    /// Records the state a full pass left.
    pub fn settle(&mut self, dp: &mut PinnedClassifier) {
        match snapshot(dp) {
            Ok(now) => self.seen = Some(now),
            Err(e) => {
                warn!(error = %e, "cannot list what runs before the classifiers");
                self.seen = None;
            }
        }
    }

    /// True when what runs ahead differs from the last look.
    pub fn changed(&mut self, dp: &mut PinnedClassifier) -> bool {
        match snapshot(dp) {
            Ok(now) => {
                // Before the first full pass has looked (it verifies
                // every attachment), anything ahead counts.
                let changed = match &self.seen {
                    Some(seen) => *seen != now,
                    None => !now.is_empty(),
                };
                if changed {
                    for (ifindex, ahead) in &now {
                        warn!(ifindex, ahead = ?ahead, "programs run before the classifier: checking every interface now");
                    }
                }
                self.seen = Some(now);
                changed
            }
            Err(e) => {
                // The full pass that would follow reads the same map.
                warn!(error = %e, "cannot list what runs before the classifiers");
                false
            }
        }
    }
}
