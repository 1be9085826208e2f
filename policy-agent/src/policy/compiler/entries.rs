//! The entries that follow from the indexes: an address's ipcache entry,
//! an endpoint's isolation flags and lookup bits, and the names of the
//! policies isolating it (what a flow record names for a policy drop).
use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;
use policy_common::{
    direction,
    endpoint::{
        ENDPOINT_EGRESS_ISOLATED, ENDPOINT_EGRESS_TIERED, ENDPOINT_INGRESS_ISOLATED,
        ENDPOINT_INGRESS_TIERED, ENDPOINT_STAGED, EndpointInfo, lookups,
    },
    identity::{ANY, NODE},
    ipcache::IpcacheEntry,
    rule_name::{MAX_ISOLATING, NO_RULE, RuleName},
};

use super::{Compiler, host_net, selection::policies_selecting};
use crate::mapstate::rule_name;

impl Compiler {
    /// The ipcache entry of one address (its host prefix): the node, the
    /// pod holding it, or only its address class.
    pub(super) fn ipcache_entry(&self, ip: IpAddr) -> Option<IpcacheEntry> {
        let cidr_identity = self.classes.class_of(ip);
        if self.node_ips.contains(&ip) {
            return Some(IpcacheEntry {
                identity: NODE,
                cidr_identity,
            });
        }
        if let Some(pod) = self.claims.holder(&ip) {
            let identity = self.index.of_pod(pod).unwrap_or(ANY);
            return Some(IpcacheEntry {
                identity,
                cidr_identity,
            });
        }
        self.classes.id_of(&host_net(ip)).map(|c| IpcacheEntry {
            identity: ANY,
            cidr_identity: c,
        })
    }

    /// The ipcache entry of a carved prefix (or of one address).
    pub(super) fn ipcache_net_entry(&self, net: IpNet) -> Option<IpcacheEntry> {
        if net.prefix_len() == net.max_prefix_len() {
            return self.ipcache_entry(net.addr());
        }
        self.classes.id_of(&net).map(|c| IpcacheEntry {
            identity: ANY,
            cidr_identity: c,
        })
    }

    /// Rewrites the ipcache entries of `ips`.
    pub(super) fn refresh_addresses(&mut self, ips: BTreeSet<IpAddr>) {
        for ip in ips {
            let entry = self.ipcache_entry(ip);
            self.out.set_ipcache(host_net(ip), entry);
        }
    }

    /// "A pod is isolated for ingress/egress if there is any NetworkPolicy
    /// that both selects the pod and has Ingress/Egress in its
    /// policyTypes."
    fn flags_of(&self, e: u32) -> u32 {
        let Some(x) = self.index.idents.get(&e) else {
            return 0;
        };
        let mut flags = 0;
        for ps in policies_selecting(&self.policies, &x.key.namespace, e) {
            if ps.parsed.ingress {
                flags |= ENDPOINT_INGRESS_ISOLATED;
            }
            if ps.parsed.egress {
                flags |= ENDPOINT_EGRESS_ISOLATED;
            }
        }
        if self.tiered(e, direction::INGRESS) {
            flags |= ENDPOINT_INGRESS_TIERED;
        }
        if self.tiered(e, direction::EGRESS) {
            flags |= ENDPOINT_EGRESS_TIERED;
        }
        flags
    }

    /// The NetworkPolicies isolating endpoint identity `e`, per direction
    /// (by namespace and name), as `RULE_NAMES` holds them: at most
    /// [`MAX_ISOLATING`], the last saying how many more there are.
    fn isolating_names(&self, e: u32) -> [Vec<RuleName>; 2] {
        let mut out: [Vec<RuleName>; 2] = Default::default();
        let Some(x) = self.index.idents.get(&e) else {
            return out;
        };
        for ps in policies_selecting(&self.policies, &x.key.namespace, e) {
            let p = &ps.parsed;
            for (dir, isolates) in [
                (direction::INGRESS, p.ingress),
                (direction::EGRESS, p.egress),
            ] {
                if isolates {
                    out[usize::from(dir)].push(rule_name(
                        dir,
                        usize::from(NO_RULE),
                        0,
                        &p.name.namespace,
                        &p.name.name,
                        "",
                    ));
                }
            }
        }
        let max = usize::from(MAX_ISOLATING);
        for (dir, names) in out.iter_mut().enumerate() {
            if names.len() > max {
                let more = names.len() - (max - 1);
                names.truncate(max - 1);
                names.push(rule_name(
                    dir as u8,
                    usize::from(NO_RULE),
                    0,
                    "",
                    "",
                    &format!("and {more} more"),
                ));
            }
        }
        out
    }

    /// Rewrites the endpoint entries of identities `es` and of those whose
    /// lookup bits may have moved (flags and lookups), and the names of
    /// the policies isolating them.
    pub(super) fn refresh_endpoints(&mut self, es: BTreeSet<u32>) {
        let dirty = std::mem::take(&mut self.out.dirty_lookups);
        for e in es.union(&dirty) {
            if !self.index.endpoint_ids.contains(e) {
                continue;
            }
            let info = EndpointInfo {
                identity: *e,
                flags: self.flags_of(*e),
                ingress_lookups: lookups::stored(self.out.lookup_bits(*e, direction::INGRESS)),
                egress_lookups: lookups::stored(self.out.lookup_bits(*e, direction::EGRESS)),
                ..EndpointInfo::default()
            };
            let names = self.isolating_names(*e);
            for (dir, names) in names.into_iter().enumerate() {
                self.out.set_isolating(*e, dir as u8, names);
            }
            let Some(ident) = self.index.idents.get(e) else {
                continue;
            };
            for pod in &ident.endpoints {
                let ips = self.local_pods.get(pod).map_or(&[][..], Vec::as_slice);
                let mut info = info.with_addresses(ips);
                if self.staged_tracked.contains(pod) {
                    info.flags |= ENDPOINT_STAGED;
                }
                self.out.set_endpoint(pod, Some(info));
            }
        }
    }
}
