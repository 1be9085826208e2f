//! Address claims: which pod holds each address.
//!
//! Pod IPs get reused, and during a handover two live pods may claim one
//! address. The newest claim holds it (ties: the first pod by
//! namespace/name); node addresses are never a pod's; terminal and
//! hostNetwork pods claim nothing.
use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::cluster::{Few, PodInfo, PodRef};

/// A pod's claim on an address: the newest pod holds it, ties by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Claim {
    newest: Reverse<i64>,
    pod: PodRef,
}

/// The claims on one address, the holder first.
/// Sorted: the holder first.
type Claims = Few<Claim>;

/// A pod that owns addresses and has an identity: live and not hostNetwork
/// (hostNetwork pods use the node's addresses and are never peers).
pub(super) fn eligible(info: &PodInfo) -> bool {
    !info.terminal && !info.host_network && !info.ips.is_empty()
}

/// What one pod claims and holds.
#[derive(Clone, Debug, Default)]
struct PodClaims {
    /// The addresses the live pod claims and the creation time it used
    /// (None: it claims nothing now).
    claimed: Option<(i64, Few<IpAddr>)>,
    /// What it held when its identity was last updated.
    held: Few<IpAddr>,
}

/// The claims on one address and who holds it since the last settle.
#[derive(Clone, Debug, Default)]
struct AddressState {
    claims: Claims,
    holder: Option<PodRef>,
}

/// One map keyed by pod and one by address (each entry what two maps held
/// before: a pod's name or an address is stored once per map).
#[derive(Clone, Debug, Default)]
pub(super) struct AddressClaims {
    pods: BTreeMap<PodRef, PodClaims>,
    addresses: BTreeMap<IpAddr, AddressState>,
}

impl AddressClaims {
    /// Re-registers the claims of `pods` from their current `info` (absent:
    /// deleted). Returns every address whose claims changed.
    pub fn reclaim<'a>(
        &mut self,
        pods: impl IntoIterator<Item = (&'a PodRef, Option<&'a PodInfo>)>,
        node_ips: &BTreeSet<IpAddr>,
    ) -> BTreeSet<IpAddr> {
        let mut touched = BTreeSet::new();
        for (pod, info) in pods {
            let old = self.pods.get_mut(pod).and_then(|p| p.claimed.take());
            if let Some((created, old)) = old {
                let claim = Claim {
                    newest: Reverse(created),
                    pod: pod.clone(),
                };
                for &ip in old.as_slice() {
                    if let Some(state) = self.addresses.get_mut(&ip) {
                        state.claims.remove_sorted(&claim);
                        if state.claims.is_empty() && state.holder.is_none() {
                            self.addresses.remove(&ip);
                        }
                    }
                    touched.insert(ip);
                }
            }
            let Some(info) = info.filter(|i| eligible(i)) else {
                self.forget_if_empty(pod);
                continue;
            };
            let mut ips: Vec<IpAddr> = info
                .ips
                .iter()
                .copied()
                .filter(|ip| !node_ips.contains(ip))
                .collect();
            ips.sort_unstable();
            ips.dedup();
            let claim = Claim {
                newest: Reverse(info.created),
                pod: pod.clone(),
            };
            for ip in &ips {
                self.addresses
                    .entry(*ip)
                    .or_default()
                    .claims
                    .insert_sorted(claim.clone());
                touched.insert(*ip);
            }
            self.pods.entry(pod.clone()).or_default().claimed =
                Some((info.created, Few::from_vec(ips)));
        }
        touched
    }

    /// Settles who holds each of `ips` now; returns the pods that gained
    /// or lost one of them.
    pub fn settle(&mut self, ips: &BTreeSet<IpAddr>) -> BTreeSet<PodRef> {
        let mut moved = BTreeSet::new();
        for ip in ips {
            let Some(state) = self.addresses.get_mut(ip) else {
                continue;
            };
            let new = state.claims.as_slice().first().map(|c| c.pod.clone());
            let old = std::mem::replace(&mut state.holder, new.clone());
            if state.claims.is_empty() {
                // Claimed by nobody and (now) held by nobody.
                self.addresses.remove(ip);
            }
            if old != new {
                moved.extend(old);
                moved.extend(new);
            }
        }
        moved
    }

    /// The addresses `pod` claims and holds now.
    pub fn holding(&self, pod: &PodRef) -> BTreeSet<IpAddr> {
        self.pods
            .get(pod)
            .and_then(|p| p.claimed.as_ref())
            .map(|(_, ips)| {
                ips.as_slice()
                    .iter()
                    .filter(|ip| self.holder(ip) == Some(pod))
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The pod holding `ip`.
    pub fn holder(&self, ip: &IpAddr) -> Option<&PodRef> {
        self.addresses.get(ip).and_then(|s| s.holder.as_ref())
    }

    /// Records what `pod` holds as its identity sees it now, returning
    /// what it held before.
    pub fn record_held(&mut self, pod: &PodRef, now: BTreeSet<IpAddr>) -> BTreeSet<IpAddr> {
        let before = match self.pods.get_mut(pod) {
            Some(p) => std::mem::take(&mut p.held),
            None => Few::Empty,
        };
        if !now.is_empty() {
            self.pods.entry(pod.clone()).or_default().held =
                Few::from_vec(now.into_iter().collect());
        } else {
            self.forget_if_empty(pod);
        }
        before.as_slice().iter().copied().collect()
    }

    /// Drops `pod`'s entry once it neither claims nor holds anything.
    fn forget_if_empty(&mut self, pod: &PodRef) {
        if self
            .pods
            .get(pod)
            .is_some_and(|p| p.claimed.is_none() && p.held.is_empty())
        {
            self.pods.remove(pod);
        }
    }
}
