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

use crate::cluster::{PodInfo, PodRef};

/// A pod's claim on an address: the newest pod holds it, ties by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Claim {
    newest: Reverse<i64>,
    pod: PodRef,
}

/// The claims on one address, the holder first. Almost always one: a
/// sorted vector, not a set (a set's first node took some 600 bytes per
/// address).
#[derive(Clone, Debug, Default)]
struct Claims(Vec<Claim>);

impl Claims {
    fn insert(&mut self, claim: Claim) {
        if let Err(at) = self.0.binary_search(&claim) {
            // A first claim takes room for one (a vector's first growth
            // makes room for four).
            self.0.reserve_exact(1);
            self.0.insert(at, claim);
        }
    }

    fn remove(&mut self, claim: &Claim) {
        if let Ok(at) = self.0.binary_search(claim) {
            self.0.remove(at);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn first(&self) -> Option<&Claim> {
        self.0.first()
    }
}

/// A pod that owns addresses and has an identity: live and not hostNetwork
/// (hostNetwork pods use the node's addresses and are never peers).
pub(super) fn eligible(info: &PodInfo) -> bool {
    !info.terminal && !info.host_network && !info.ips.is_empty()
}

#[derive(Clone, Debug, Default)]
pub(super) struct AddressClaims {
    /// The addresses each live pod claims (and the creation time it used).
    by_pod: BTreeMap<PodRef, (i64, Vec<IpAddr>)>,
    claims: BTreeMap<IpAddr, Claims>,
    holders: BTreeMap<IpAddr, PodRef>,
    /// What each pod held when its identity was last updated, sorted (a
    /// vector: almost always one or two addresses, where a set's node
    /// takes room for eleven).
    held: BTreeMap<PodRef, Vec<IpAddr>>,
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
            if let Some((created, old)) = self.by_pod.remove(pod) {
                let claim = Claim {
                    newest: Reverse(created),
                    pod: pod.clone(),
                };
                for ip in old {
                    if let Some(set) = self.claims.get_mut(&ip) {
                        set.remove(&claim);
                        if set.is_empty() {
                            self.claims.remove(&ip);
                        }
                    }
                    touched.insert(ip);
                }
            }
            let Some(info) = info.filter(|i| eligible(i)) else {
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
            ips.shrink_to_fit();
            let claim = Claim {
                newest: Reverse(info.created),
                pod: pod.clone(),
            };
            for ip in &ips {
                self.claims.entry(*ip).or_default().insert(claim.clone());
                touched.insert(*ip);
            }
            self.by_pod.insert(pod.clone(), (info.created, ips));
        }
        touched
    }

    /// Settles who holds each of `ips` now; returns the pods that gained
    /// or lost one of them.
    pub fn settle(&mut self, ips: &BTreeSet<IpAddr>) -> BTreeSet<PodRef> {
        let mut moved = BTreeSet::new();
        for ip in ips {
            let new = self
                .claims
                .get(ip)
                .and_then(|s| s.first())
                .map(|c| c.pod.clone());
            let old = match &new {
                Some(n) => self.holders.insert(*ip, n.clone()),
                None => self.holders.remove(ip),
            };
            if old != new {
                moved.extend(old);
                moved.extend(new);
            }
        }
        moved
    }

    /// The addresses `pod` claims and holds now.
    pub fn holding(&self, pod: &PodRef) -> BTreeSet<IpAddr> {
        self.by_pod
            .get(pod)
            .map(|(_, ips)| {
                ips.iter()
                    .filter(|ip| self.holders.get(ip) == Some(pod))
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The pod holding `ip`.
    pub fn holder(&self, ip: &IpAddr) -> Option<&PodRef> {
        self.holders.get(ip)
    }

    /// Records what `pod` holds as its identity sees it now, returning
    /// what it held before.
    pub fn record_held(&mut self, pod: &PodRef, now: BTreeSet<IpAddr>) -> BTreeSet<IpAddr> {
        let before = self.held.remove(pod).unwrap_or_default();
        if !now.is_empty() {
            self.held.insert(pod.clone(), now.into_iter().collect());
        }
        before.into_iter().collect()
    }
}
