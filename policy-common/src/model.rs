//! A pure-Rust statement of the classifier's decision procedure.
//!
//! It follows `policy-ebpf` step by step, over ordinary collections, so
//! tests can check the kernel against it packet by packet, and the agent can
//! explain a verdict from the exact map content it wrote. Timeouts are not
//! modelled (tests run far inside them).
//!
//! Order of a verdict, for a packet at endpoint E in direction D:
//! 1. no endpoint for the ifindex → pass;
//! 2. not IP → pass; malformed → drop; ICMPv6 ND → pass;
//! 3. source == destination → pass (a pod talking to itself);
//! 4. non-first fragment → pass iff its first fragment passed here;
//! 5. conntrack, forward key → established (re-judged if E's revision moved);
//! 6. conntrack, reversed key → reply (re-judged likewise, in the flow's
//!    original direction);
//! 7. ICMP error whose quoted header is a tracked flow → related;
//! 8. judge as a new flow (see [`Maps::judge`]); if allowed, track it.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use crate::{
    conntrack::{
        CT_FLAG_CLOSING, CT_FLAG_SYN_ONLY, CT_LOOKUP_FORWARD, CT_LOOKUP_REPLY, CtEntry, CtKey,
        ct_lookups,
    },
    direction,
    endpoint::{EndpointInfo, lookups},
    family, identity,
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    proto,
    verdict::Reason,
};

pub use crate::proto::has_ports;

/// The content of the datapath maps the verdict depends on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Maps {
    pub endpoints: BTreeMap<u32, EndpointInfo>,
    /// (prefix length, address bytes masked to the prefix) → entry.
    pub ipcache_v4: BTreeMap<(u32, [u8; 4]), IpcacheEntry>,
    pub ipcache_v6: BTreeMap<(u32, [u8; 16]), IpcacheEntry>,
    pub policy: BTreeMap<PolicyKey, PolicyEntry>,
}

/// Outcome of judging a flow against the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judgement {
    pub reason: Reason,
    /// The policy key that allowed it, when a policy entry did.
    pub matched: Option<PolicyKey>,
    /// What the peer address resolved to.
    pub peer: IpcacheEntry,
}

