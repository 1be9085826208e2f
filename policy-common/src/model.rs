//! A pure-Rust statement of the classifier's decision procedure.
//!
//! It states the rules in its own terms (flows named by the hook and
//! tuple that opened them, not the kernel's keys), over ordinary
//! collections, so tests can check the kernel against it packet by packet,
//! and the agent can explain a verdict from the exact map content it
//! wrote. Timeouts, fragments and malformed headers are not modelled (the
//! packet tests cover them).
//!
//! Order of a verdict, for a packet at endpoint E in direction D:
//! 1. no endpoint for the ifindex → pass;
//! 2. ICMPv6 neighbour discovery with hop limit 255, MLD from a link-local
//!    (or unspecified) source with hop limit 1 → pass;
//! 3. sent by the pod (egress) from an address that is not its own → drop
//!    (spoofed); from its own address to itself → pass;
//! 4. E isolated in no direction: judge (nothing is tracked);
//! 5. an ICMP error travelling back to the sender of the packet it quotes,
//!    which belongs to a flow tracked at E and still allowed → related;
//! 6. a flow opened at E in D with this tuple → established; a flow opened
//!    at E in the other direction with the reversed tuple → reply (both
//!    re-judged as the opener if E's revision moved; an echo request only
//!    continues, an echo reply only answers; other ICMP is never tracked; a
//!    SYN does not ride a closing flow);
//! 7. judge as a new flow (see [`Maps::judge`]); if allowed, and the pod
//!    sent it or receives it at its own address, track it.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use crate::{
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

/// The header an ICMP error quotes: the offending packet as it travelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quoted {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    /// TCP/UDP/SCTP ports; for a quoted ICMP echo the identifier in both.
    pub sport: u16,
    pub dport: u16,
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
    /// IPv4 TTL / IPv6 hop limit.
    pub hop_limit: u8,
    /// For ICMP errors (destination unreachable, time exceeded, parameter
    /// problem; ICMPv6 1-4): the quoted header, when readable.
    pub quoted: Option<Quoted>,
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

/// A tracked flow, named as its first packet travelled: at which
/// interface, in which direction, with which tuple.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Flow {
    pub ifindex: u32,
    /// The direction of the packet that opened it.
    pub opened: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    pub sport: u16,
    pub dport: u16,
}

impl Flow {
    /// The flow `pkt` would open.
    fn of(pkt: &Packet) -> Self {
        Self {
            ifindex: pkt.ifindex,
            opened: pkt.direction,
            src: pkt.src,
            dst: pkt.dst,
            protocol: pkt.protocol,
            sport: pkt.sport,
            dport: pkt.dport,
        }
    }

    /// The flow a reply to this one belongs to: opened the other way,
    /// with the tuple reversed.
    fn answered(&self) -> Self {
        Self {
            opened: direction::opposite(self.opened),
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            ..*self
        }
    }

    /// The far side, as the opener saw it.
    fn peer(&self) -> IpAddr {
        if self.opened == direction::EGRESS {
            self.dst
        } else {
            self.src
        }
    }
}

/// What the model remembers of a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowState {
    /// The endpoint revision it was last judged under.
    pub revision: u32,
    /// A FIN or RST was seen.
    pub closing: bool,
}

/// The maps plus the tracked flows, for stateful replay.
#[derive(Clone, Debug, Default)]
pub struct Datapath {
    pub maps: Maps,
    pub flows: HashMap<Flow, FlowState>,
}

/// Whether the pod with endpoint `ep` holds `addr`.
fn pod_holds(ep: &EndpointInfo, addr: IpAddr) -> bool {
    let (bytes, fam) = addr_bytes(addr);
    ep.owns(fam, &bytes)
}

/// How an ICMP echo may meet conntrack: a request only continues the flow
/// it opened, a reply only answers a request (the identifier alone would
/// let a far-side request pose as a reply). None: not an echo.
fn echo_role(pkt: &Packet) -> Option<bool> {
    match (pkt.protocol, pkt.icmp_type) {
        (proto::ICMP, 8) | (proto::ICMPV6, 128) => Some(true),
        (proto::ICMP, 0) | (proto::ICMPV6, 129) => Some(false),
        _ => None,
    }
}

