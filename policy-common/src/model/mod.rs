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
//!    (or unspecified) source with hop limit 1 → pass; at a pod's egress
//!    only towards a destination that cannot leave the link, from the
//!    pod's own, a link-local or the unspecified address;
//! 3. sent by the pod (egress) from an address that is not its own → drop
//!    (spoofed); from its own address to itself → pass; reaching the pod
//!    (ingress): who sent it, by the interface it entered the node at
//!    ([`PeerOf`]; its own packet back through a Service → pass);
//!    3a. the peer (destination at egress, source at ingress) in the node's
//!    pod ranges and not enforced → drop (see [`pod_range_guard`]), except
//!    for a packet of a flow tracked at E under E's current revision (step
//!    6, which comes first: the agent moves every revision when an address
//!    leaves `ENFORCED` or the ranges change, and a flow judged again
//!    checks its peer first);
//! 4. E isolated in no direction: judge (nothing is tracked);
//! 5. an ICMP error travelling back to the sender of the packet it quotes,
//!    which belongs to a flow tracked at E and still allowed → related;
//! 6. a flow opened at E in D with this tuple → established; a flow opened
//!    at E in the other direction with the reversed tuple → reply (both
//!    re-judged as the opener if E's revision moved; an echo request only
//!    continues, an echo reply only answers; other ICMP is never tracked; a
//!    SYN does not ride a closing flow);
//! 7. sent by an egress-isolated pod over TCP, UDP or SCTP to a Service
//!    frontend ([`Maps::is_frontend`]) → deferred (see [`service`]);
//! 8. judge as a new flow (see [`Maps::judge`]); if allowed, and the pod
//!    sent it or receives it at its own address, track it.
//!
//! At a pod's ingress hook (`to_pod`) and at the uplink (`to_uplink`) a
//! packet carrying the pending mark ([`crate::service::mark`]) is first
//! the egress of the client the mark names, judged against where DNAT
//! sent it ([`Datapath::classify`], [`Datapath::uplink`]); a flow to a
//! Service is a tracked flow of the client whose verdict that judgement
//! gives ([`FlowState::pending`]).

mod flows;
mod maps;
pub mod pod_range_guard;
pub mod service;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_service;

use std::net::IpAddr;

use crate::{direction, family, proto, verdict::Reason};

pub use self::{
    flows::{Datapath, Flow, FlowState, Share},
    maps::{Judgement, Maps},
    service::{ServiceKey, ServiceState},
};
pub use crate::proto::has_ports;

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
    /// `skb->mark` as the packet reaches the hook.
    pub mark: u32,
    /// The interface the packet entered the node at (`ingress_ifindex`; 0:
    /// the node itself sent it). It says who sent a packet reaching a pod
    /// (see [`PeerOf`]).
    pub ingress_ifindex: u32,
}

/// Who the far side of a flow towards a pod is, for its verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PeerOf {
    /// The packet's address says (every flow a pod opens, and what the
    /// node itself sends).
    #[default]
    Address,
    /// The packet entered the node at an interface that is no local pod's:
    /// its address says, but a node address does not make it the node's
    /// traffic (the node only forwarded it).
    Forwarded,
    /// The packet entered the node at this local pod's interface and
    /// something on the way rewrote its source (a masquerade): it is that
    /// pod's.
    Pod(u32),
    /// The pod's own address, which it reached through a Service (the
    /// backend kube-proxy picked is the pod itself): the address says, and
    /// the peer is the pod itself.
    Itself,
}

/// What one hook did with a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// A packet carrying the pending mark, at a hook after DNAT: the
    /// egress of the client the mark names, judged against the rewritten
    /// destination (counted as that client's egress).
    pub after_dnat: Option<Judgement>,
    /// The hook's own verdict on the packet: None when the verdict after
    /// DNAT dropped it first, and at the uplinks unless the pod-range guard
    /// drops it (they judge nothing else).
    pub judgement: Option<Judgement>,
    /// The `skb->mark` the packet leaves with.
    pub mark: u32,
}

impl Outcome {
    /// The reason that decided the packet's fate: the hook's own verdict,
    /// else the one after DNAT; None: the uplink let an unmarked packet
    /// by without judging it.
    pub fn reason(&self) -> Option<Reason> {
        self.judgement.or(self.after_dnat).map(|j| j.reason)
    }

    /// Whether the packet goes on.
    pub fn passes(&self) -> bool {
        self.reason().is_none_or(|r| !r.is_drop())
    }
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
