//! The map content a verdict reads, and judging a new flow against it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::{
    direction,
    endpoint::{ENDPOINT_HAS_V4, ENDPOINT_HAS_V6, EndpointInfo, lookups},
    event::RuleRef,
    identity,
    ipcache::IpcacheEntry,
    policy::{ENTRY_TIERS_ONLY, PolicyEntry, PolicyKey, Tiers},
    proto,
    service::ServiceEntry,
    verdict::Reason,
};

use super::{PeerOf, flows::pod_holds, has_ports};

/// The content of the datapath maps the verdict depends on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Maps {
    pub endpoints: BTreeMap<u32, EndpointInfo>,
    /// (prefix length, address bytes masked to the prefix) → entry.
    pub ipcache_v4: BTreeMap<(u32, [u8; 4]), IpcacheEntry>,
    pub ipcache_v6: BTreeMap<(u32, [u8; 16]), IpcacheEntry>,
    pub policy: BTreeMap<PolicyKey, PolicyEntry>,
    /// Service frontends (`SERVICES`): (prefix length, masked address) →
    /// entry, per family.
    pub frontends_v4: BTreeMap<(u32, [u8; 4]), ServiceEntry>,
    pub frontends_v6: BTreeMap<(u32, [u8; 16]), ServiceEntry>,
    /// The node's pod ranges (`POD_RANGES`): (prefix length, masked
    /// address), per family. See [`super::pod_range_guard`].
    pub pod_ranges_v4: BTreeSet<(u32, [u8; 4])>,
    pub pod_ranges_v6: BTreeSet<(u32, [u8; 16])>,
    /// The enforced local addresses (`ENFORCED`) → ifindex.
    pub enforced: BTreeMap<IpAddr, u32>,
}

/// Outcome of judging a flow against the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judgement {
    pub reason: Reason,
    /// The policy key that allowed it, when a policy entry did.
    pub matched: Option<PolicyKey>,
    /// What the peer address resolved to.
    pub peer: IpcacheEntry,
    /// What the policy lookup found, as the classifier's flow record
    /// carries it before [`RuleRef::kept_for`] (default when no lookup
    /// ran).
    pub rule: RuleRef,
}

pub(super) fn masked<const N: usize>(addr: [u8; N], prefix_len: u32) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, byte) in addr.iter().enumerate() {
        let bit = (i as u32) * 8;
        if bit + 8 <= prefix_len {
            out[i] = *byte;
        } else if bit < prefix_len {
            let keep = prefix_len - bit;
            out[i] = byte & !(0xffu8 >> keep);
        }
    }
    out
}

/// (prefix length, address masked to it) → value: an LPM trie's content.
type Trie<const N: usize, V> = BTreeMap<(u32, [u8; N]), V>;

/// Inserts `value` under `addr`/`prefix_len` into the trie of its family,
/// the address masked as the kernel would.
fn insert_masked<V>(
    (v4, v6): (&mut Trie<4, V>, &mut Trie<16, V>),
    addr: IpAddr,
    prefix_len: u32,
    value: V,
) {
    match addr {
        IpAddr::V4(a) => {
            v4.insert((prefix_len, masked(a.octets(), prefix_len)), value);
        }
        IpAddr::V6(a) => {
            v6.insert((prefix_len, masked(a.octets(), prefix_len)), value);
        }
    }
}

fn longest_match<const N: usize, V: Copy>(
    trie: &BTreeMap<(u32, [u8; N]), V>,
    addr: [u8; N],
) -> Option<V> {
    (0..=(N as u32 * 8))
        .rev()
        .find_map(|len| trie.get(&(len, masked(addr, len))).copied())
}

impl Maps {
    /// Inserts an ipcache prefix (the address is masked as the kernel would).
    pub fn insert_prefix(&mut self, addr: IpAddr, prefix_len: u32, entry: IpcacheEntry) {
        insert_masked(
            (&mut self.ipcache_v4, &mut self.ipcache_v6),
            addr,
            prefix_len,
            entry,
        );
    }

    /// Inserts a Service frontend prefix (masked as the kernel would).
    pub fn insert_frontend(&mut self, addr: IpAddr, prefix_len: u32, entry: ServiceEntry) {
        insert_masked(
            (&mut self.frontends_v4, &mut self.frontends_v6),
            addr,
            prefix_len,
            entry,
        );
    }