impl Datapath {
    pub fn new(maps: Maps) -> Self {
        Self {
            maps,
            flows: HashMap::new(),
        }
    }

    /// The verdict for one well-formed, unfragmented IP packet, updating
    /// the tracked flows as the kernel does.
    pub fn classify(&mut self, pkt: &Packet) -> Judgement {
        let verdict = |reason| Judgement {
            reason,
            matched: None,
            peer: IpcacheEntry::UNKNOWN,
        };
        let Some(ep) = self.maps.endpoints.get(&pkt.ifindex).copied() else {
            return verdict(Reason::PassNoEndpoint);
        };
        // Neighbour discovery and MLD as RFC 4861/3810 send them pass.
        if pkt.protocol == proto::ICMPV6 {
            let (src, _) = addr_bytes(pkt.src);
            let link_local = pkt.src.is_ipv6() && src[0] == 0xfe && (src[1] & 0xc0) == 0x80;
            let unspecified = pkt.src.is_unspecified();
            let ok = match pkt.icmp_type {
                133..=137 => pkt.hop_limit == 255,
                130..=132 | 143 => pkt.hop_limit == 1 && (link_local || unspecified),
                _ => false,
            };
            if ok {
                return verdict(Reason::AllowNeighborDiscovery);
            }
        }
        // What a pod sends must come from its own address.
        if pkt.direction == direction::EGRESS {
            if !pod_holds(&ep, pkt.src) {
                return verdict(Reason::DropSpoofed);
            }
            if pkt.src == pkt.dst {
                return verdict(Reason::AllowSelf);
            }
        }
        let port = pkt.policy_port();
        // A pod isolated in no direction needs no tracking.
        if !ep.tracks() {
            return self
                .maps
                .judge(&ep, pkt.direction, pkt.peer(), pkt.protocol, port);
        }
        if let Some(q) = pkt.quoted
            && let Some(reason) = self.related(&ep, pkt, &q)
        {
            return verdict(reason);
        }
        let trackable = match pkt.protocol {
            proto::ICMP | proto::ICMPV6 => echo_role(pkt).is_some(),
            _ => true,
        };
        let opening_syn =
            pkt.protocol == proto::TCP && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
        let closing = pkt.protocol == proto::TCP && pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0;
        // A new SYN on a closing flow's tuple opens a new connection.
        let usable = |st: &FlowState| !(opening_syn && st.closing);
        if trackable {
            let own = Flow::of(pkt);
            if echo_role(pkt) != Some(false)
                && let Some(st) = self.flows.get(&own).copied().filter(usable)
            {
                return self.rejudge(&ep, own, st, pkt.dport, closing, Reason::AllowEstablished);
            }
            let answered = own.answered();
            if echo_role(pkt) != Some(true)
                && let Some(st) = self.flows.get(&answered).copied().filter(usable)
            {
                return self.rejudge(&ep, answered, st, pkt.sport, closing, Reason::AllowReply);
            }
        }
        let judged = self
            .maps
            .judge(&ep, pkt.direction, pkt.peer(), pkt.protocol, port);
        let allowed = matches!(
            judged.reason,
            Reason::AllowPolicy | Reason::AllowNotIsolated
        );
        // Only what the pod sent, or received at its own address, opens a flow.
        let opens = pkt.direction == direction::EGRESS || pod_holds(&ep, pkt.dst);
        if allowed && trackable && opens {
            self.flows.insert(
                Flow::of(pkt),
                FlowState {
                    revision: ep.revision,
                    closing,
                },
            );
        }
        judged
    }

