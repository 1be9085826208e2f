//! The staged view beside the enforcing compiler (see `cluster::staged`):
//! a second compiler, fed every change with staged policies as written,
//! that exists only while some policy is staged. It starts as a copy of
//! the enforcing compiler, so its cost is paid only while it is used.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::SystemTime,
};

use tracing::info;

use crate::{
    cluster::{
        Change, ObjectKind, ObjectRef, PodRef, Problem,
        staged::{StagedPolicy, enforced_change},
    },
    identity::IdentityAllocator,
    mapstate::StagedView,
    policy::Compiler,
};

/// A staged policy as last seen: since when, and its upsert.
struct Staged {
    since: SystemTime,
    upsert: Change,
}

/// The staged compiler, with identity numbers of its own (the view is
/// judged by address, never by the enforcing compiler's numbers).
struct Shadow {
    compiler: Compiler,
    ids: IdentityAllocator,
}

#[derive(Default)]
pub struct Staging {
    staged: BTreeMap<StagedPolicy, Staged>,
    shadow: Option<Shadow>,
    view: Option<Arc<StagedView>>,
}

impl Staging {
    /// What the enforcing compiler gets of `changes` (a staged policy is a
    /// deleted one to it), and the changes as written when the staged
    /// compiler already exists (it follows them after the enforcing one).
    pub fn split(&mut self, changes: Vec<Change>) -> (Vec<Change>, Option<Vec<Change>>) {
        let mut enforced = Vec::with_capacity(changes.len());
        for change in &changes {
            let (to_enforce, staged) = enforced_change(change);
            match staged {
                Some((policy, true)) => {
                    let since = self
                        .staged
                        .get(&policy)
                        .map_or_else(SystemTime::now, |s| s.since);
                    if !self.staged.contains_key(&policy) {
                        info!(policy = %policy, "staged: evaluated and reported, not enforced");
                    }
                    self.staged.insert(
                        policy,
                        Staged {
                            since,
                            upsert: change.clone(),
                        },
                    );
                }
                Some((policy, false)) if self.staged.remove(&policy).is_some() => {
                    info!(policy = %policy, "no longer staged");
                }
                Some((_, false)) | None => {}
            }
            enforced.push(to_enforce);
        }
        let raw = self.shadow.is_some().then_some(changes);
        (enforced, raw)
    }

    /// Brings the staged compiler up to date after `enforcing` compiled
    /// the same batch (`raw`: what [`Self::split`] returned); returns
    /// whether the view changed.
    pub fn follow(
        &mut self,
        enforcing: &Compiler,
        enforcing_ids: &IdentityAllocator,
        raw: Option<Vec<Change>>,
    ) -> bool {
        if self.staged.is_empty() {
            self.shadow = None;
            return self.view.take().is_some();
        }
        let ops = match (&mut self.shadow, raw) {
            (Some(shadow), Some(raw)) => shadow.compiler.apply(raw, &mut shadow.ids).len(),
            _ => {
                // The first staged policy (or a batch the shadow missed):
                // start from what is enforced, then add every staged one.
                let mut shadow = Shadow {
                    compiler: enforcing.clone(),
                    ids: enforcing_ids.clone(),
                };
                let upserts = self.staged.values().map(|s| s.upsert.clone());
                shadow.compiler.apply(upserts, &mut shadow.ids);
                self.shadow = Some(shadow);
                usize::MAX
            }
        };
        let since: BTreeMap<StagedPolicy, SystemTime> = self
            .staged
            .iter()
            .map(|(p, s)| (p.clone(), s.since))
            .collect();
        let stale = self.view.as_ref().is_none_or(|v| v.staged != since);
        if ops == 0 && !stale {
            return false;
        }
        if let Some(shadow) = &self.shadow {
            self.view = Some(Arc::new(StagedView::new(shadow.compiler.maps(), since)));
        }
        true
    }

    /// Local pods the staged view judges (in some direction) and the
    /// enforcing one does not: their flows must be tracked to be recorded.
    pub fn tracked(&self, enforcing: &Compiler) -> BTreeSet<PodRef> {
        let Some(shadow) = &self.shadow else {
            return BTreeSet::new();
        };
        let judged = |flags: u32| {
            use policy_common::endpoint::*;
            flags
                & (ENDPOINT_INGRESS_ISOLATED
                    | ENDPOINT_EGRESS_ISOLATED
                    | ENDPOINT_INGRESS_TIERED
                    | ENDPOINT_EGRESS_TIERED)
                != 0
        };
        let enforced = &enforcing.maps().endpoints;
        shadow
            .compiler
            .maps()
            .endpoints
            .iter()
            .filter(|(pod, ep)| {
                judged(ep.flags) && !enforced.get(*pod).is_some_and(|e| judged(e.flags))
            })
            .map(|(pod, _)| pod.clone())
            .collect()
    }

    /// The view the flow pipeline judges records against.
    pub fn view(&self) -> Option<Arc<StagedView>> {
        self.view.clone()
    }

    /// What is wrong with the staged policies themselves (an invalid one
    /// is reported as it would be enforced: failing closed).
    pub fn problems(&self) -> Vec<Problem> {
        let Some(shadow) = &self.shadow else {
            return Vec::new();
        };
        let staged = |kind: ObjectKind, name: &ObjectRef| {
            let policy = match kind {
                ObjectKind::NetworkPolicy => StagedPolicy::NetworkPolicy {
                    namespace: name.namespace.clone(),
                    name: name.name.clone(),
                },
                ObjectKind::ClusterNetworkPolicy => StagedPolicy::ClusterNetworkPolicy {
                    name: name.name.clone(),
                },
                _ => return false,
            };
            self.staged.contains_key(&policy)
        };
        shadow
            .compiler
            .problems()
            .into_iter()
            .filter(|p| p.subject.object().is_some_and(|(k, n)| staged(k, n)))
            .map(|mut p| {
                p.reason = format!("(staged) {}", p.reason);
                p
            })
            .collect()
    }
}