    /// Whether `addr` is a Service frontend or in a Service range: a new
    /// flow of an egress-isolated pod to it is judged after DNAT.
    pub fn is_frontend(&self, addr: IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => longest_match(&self.frontends_v4, a.octets()).is_some(),
            IpAddr::V6(a) => longest_match(&self.frontends_v6, a.octets()).is_some(),
        }
    }

    /// Longest-prefix lookup; an address nobody claims is [`IpcacheEntry::UNKNOWN`].
    pub fn ipcache_lookup(&self, addr: IpAddr) -> IpcacheEntry {
        match addr {
            IpAddr::V4(a) => longest_match(&self.ipcache_v4, a.octets()),
            IpAddr::V6(a) => longest_match(&self.ipcache_v6, a.octets()),
        }
        .unwrap_or(IpcacheEntry::UNKNOWN)
    }

    /// The policy probes for one peer identity, in the kernel's order: port
    /// prefixes from the longest (one port) to 0 (all ports of the
    /// protocol), then the any-protocol entry.
    pub fn probes_for_peer(
        ep: &EndpointInfo,
        dir: u8,
        peer: u32,
        protocol: u8,
        port: u16,
    ) -> Vec<PolicyKey> {
        let bits = ep.lookups(dir);
        let mut out = Vec::new();
        if has_ports(protocol) {
            for len in (0..=16u8).rev() {
                if bits & lookups::port_prefix(len) != 0 {
                    out.push(PolicyKey::new(ep.identity, dir, peer, protocol, len, port));
                }
            }
        }
        if bits & lookups::ANY_PROTOCOL != 0 {
            out.push(PolicyKey::new(ep.identity, dir, peer, proto::ANY, 0, 0));
        }
        out
    }

    /// The peer identities probed, in order: the label identity (if the
    /// address has one), the address class (if some entry names one), then
    /// the wildcard peer.
    pub fn peers_to_probe(ep: &EndpointInfo, dir: u8, peer: IpcacheEntry) -> Vec<u32> {
        let mut out = Vec::with_capacity(3);
        if peer.identity != identity::ANY {
            out.push(peer.identity);
        }
        if ep.lookups(dir) & lookups::CLASS_PEER != 0 {
            out.push(peer.cidr_identity);
        }
        if ep.lookups(dir) & lookups::ANY_PEER != 0 {
            out.push(identity::ANY);
        }
        out
    }

    /// Judges a new flow of endpoint `ep` with `peer_addr` in `dir`, the
    /// peer being what the address says.
    pub fn judge(
        &self,
        ep: &EndpointInfo,
        dir: u8,
        peer_addr: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Judgement {
        self.judge_as(ep, dir, peer_addr, protocol, port, PeerOf::Address)
    }

    /// A client's egress judged after DNAT against the `backend` it
    /// reached, which may be the client itself (a Service hairpin: see
    /// [`Self::judge_as`]).
    pub fn judge_backend(
        &self,
        ep: &EndpointInfo,
        backend: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Judgement {
        let peer_of = if pod_holds(ep, backend) {
            PeerOf::Itself
        } else {
            PeerOf::Address
        };
        self.judge_as(ep, direction::EGRESS, backend, protocol, port, peer_of)
    }

    /// The address of the family of `like` that the local pod at `ifindex`
    /// holds, if it is still there.
    fn pod_address(&self, ifindex: u32, like: IpAddr) -> Option<IpAddr> {
        self.endpoints.get(&ifindex).and_then(|client| {
            if like.is_ipv4() {
                (client.flags & ENDPOINT_HAS_V4 != 0).then(|| IpAddr::from(client.ipv4))
            } else {
                (client.flags & ENDPOINT_HAS_V6 != 0).then(|| IpAddr::from(client.ipv6))
            }
        })
    }

    /// The identities the far side of a flow is judged by.
    fn peer_entry(&self, peer_addr: IpAddr, peer_of: PeerOf) -> IpcacheEntry {
        match peer_of {
            PeerOf::Address | PeerOf::Itself => self.ipcache_lookup(peer_addr),
            PeerOf::Forwarded => {
                let mut peer = self.ipcache_lookup(peer_addr);
                if peer.identity == identity::NODE {
                    peer.identity = identity::ANY;
                }
                peer
            }
            // The pod's own address of the same family, as if its packet
            // had arrived unchanged; a pod gone is nobody.
            PeerOf::Pod(ifindex) => self
                .pod_address(ifindex, peer_addr)
                .map_or(IpcacheEntry::UNKNOWN, |a| self.ipcache_lookup(a)),
        }
    }

    /// Judges a new flow of endpoint `ep` in `dir`, its far side
    /// `peer_addr` as `peer_of` says. The node's own addresses are always
    /// allowed, but for what a pod sends to them encapsulated (IP-in-IP,
    /// IPv6-in-IPv4, GRE, EtherIP, MPLS-in-IP, VXLAN on UDP 4789 or 8472,
    /// GENEVE on UDP 6081): a node that decapsulates it sends its inner
    /// packet on with a source the pod chose, so it is judged by the
    /// address's class as any other peer.
    pub fn judge_as(
        &self,
        ep: &EndpointInfo,
        dir: u8,
        peer_addr: IpAddr,
        protocol: u8,
        port: u16,
        peer_of: PeerOf,
    ) -> Judgement {
        let mut peer = self.peer_entry(peer_addr, peer_of);
        // A pod's traffic to itself through a Service: allowed, but where
        // tiers judge it ("A Pod connecting to a Service IP that the
        // service proxy load-balances back to the same Pod is subject to
        // ClusterNetworkPolicy"), the NetworkPolicy tier allowing it. What
        // reaches it from its own interface is such a hairpin.
        let itself = match peer_of {
            PeerOf::Itself => true,
            PeerOf::Pod(ifindex) => self
                .pod_address(ifindex, peer_addr)
                .is_some_and(|a| pod_holds(ep, a)),
            PeerOf::Address | PeerOf::Forwarded => false,
        };
        if itself && !ep.tiered(dir) {
            return Judgement {
                reason: Reason::AllowSelf,
                matched: None,
                peer,
                rule: RuleRef::default(),
            };
        }
        // What a pod sends the node, unencapsulated, under tiers: judged
        // by the tiers (`nodes` and `networks` peers), the NetworkPolicy
        // tier allowing it.
        let mut to_node = false;
        if peer.identity == identity::NODE {
            let encapsulated = matches!(protocol, 4 | 41 | 47 | 97 | 137)
                || (protocol == proto::UDP && matches!(port, 4789 | 8472 | 6081));
            if dir == direction::INGRESS || (!encapsulated && !ep.tiered(dir)) {
                return Judgement {
                    reason: Reason::AllowNode,
                    matched: None,
                    peer,
                    rule: RuleRef::default(),
                };
            }
            to_node = !encapsulated;
            peer.identity = identity::ANY;
        }
        let verdict = |reason, matched, rule| Judgement {
            reason,
            matched,
            peer,
            rule,
        };
        if !ep.judged(dir) {
            return verdict(Reason::AllowNotIsolated, None, RuleRef::default());
        }
        // An address in transit matches no rule; under tiers no match is
        // not a denial (the default allows), so it is refused outright.
        if ep.updating(dir) || (ep.tiered(dir) && peer.cidr_identity == identity::IN_TRANSIT) {
            return verdict(Reason::DropUpdating, None, RuleRef::default());
        }
        let probes = Self::peers_to_probe(ep, dir, peer)
            .into_iter()
            .flat_map(|peer_id| Self::probes_for_peer(ep, dir, peer_id, protocol, port));
        if !ep.tiered(dir) {
            // NetworkPolicy alone: any NetworkPolicy entry allows (one of
            // tier slots alone may land before its endpoint's tier flag).
            for key in probes {
                if let Some(e) = self.policy.get(&key)
                    && e.flags & ENTRY_TIERS_ONLY == 0
                {
                    let rule = RuleRef {
                        network_policy: e.rule_ref,
                        ..RuleRef::default()
                    };
                    return verdict(Reason::AllowPolicy, Some(key), rule);
                }
            }
            return verdict(Reason::DropPolicy, None, RuleRef::default());
        }
        // Every shape is probed; each tier keeps its best slot.
        let hits: Vec<(PolicyKey, PolicyEntry)> = probes
            .filter_map(|key| self.policy.get(&key).map(|e| (key, *e)))
            .collect();
        let mut tiers = Tiers::default();
        for (_, entry) in &hits {
            tiers.add(entry);
        }
        let mut reason = tiers.decide(ep.isolated(dir));
        if reason == Reason::DropPolicy {
            if to_node {
                reason = Reason::AllowNode;
            } else if itself {
                reason = Reason::AllowSelf;
            }
        }
        // The entry that decided: the winning tier slot's, or the first
        // NetworkPolicy allow.
        let matched = hits.iter().find_map(|(key, e)| {
            let decided = match reason {
                Reason::AllowAdminTier | Reason::DropAdminTier => e.admin == tiers.admin,
                Reason::AllowBaselineTier | Reason::DropBaselineTier => {
                    e.baseline == tiers.baseline
                }
                Reason::AllowPolicy => e.flags & ENTRY_TIERS_ONLY == 0,
                _ => false,
            };
            decided.then_some(*key)
        });
        let rule = RuleRef {
            network_policy: tiers.network_policy_rule,
            admin: tiers.admin,
            baseline: tiers.baseline,
        };
        verdict(reason, matched, rule)
    }
}
