//! Map sizes from the node's pod capacity and the cluster's size, so a
//! node is not sized by a constant (and tests can make maps small).
//!
//! | map | entries | why |
//! |---|---|---|
//! | `CONNTRACK` (LRU, preallocated, ~100 B each) | max(16384, max_pods × 1024) | flows of isolated pods; 110 pods: 112,640 (≈ 11 MiB) |
//! | `CT_USAGE` | max(1024, max_pods × 8) | two counters per interface, kept until a count finds the interface gone (see `conntrack_share`) |
//! | `FRAGMENTS` (LRU) | max(1024, max_pods × 32) | datagrams in flight |
//! | `POLICY` (not preallocated) | max(16384, max_pods × 2048) | allow entries of the local pods' identities |
//! | `IPCACHE_V4`, `IPCACHE_V6` | max(16384, cluster_pods + 4096) | every pod address, the node's, carved prefixes |
//! | `IDENTITY_NAMES` (not preallocated) | max(16384, cluster_pods + 4096) | at most one identity per pod, plus classes |
//! | `RULE_NAMES` (not preallocated) | 65536 (the object's) | one per rule some policy entry references |
//! | `ENDPOINTS`, `ENDPOINT_META` | max(1024, max_pods × 4) | interfaces beyond the slot array; interfaces attached (pods and uplinks) |
//! | `SERVICES` (LPM, not preallocated) | 65536 | Service frontend addresses (ClusterIPs, external and load-balancer IPs, the node's) and ranges |
//! | `SERVICE_FLOWS` (LRU) | max(16384, max_pods × 256) | isolated pods' flows to frontends, until judged after DNAT |
//!
//! `--map-size NAME=N` overrides one map. A pinned map keeps the size it
//! was created with (`reset`, or another `--pin-dir`, applies a new one).
use policy_common::maps as names;

/// The inputs of the formula.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sizing {
    /// Pods the node runs at most (the kubelet's `maxPods`, 110 by default).
    pub max_pods: u32,
    /// Pods in the whole cluster at most (every address is in the ipcache).
    pub cluster_pods: u32,
    /// Explicit sizes by map name, applied last.
    pub overrides: Vec<(&'static str, u32)>,
}

impl Default for Sizing {
    fn default() -> Self {
        Self {
            max_pods: 110,
            cluster_pods: 65536,
            overrides: Vec::new(),
        }
    }
}

/// The maps whose size can be configured.
pub const SIZED: [&str; 12] = [
    names::CONNTRACK,
    names::CT_USAGE,
    names::FRAGMENTS,
    names::POLICY,
    names::IPCACHE_V4,
    names::IPCACHE_V6,
    names::IDENTITY_NAMES,
    names::RULE_NAMES,
    names::ENDPOINTS,
    names::ENDPOINT_META,
    names::SERVICES,
    names::SERVICE_FLOWS,
];

impl Sizing {
    /// Map name → entries, for the loader.
    pub fn capacities(&self) -> Vec<(&'static str, u32)> {
        let pods = self.max_pods;
        let cluster = self.cluster_pods.saturating_add(4096).max(16384);
        let mut out = vec![
            (names::CONNTRACK, pods.saturating_mul(1024).max(16384)),
            (names::CT_USAGE, pods.saturating_mul(8).max(1024)),
            (names::FRAGMENTS, pods.saturating_mul(32).max(1024)),
            (names::POLICY, pods.saturating_mul(2048).max(16384)),
            (names::IPCACHE_V4, cluster),
            (names::IPCACHE_V6, cluster),
            (names::IDENTITY_NAMES, cluster),
            (names::ENDPOINTS, pods.saturating_mul(4).max(1024)),
            (names::ENDPOINT_META, pods.saturating_mul(4).max(1024)),
            (names::SERVICE_FLOWS, pods.saturating_mul(256).max(16384)),
        ];
        for (name, entries) in &self.overrides {
            match out.iter_mut().find(|(n, _)| n == name) {
                Some(slot) => slot.1 = *entries,
                None => out.push((name, *entries)),
            }
        }
        out
    }

    /// Parses `NAME=N` (a map of [`SIZED`], at least one entry).
    pub fn parse_override(s: &str) -> Result<(&'static str, u32), String> {
        let (name, n) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected NAME=ENTRIES"))?;
        let name = SIZED
            .iter()
            .find(|m| **m == name)
            .ok_or_else(|| format!("{name:?} is not one of {}", SIZED.join(", ")))?;
        let n: u32 = n
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{n:?}: expected a positive number of entries"))?;
        Ok((name, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_formula_and_overrides() {
        let s = Sizing::default();
        let caps = s.capacities();
        let get = |caps: &[(&str, u32)], n| caps.iter().find(|(m, _)| *m == n).map(|(_, e)| *e);
        assert_eq!(get(&caps, names::CONNTRACK), Some(112_640));
        assert_eq!(get(&caps, names::IPCACHE_V4), Some(69_632));
        let small = Sizing {
            overrides: vec![Sizing::parse_override("POLICY=8").unwrap()],
            ..Sizing::default()
        };
        assert_eq!(get(&small.capacities(), names::POLICY), Some(8));
        assert!(Sizing::parse_override("NOPE=1").is_err());
        assert!(Sizing::parse_override("POLICY=0").is_err());
    }
}