    /// An ICMP error is related when it goes back to the quoted packet's
    /// sender and the quoted packet belongs to a flow tracked at this
    /// interface that is still allowed. None: judge it as plain ICMP.
    fn related(&mut self, ep: &EndpointInfo, pkt: &Packet, q: &Quoted) -> Option<Reason> {
        if pkt.dst != q.src {
            return None;
        }
        // The quoted packet travelled against the error.
        let quoted = Flow {
            ifindex: pkt.ifindex,
            opened: direction::opposite(pkt.direction),
            src: q.src,
            dst: q.dst,
            protocol: q.protocol,
            sport: q.sport,
            dport: q.dport,
        };
        let flow = [quoted, quoted.answered()]
            .into_iter()
            .find(|f| self.flows.contains_key(f))?;
        let st = self.flows.get(&flow).copied()?;
        if st.revision != ep.revision {
            let port = proto::policy_port(flow.protocol, flow.dport);
            let judged = self
                .maps
                .judge(ep, flow.opened, flow.peer(), flow.protocol, port);
            if judged.reason.is_drop() {
                self.flows.remove(&flow);
                return Some(Reason::DropPolicyChanged);
            }
            self.flows.insert(
                flow,
                FlowState {
                    revision: ep.revision,
                    ..st
                },
            );
        }
        Some(Reason::AllowRelated)
    }

    /// A packet of a tracked flow: judged again (as the flow's opener:
    /// its direction, its peer, `port` its destination port) when the
    /// endpoint's revision moved since; denied → the flow is forgotten.
    fn rejudge(
        &mut self,
        ep: &EndpointInfo,
        flow: Flow,
        mut st: FlowState,
        port: u16,
        closing: bool,
        hit: Reason,
    ) -> Judgement {
        let mut out = Judgement {
            reason: hit,
            matched: None,
            peer: IpcacheEntry::UNKNOWN,
        };
        if st.revision != ep.revision {
            let port = proto::policy_port(flow.protocol, port);
            let judged = self
                .maps
                .judge(ep, flow.opened, flow.peer(), flow.protocol, port);
            out.peer = judged.peer;
            out.matched = judged.matched;
            if judged.reason.is_drop() {
                self.flows.remove(&flow);
                out.reason = Reason::DropPolicyChanged;
                return out;
            }
            st.revision = ep.revision;
        }
        st.closing |= closing;
        self.flows.insert(flow, st);
        out
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::endpoint::{ENDPOINT_HAS_V4, ENDPOINT_INGRESS_ISOLATED};

    fn ep(identity: u32, ingress_lookups: u32) -> EndpointInfo {
        EndpointInfo {
            identity,
            flags: ENDPOINT_INGRESS_ISOLATED | ENDPOINT_HAS_V4,
            revision: 1,
            ingress_lookups,
            ipv4: [10, 0, 0, 5],
            ..Default::default()
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
            hop_limit: 64,
            quoted: None,
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
            hop_limit: 64,
            quoted: None,
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

    #[test]
    fn a_forged_source_opens_nothing() {
        let mut e = ep(300, 0);
        e.flags |= crate::endpoint::ENDPOINT_EGRESS_ISOLATED;
        e.egress_lookups = lookups::ANY_PROTOCOL | lookups::ANY_PEER;
        let mut m = Maps::default();
        m.policy.insert(
            PolicyKey::new(300, direction::EGRESS, identity::ANY, proto::ANY, 0, 0),
            PolicyEntry::default(),
        );
        m.endpoints.insert(7, e);
        let mut dp = Datapath::new(m);
        let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
        let x = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9));
        let pkt = |direction, src, dst| Packet {
            ifindex: 7,
            direction,
            src,
            dst,
            protocol: proto::UDP,
            sport: 5000,
            dport: 53,
            tcp_flags: 0,
            icmp_type: 0,
            hop_limit: 64,
            quoted: None,
        };
        // Sent by the pod with X's source, to itself: spoofed, no flow.
        assert_eq!(
            dp.classify(&pkt(direction::EGRESS, x, pod)).reason,
            Reason::DropSpoofed
        );
        assert!(dp.flows.is_empty());
        // So X -> pod is judged as new ingress (isolated, no rule): dropped.
        assert_eq!(
            dp.classify(&pkt(direction::INGRESS, x, pod)).reason,
            Reason::DropPolicy
        );
    }
}