fn masked<const N: usize>(addr: [u8; N], prefix_len: u32) -> [u8; N] {
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

fn longest_match<const N: usize>(
    trie: &BTreeMap<(u32, [u8; N]), IpcacheEntry>,
    addr: [u8; N],
) -> Option<IpcacheEntry> {
    (0..=(N as u32 * 8))
        .rev()
        .find_map(|len| trie.get(&(len, masked(addr, len))).copied())
}

impl Maps {
    /// Inserts an ipcache prefix (the address is masked as the kernel would).
    pub fn insert_prefix(&mut self, addr: IpAddr, prefix_len: u32, entry: IpcacheEntry) {
        match addr {
            IpAddr::V4(a) => {
                self.ipcache_v4
                    .insert((prefix_len, masked(a.octets(), prefix_len)), entry);
            }
            IpAddr::V6(a) => {
                self.ipcache_v6
                    .insert((prefix_len, masked(a.octets(), prefix_len)), entry);
            }
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
    /// address has one), the address class, then the wildcard peer.
    pub fn peers_to_probe(ep: &EndpointInfo, dir: u8, peer: IpcacheEntry) -> Vec<u32> {
        let mut out = Vec::with_capacity(3);
        if peer.identity != identity::ANY {
            out.push(peer.identity);
        }
        out.push(peer.cidr_identity);
        if ep.lookups(dir) & lookups::ANY_PEER != 0 {
            out.push(identity::ANY);
        }
        out
    }

    /// Judges a new flow of endpoint `ep` with `peer_addr` in `dir`.
    pub fn judge(
        &self,
        ep: &EndpointInfo,
        dir: u8,
        peer_addr: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Judgement {
        let peer = self.ipcache_lookup(peer_addr);
        let verdict = |reason, matched| Judgement {
            reason,
            matched,
            peer,
        };
        if peer.identity == identity::NODE {
            return verdict(Reason::AllowNode, None);
        }
        if !ep.isolated(dir) {
            return verdict(Reason::AllowNotIsolated, None);
        }
        for peer_id in Self::peers_to_probe(ep, dir, peer) {
            for key in Self::probes_for_peer(ep, dir, peer_id, protocol, port) {
                if self.policy.contains_key(&key) {
                    return verdict(Reason::AllowPolicy, Some(key));
                }
            }
        }
        verdict(Reason::DropPolicy, None)
    }
}

/// A parsed packet, as the classifier sees it after its header walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    pub ifindex: u32,
    /// [`crate::direction`] relative to the pod.
    pub direction: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    /// For TCP/UDP/SCTP the ports; for ICMP echo the identifier in both.
    pub sport: u16,
    pub dport: u16,
    /// TCP flags byte (0 for other protocols).
    pub tcp_flags: u8,
    /// ICMP/ICMPv6 type (0 for other protocols).
    pub icmp_type: u8,
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

fn addr_bytes(a: IpAddr) -> ([u8; 16], u8) {
    match a {
        IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            (b, family::IPV4)
        }
        IpAddr::V6(v6) => (v6.octets(), family::IPV6),
    }
}

impl Packet {
    /// The conntrack key of this packet as it travels.
    pub fn ct_key(&self) -> CtKey {
        let (src, fam) = addr_bytes(self.src);
        let (dst, _) = addr_bytes(self.dst);
        CtKey {
            ifindex: self.ifindex,
            src,
            dst,
            sport: self.sport,
            dport: self.dport,
            protocol: self.protocol,
            family: fam,
            _pad: 0,
        }
    }

    /// The address on the far side from the pod.
    pub fn peer(&self) -> IpAddr {
        if self.direction == direction::EGRESS {
            self.dst
        } else {
            self.src
        }
    }

    /// The destination port used by policy (0 for portless protocols).
    pub fn policy_port(&self) -> u16 {
        proto::policy_port(self.protocol, self.dport)
    }
}

/// The maps plus the conntrack table, for stateful replay.
#[derive(Clone, Debug, Default)]
pub struct Datapath {
    pub maps: Maps,
    pub conntrack: HashMap<CtKey, CtEntry>,
}

impl Datapath {
    pub fn new(maps: Maps) -> Self {
        Self {
            maps,
            conntrack: HashMap::new(),
        }
    }

    /// The verdict for one well-formed IP packet, updating conntrack as the
    /// kernel does.
    pub fn classify(&mut self, pkt: &Packet) -> Judgement {
        let passthrough = |reason| Judgement {
            reason,
            matched: None,
            peer: IpcacheEntry::UNKNOWN,
        };
        let Some(ep) = self.maps.endpoints.get(&pkt.ifindex).copied() else {
            return passthrough(Reason::PassNoEndpoint);
        };
        if pkt.src == pkt.dst {
            return passthrough(Reason::AllowSelf);
        }
        let key = pkt.ct_key();
        let closing = pkt.protocol == proto::TCP && pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0;

        let lookups = ct_lookups(pkt.protocol, pkt.icmp_type);
        if lookups & CT_LOOKUP_FORWARD != 0
            && let Some(entry) = self.conntrack.get(&key).copied()
        {
            return self.rejudge(
                &ep,
                key,
                entry,
                pkt,
                pkt.direction,
                pkt.policy_port(),
                closing,
                Reason::AllowEstablished,
            );
        }
        let reversed = key.reversed();
        if lookups & CT_LOOKUP_REPLY != 0
            && let Some(entry) = self.conntrack.get(&reversed).copied()
        {
            // Judge again as the flow's opener: the other direction, the
            // same peer, the original destination port.
            let orig_port = proto::policy_port(pkt.protocol, pkt.sport);
            return self.rejudge(
                &ep,
                reversed,
                entry,
                pkt,
                entry.direction,
                orig_port,
                closing,
                Reason::AllowReply,
            );
        }

        let judged = self.maps.judge(
            &ep,
            pkt.direction,
            pkt.peer(),
            pkt.protocol,
            pkt.policy_port(),
        );
        if judged.reason == Reason::AllowPolicy || judged.reason == Reason::AllowNotIsolated {
            let mut flags = 0;
            if pkt.protocol == proto::TCP && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
                flags |= CT_FLAG_SYN_ONLY;
            }
            if closing {
                flags |= CT_FLAG_CLOSING;
            }
            self.conntrack.insert(
                key,
                CtEntry {
                    last_seen_ns: 0,
                    revision: ep.revision,
                    direction: pkt.direction,
                    flags,
                    _pad: 0,
                },
            );
        }
        judged
    }

    #[allow(clippy::too_many_arguments)]
    fn rejudge(
        &mut self,
        ep: &EndpointInfo,
        key: CtKey,
        mut entry: CtEntry,
        pkt: &Packet,
        dir: u8,
        port: u16,
        closing: bool,
        hit: Reason,
    ) -> Judgement {
        let mut out = Judgement {
            reason: hit,
            matched: None,
            peer: IpcacheEntry::UNKNOWN,
        };
        if entry.revision != ep.revision {
            let judged = self.maps.judge(ep, dir, pkt.peer(), pkt.protocol, port);
            out.peer = judged.peer;
            out.matched = judged.matched;
            if judged.reason.is_drop() {
                self.conntrack.remove(&key);
                out.reason = Reason::DropPolicyChanged;
                return out;
            }
            entry.revision = ep.revision;
        }
        if closing {
            entry.flags |= CT_FLAG_CLOSING;
        }
        if pkt.protocol == proto::TCP && pkt.tcp_flags & TCP_ACK != 0 {
            entry.flags &= !CT_FLAG_SYN_ONLY;
        }
        self.conntrack.insert(key, entry);
        out
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::endpoint::ENDPOINT_INGRESS_ISOLATED;

    fn ep(identity: u32, ingress_lookups: u32) -> EndpointInfo {
        EndpointInfo {
            identity,
            flags: ENDPOINT_INGRESS_ISOLATED,
            revision: 1,
            ingress_lookups,
            egress_lookups: 0,
            _reserved: 0,
        }
    }

    #[test]
    fn longest_prefix_wins() {
        let mut m = Maps::default();
        let a = IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3));
        m.insert_prefix(
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, 0)),
            8,
            IpcacheEntry {
                identity: 0,
                cidr_identity: identity::FIRST_CIDR,
            },
        );
        m.insert_prefix(
            IpAddr::V4(Ipv4Addr::new(10, 1, 0, 0)),
            16,
            IpcacheEntry {
                identity: 0,
                cidr_identity: identity::FIRST_CIDR + 1,
            },
        );
        assert_eq!(m.ipcache_lookup(a).cidr_identity, identity::FIRST_CIDR + 1);
        assert_eq!(
            m.ipcache_lookup(IpAddr::V4(Ipv4Addr::new(10, 2, 0, 1)))
                .cidr_identity,
            identity::FIRST_CIDR
        );
        assert_eq!(
            m.ipcache_lookup(IpAddr::V4(Ipv4Addr::new(11, 0, 0, 1))),
            IpcacheEntry::UNKNOWN
        );
    }

    #[test]
    fn port_range_prefix_matches_inside_only() {
        let mut m = Maps::default();
        let e = ep(300, lookups::port_prefix(13));
        // 8000-8007 is 8000/13.
        m.policy.insert(
            PolicyKey::new(
                300,
                direction::INGRESS,
                identity::WORLD,
                proto::TCP,
                13,
                8000,
            ),
            PolicyEntry::default(),
        );
        let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(
            m.judge(&e, direction::INGRESS, peer, proto::TCP, 8007)
                .reason,
            Reason::AllowPolicy
        );
        assert_eq!(
            m.judge(&e, direction::INGRESS, peer, proto::TCP, 8008)
                .reason,
            Reason::DropPolicy
        );
        assert_eq!(
            m.judge(&e, direction::INGRESS, peer, proto::UDP, 8001)
                .reason,
            Reason::DropPolicy
        );
    }

    #[test]
    fn reply_passes_and_is_rejudged_after_revision_change() {
        let mut m = Maps::default();
        let mut e = ep(300, lookups::port_prefix(16));
        m.policy.insert(
            PolicyKey::new(300, direction::INGRESS, identity::WORLD, proto::TCP, 16, 80),
            PolicyEntry::default(),
        );
        m.endpoints.insert(7, e);
        let mut dp = Datapath::new(m);
        let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
        let syn = Packet {
            ifindex: 7,
            direction: direction::INGRESS,
            src: peer,
            dst: pod,
            protocol: proto::TCP,
            sport: 40000,
            dport: 80,
            tcp_flags: TCP_SYN,
            icmp_type: 0,
        };
        let reply = Packet {
            ifindex: 7,
            direction: direction::EGRESS,
            src: pod,
            dst: peer,
            protocol: proto::TCP,
            sport: 80,
            dport: 40000,
            tcp_flags: TCP_SYN | TCP_ACK,
            icmp_type: 0,
        };
        assert_eq!(dp.classify(&syn).reason, Reason::AllowPolicy);
        assert_eq!(dp.classify(&reply).reason, Reason::AllowReply);
        // The policy goes away and the revision moves: the flow is cut.
        dp.maps.policy.clear();
        e.revision = 2;
        dp.maps.endpoints.insert(7, e);
        assert_eq!(dp.classify(&reply).reason, Reason::DropPolicyChanged);
        assert_eq!(dp.classify(&syn).reason, Reason::DropPolicy);
    }
}
