//! Tracked flows and the stateful verdict: conntrack, related ICMP
//! errors, re-judging on a revision change.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use crate::{
    direction, endpoint::EndpointInfo, ipcache::IpcacheEntry, pod_range_guard::ENFORCED_NODE,
    proto, service::mark, verdict::Reason,
};

use super::{
    Judgement, Maps, Outcome, Packet, PeerOf, Quoted, ServiceKey, ServiceState, TCP_ACK, TCP_FIN,
    TCP_RST, TCP_SYN, addr_bytes,
};

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
    pub(super) fn of(pkt: &Packet) -> Self {
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
    pub(super) fn answered(&self) -> Self {
        Self {
            opened: direction::opposite(self.opened),
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            ..*self
        }
    }

    /// Whether the other way's flow on this tuple is the same connection:
    /// every protocol but ICMP echo, whose request and reply roles must
    /// not meet (see [`echo_role`]).
    pub(super) fn one_key_both_ways(&self) -> bool {
        !matches!(self.protocol, proto::ICMP | proto::ICMPV6)
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
    /// A flow to a Service frontend, opened by the pod's egress: its
    /// verdict is the one taken after DNAT (see [`super::service`]).
    pub service: bool,
    /// Of a Service flow: not judged yet (the verdict after DNAT has not
    /// come back, or the revision moved and the backend is not known).
    pub pending: bool,
    /// Who its far side is (see [`PeerOf`]), kept to judge it again as it
    /// was first.
    pub peer_of: PeerOf,
}

impl FlowState {
    /// A flow judged now, under `revision`.
    pub fn judged(revision: u32, closing: bool) -> Self {
        Self {
            revision,
            closing,
            service: false,
            pending: false,
            peer_of: PeerOf::Address,
        }
    }
}

/// The maps plus the tracked flows, for stateful replay.
#[derive(Clone, Debug, Default)]
pub struct Datapath {
    pub maps: Maps,
    pub flows: HashMap<Flow, FlowState>,
    /// Clients' flows to Service frontends, by what survives DNAT
    /// (`SERVICE_FLOWS`).
    pub services: HashMap<ServiceKey, ServiceState>,
    /// Each interface's share of the tracked flows (`CT_SHARE`,
    /// `CT_USAGE`).
    pub share: Share,
}

/// The bound on one interface's tracked flows, as the kernel keeps it
/// (see `crate::conntrack_share`): what each interface opened, what the
/// agent last found gone, and the bound with the time it was counted.
#[derive(Clone, Debug, Default)]
pub struct Share {
    pub bound: crate::conntrack_share::CtShare,
    /// The classifier's clock.
    pub now: u64,
    pub opened: BTreeMap<u32, u64>,
    pub released: BTreeMap<u32, u64>,
}

impl Share {
    /// Whether `ifindex` may open one more flow; if so, it is counted
    /// (only while a bound is set: without one nothing is counted).
    pub fn allows(&mut self, ifindex: u32) -> bool {
        if self.bound.share == 0 {
            return true;
        }
        let opened = self.opened.entry(ifindex).or_default();
        let released = self.released.get(&ifindex).copied().unwrap_or(0);
        if !self.bound.may_open(*opened, released, self.now) {
            return false;
        }
        *opened = opened.wrapping_add(1);
        true
    }
}

/// Whether the pod with endpoint `ep` holds `addr`.
pub(super) fn pod_holds(ep: &EndpointInfo, addr: IpAddr) -> bool {
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
            services: HashMap::new(),
            share: Share::default(),
        }
    }

    /// What a pod's hook (`pkt.direction`: egress at `from_pod`, ingress
    /// at `to_pod`) does with one well-formed, unfragmented IP packet,
    /// updating the tracked flows as the kernel does. At the ingress hook
    /// a packet with the pending mark is first its client's egress after
    /// DNAT; a packet deferred to its Service leaves with the mark.
    pub fn classify(&mut self, pkt: &Packet) -> Outcome {
        let mut out = Outcome {
            after_dnat: None,
            judgement: None,
            mark: pkt.mark,
        };
        if pkt.direction == direction::INGRESS
            && let Some(client) = mark::client(pkt.mark)
        {
            out.mark &= !mark::MASK;
            let judged = self.after_dnat(client, pkt);
            out.after_dnat = Some(judged);
            if judged.reason.is_drop() {
                return out;
            }
        }
        let judged = self.decide(pkt);
        if judged.reason == Reason::PassService
            && let Some(m) = mark::pending(pkt.ifindex)
        {
            out.mark = (out.mark & !mark::MASK) | m;
        }
        out.judgement = Some(judged);
        out
    }

    /// Tracks `flow` as opened now. A connection is one flow whichever way
    /// it was opened: a flow opened the other way on the same tuple (one
    /// no packet could ride any more, a closing one a new SYN reuses) is
    /// replaced, as the kernel's one entry for both ways is.
    pub(super) fn open(&mut self, flow: Flow, state: FlowState) {
        if flow.one_key_both_ways() {
            self.flows.remove(&flow.answered());
        }
        self.flows.insert(flow, state);
    }

    /// The verdict of a pod's hook on one packet.
    fn decide(&mut self, pkt: &Packet) -> Judgement {
        let verdict = |reason| Judgement {
            reason,
            matched: None,
            peer: IpcacheEntry::UNKNOWN,
            rule: crate::event::RuleRef::default(),
        };
        let Some(ep) = self.maps.endpoints.get(&pkt.ifindex).copied() else {
            return verdict(Reason::PassNoEndpoint);
        };
        // Neighbour discovery and MLD as RFC 4861/3810 send them pass. At
        // the pod's ingress a hop limit of 255 proves the node sent it; at
        // its egress it proves nothing (the node would forward it), so
        // only what cannot leave the link passes, from an address the pod
        // may use there.
        if pkt.protocol == proto::ICMPV6 {
            let link_local = |a: IpAddr| match a {
                IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
                IpAddr::V4(_) => false,
            };
            let ok = match pkt.icmp_type {
                133..=137 => pkt.hop_limit == 255,
                130..=132 | 143 => {
                    pkt.hop_limit == 1 && (link_local(pkt.src) || pkt.src.is_unspecified())
                }
                _ => false,
            };
            let stays_on_link = match pkt.dst {
                IpAddr::V6(v6) => {
                    link_local(pkt.dst) || (v6.is_multicast() && v6.octets()[1] & 0x0f <= 2)
                }
                IpAddr::V4(_) => false,
            };
            let pods_own =
                pod_holds(&ep, pkt.src) || link_local(pkt.src) || pkt.src.is_unspecified();
            if ok && (pkt.direction == direction::INGRESS || (stays_on_link && pods_own)) {
                return verdict(Reason::AllowNeighborDiscovery);
            }
        }
        // What a pod sends must come from its own address. What reaches
        // it was sent by whoever the interface it entered the node at
        // says.
        let peer_of = if pkt.direction == direction::EGRESS {
            if !pod_holds(&ep, pkt.src) {
                return verdict(Reason::DropSpoofed);
            }
            if pkt.src == pkt.dst {
                return verdict(Reason::AllowSelf);
            }
            PeerOf::Address
        } else if pkt.ingress_ifindex == 0 {
            // The node itself sent it.
            PeerOf::Address
        } else if pkt.ingress_ifindex == pkt.ifindex {
            // The pod's own packet, back through the node (a Service
            // hairpin): allowed, but where tiers judge either way.
            if (ep.tiered(direction::INGRESS) || ep.tiered(direction::EGRESS))
                && pkt.ifindex < 0xffff
            {
                PeerOf::Pod(pkt.ifindex)
            } else {
                return verdict(Reason::AllowSelf);
            }
        } else {
            match self.maps.endpoints.get(&pkt.ingress_ifindex) {
                // A local pod's address enters the node only at its own
                // interface.
                None if self
                    .maps
                    .enforced
                    .get(&pkt.src)
                    .is_some_and(|at| *at != ENFORCED_NODE && *at != pkt.ingress_ifindex) =>
                {
                    return verdict(Reason::DropSpoofed);
                }
                None => PeerOf::Forwarded,
                Some(sender) if pod_holds(sender, pkt.src) => PeerOf::Address,
                // A flow's entry names the pod in 16 bits: one beyond
                // them is refused, not judged by the address it wears.
                Some(_) if pkt.ingress_ifindex >= 0xffff => {
                    return verdict(Reason::DropPolicy);
                }
                Some(_) => PeerOf::Pod(pkt.ingress_ifindex),
            }
        };
        // The pod-range guard. A packet of a flow tracked at the current
        // revision skips it: the agent moves every revision when an
        // address leaves `ENFORCED` or the ranges change, so such a flow's
        // peer was enforced when the flow was last judged, and a flow
        // judged again checks it first ([`Self::judge_again`]).
        let unenforced = self.maps.unenforced(pkt.peer());
        let port = pkt.policy_port();
        // A pod isolated in no direction needs no tracking.
        if !ep.tracks() {
            if unenforced {
                return verdict(Reason::DropUnenforced);
            }
            return self
                .maps
                .judge_as(&ep, pkt.direction, pkt.peer(), pkt.protocol, port, peer_of);
        }
        if let Some(q) = pkt.quoted {
            // An ICMP error from an unenforced address is never related.
            if unenforced {
                return verdict(Reason::DropUnenforced);
            }
            if let Some(judged) = self.related(&ep, pkt, &q) {
                return judged;
            }
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
                if !st.service {
                    return self.rejudge(
                        &ep,
                        own,
                        st,
                        pkt.dport,
                        closing,
                        Reason::AllowEstablished,
                    );
                }
                if let Some(judged) = self.service_hit(&ep, own, st, closing, true) {
                    return judged;
                }
            }
            let answered = own.answered();
            if echo_role(pkt) != Some(true)
                && let Some(st) = self.flows.get(&answered).copied().filter(usable)
            {
                if !st.service {
                    return self.rejudge(&ep, answered, st, pkt.sport, closing, Reason::AllowReply);
                }
                if let Some(judged) = self.service_hit(&ep, answered, st, closing, false) {
                    return judged;
                }
            }
        }
        if unenforced {
            return verdict(Reason::DropUnenforced);
        }
        // To a Service frontend: the backend is chosen after this hook.
        if pkt.direction == direction::EGRESS
            && ep.judged(direction::EGRESS)
            && proto::has_ports(pkt.protocol)
            && self.maps.is_frontend(pkt.dst)
        {
            return self.defer(&ep, pkt);
        }
        let judged =
            self.maps
                .judge_as(&ep, pkt.direction, pkt.peer(), pkt.protocol, port, peer_of);
        let allowed = ep.tracks_new(judged.reason, pkt.direction);
        // Only what the pod sent, or received at its own address, opens a
        // flow; and never a TCP packet without SYN (a mid-stream packet
        // cannot say who opened the connection: the pod answering a
        // connection a policy change just cut would otherwise reopen it
        // in its own name, and the peer's packets would pass as replies).
        let opens = pkt.direction == direction::EGRESS || pod_holds(&ep, pkt.dst);
        let midstream = pkt.protocol == proto::TCP && pkt.tcp_flags & TCP_SYN == 0;
        if allowed && trackable && opens && !midstream && self.share.allows(pkt.ifindex) {
            self.open(
                Flow::of(pkt),
                FlowState {
                    peer_of,
                    ..FlowState::judged(ep.revision, closing)
                },
            );
        }
        judged
    }

    /// An ICMP error is related when it goes back to the quoted packet's
    /// sender and the quoted packet belongs to a flow tracked at this
    /// interface that is still allowed. None: judge it as plain ICMP. A
    /// flow denied now keeps what its new judgement found (its record's
    /// rule).
    fn related(&mut self, ep: &EndpointInfo, pkt: &Packet, q: &Quoted) -> Option<Judgement> {
        let related = Judgement {
            reason: Reason::AllowRelated,
            matched: None,
            peer: IpcacheEntry::UNKNOWN,
            rule: crate::event::RuleRef::default(),
        };
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
        if st.service {
            return Some(self.service_related(ep, flow, st));
        }
        if st.revision != ep.revision {
            let judged = self.judge_again(ep, &flow, flow.dport, st.peer_of);
            if judged.reason.is_drop() {
                self.flows.remove(&flow);
                return Some(Judgement {
                    reason: judged.reason.when_judged_again(),
                    rule: judged.rule,
                    ..related
                });
            }
            self.flows.insert(
                flow,
                FlowState {
                    revision: ep.revision,
                    ..st
                },
            );
        }
        Some(related)
    }

    /// A tracked flow judged as if new, as its opener was: its direction,
    /// its peer, `port` its destination port; its peer first checked by
    /// the pod-range guard, which its packets skip while the revision
    /// stands.
    fn judge_again(&self, ep: &EndpointInfo, flow: &Flow, port: u16, peer_of: PeerOf) -> Judgement {
        if self.maps.unenforced(flow.peer()) {
            return super::pod_range_guard::dropped();
        }
        let port = proto::policy_port(flow.protocol, port);
        self.maps
            .judge_as(ep, flow.opened, flow.peer(), flow.protocol, port, peer_of)
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
            rule: crate::event::RuleRef::default(),
        };
        if st.revision != ep.revision {
            let judged = self.judge_again(ep, &flow, port, st.peer_of);
            out.peer = judged.peer;
            out.matched = judged.matched;
            out.rule = judged.rule;
            if judged.reason.is_drop() {
                self.flows.remove(&flow);
                out.reason = judged.reason.when_judged_again();
                return out;
            }
            st.revision = ep.revision;
        }
        st.closing |= closing;
        self.flows.insert(flow, st);
        out
    }
}
