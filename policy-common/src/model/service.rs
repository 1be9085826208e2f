//! Flows to Service frontends (see [`crate::service`]), in the model's
//! terms.
//!
//! 1. An egress-isolated pod's new TCP, UDP or SCTP flow to a frontend
//!    is *deferred* at its egress hook: tracked as pending (its tuple as
//!    sent, to the frontend), remembered by what survives DNAT
//!    ([`ServiceKey`] → [`ServiceState`]), passed (`PassService`) with the
//!    pending mark naming the client's interface. A client whose
//!    interface the mark cannot carry is refused (`DropPolicy`), and so is
//!    a flow whose key another live flow, to another frontend, holds: a
//!    verdict after DNAT could not tell the two apart.
//! 2. At the first hook after DNAT (a pod's ingress hook, or the uplink)
//!    a marked packet is the client's egress to where it landed: judged
//!    there ([`Datapath::after_dnat`]); allowed, the client's flow learns
//!    the backend and is no longer pending; denied, the flow is forgotten
//!    and the packet dropped. A packet of a judged flow that lands on the
//!    backend the flow learnt is established there. The mark is cleared
//!    either way.
//! 3. Later packets of the flow at the client ([`Datapath::service_hit`]):
//!    while pending, what the client sends is deferred again and what
//!    reaches it is a reply; once judged, what the client sends is still
//!    sent on with the mark (DNAT may choose anew: kube-proxy deletes a
//!    UDP flow's conntrack entry when its endpoint leaves) and a reply
//!    passes. On a revision change the flow is judged again against the
//!    backend it landed on; if that is not known, its packets are judged
//!    after DNAT again (a reply passes). A pending or stale flow whose key
//!    now names another frontend, or none, is forgotten: its packet is
//!    new.
//! 4. An ICMP error about the flow is related while it is pending or
//!    still allowed (judged against the backend on a revision change).
use std::net::IpAddr;

use crate::{
    direction, endpoint::EndpointInfo, ipcache::IpcacheEntry, proto, service::mark, verdict::Reason,
};

use super::{Datapath, Flow, FlowState, Judgement, Outcome, Packet};

/// A client's flow to a frontend, by what survives DNAT: its interface,
/// source address and port, and protocol (`SERVICE_FLOWS`' key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    pub ifindex: u32,
    pub src: IpAddr,
    pub sport: u16,
    pub protocol: u8,
}

impl ServiceKey {
    /// The key of a client's flow (as opened at its egress hook).
    fn of(flow: &Flow) -> Self {
        Self {
            ifindex: flow.ifindex,
            src: flow.src,
            sport: flow.sport,
            protocol: flow.protocol,
        }
    }
}

/// What is known of a client's flow to a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceState {
    pub frontend: IpAddr,
    pub frontend_port: u16,
    /// The address and port DNAT sent it to, once judged there.
    pub backend: Option<(IpAddr, u16)>,
}

fn verdict(reason: Reason) -> Judgement {
    Judgement {
        reason,
        matched: None,
        peer: IpcacheEntry::UNKNOWN,
        rule: crate::event::RuleRef::default(),
    }
}

impl Datapath {
    /// What the uplink's egress hook (`to_uplink`) does with a packet: a
    /// marked one is its client's egress after DNAT; anything else goes
    /// by untouched.
    pub fn uplink(&mut self, pkt: &Packet) -> Outcome {
        let mut out = Outcome {
            after_dnat: None,
            judgement: None,
            mark: pkt.mark,
        };
        if let Some(client) = mark::client(pkt.mark) {
            out.mark &= !mark::MASK;
            out.after_dnat = Some(self.after_dnat(client, pkt));
        }
        if out.passes() {
            out.judgement = super::pod_range_guard::uplink_out(&self.maps, pkt);
        }
        out
    }

    /// The egress of the pod at interface `client`, judged against the
    /// packet's destination after DNAT; its flow learns the verdict.
    pub(super) fn after_dnat(&mut self, client: u32, pkt: &Packet) -> Judgement {
        let Some(ep) = self.maps.endpoints.get(&client).copied() else {
            // The client is gone: nothing to judge its egress by.
            return verdict(Reason::DropPolicy);
        };
        let key = ServiceKey {
            ifindex: client,
            src: pkt.src,
            sport: pkt.sport,
            protocol: pkt.protocol,
        };
        if self
            .services
            .get(&key)
            .is_some_and(|s| s.backend == Some((pkt.dst, pkt.dport)))
        {
            // Where it was judged (at the client, on a policy change).
            return verdict(Reason::AllowEstablished);
        }
        // A pod to its own Service (hairpin): allowed, but where tiers
        // judge it (see `Maps::judge_backend`).
        let judged = self
            .maps
            .judge_backend(&ep, pkt.dst, pkt.protocol, pkt.policy_port());
        if let Some(state) = self.services.get_mut(&key) {
            let flow = Flow {
                ifindex: client,
                opened: direction::EGRESS,
                src: pkt.src,
                dst: state.frontend,
                protocol: pkt.protocol,
                sport: pkt.sport,
                dport: state.frontend_port,
            };
            if judged.reason.is_drop() {
                self.services.remove(&key);
                self.flows.remove(&flow);
            } else {
                state.backend = Some((pkt.dst, pkt.dport));
                if let Some(st) = self.flows.get_mut(&flow) {
                    st.pending = false;
                    st.revision = ep.revision;
                }
            }
        }
        judged
    }

    /// A new flow of an egress-isolated pod to a frontend: tracked as
    /// pending and passed on with the mark.
    pub(super) fn defer(&mut self, ep: &EndpointInfo, pkt: &Packet) -> Judgement {
        if mark::pending(pkt.ifindex).is_none() {
            // The mark cannot carry this interface: refused.
            return verdict(Reason::DropPolicy);
        }
        let flow = Flow::of(pkt);
        let key = ServiceKey::of(&flow);
        if let Some(other) = self.services.get(&key)
            && (other.frontend, other.frontend_port) != (pkt.dst, pkt.dport)
        {
            let theirs = Flow {
                dst: other.frontend,
                dport: other.frontend_port,
                ..flow
            };
            // Either way it was opened: the kernel keeps one entry.
            if self.flows.contains_key(&theirs)
                || (theirs.one_key_both_ways() && self.flows.contains_key(&theirs.answered()))
            {
                return verdict(Reason::DropPolicy);
            }
        }
        if !self.share.allows(pkt.ifindex) {
            // Untracked: judged after DNAT packet by packet.
            return verdict(Reason::PassService);
        }
        self.open(
            flow,
            FlowState {
                revision: ep.revision,
                closing: false,
                service: true,
                pending: true,
                peer_of: super::PeerOf::Address,
            },
        );
        self.services.insert(
            key,
            ServiceState {
                frontend: pkt.dst,
                frontend_port: pkt.dport,
                backend: None,
            },
        );
        verdict(Reason::PassService)
    }

    /// What the key of a Service flow holds, if it is this flow's.
    fn service_of(&self, flow: &Flow) -> Option<ServiceState> {
        self.services
            .get(&ServiceKey::of(flow))
            .filter(|s| s.frontend == flow.dst && s.frontend_port == flow.dport)
            .copied()
    }

    /// Judges a judged Service flow again against its backend (the
    /// revision moved): None when the backend is not known here; denied →
    /// the flow is forgotten.
    fn rejudge_backend(&mut self, ep: &EndpointInfo, flow: Flow) -> Option<Judgement> {
        let (addr, port) = self.service_of(&flow)?.backend?;
        let port = proto::policy_port(flow.protocol, port);
        let judged = self.maps.judge_backend(ep, addr, flow.protocol, port);
        if judged.reason.is_drop() {
            self.flows.remove(&flow);
            self.services.remove(&ServiceKey::of(&flow));
            return Some(Judgement {
                reason: Reason::DropPolicyChanged,
                ..judged
            });
        }
        if let Some(st) = self.flows.get_mut(&flow) {
            st.revision = ep.revision;
        }
        Some(judged)
    }

    /// A packet of a Service flow at its client: sent by it (`forward`)
    /// or reaching it. None: the flow was forgotten, the packet is new.
    pub(super) fn service_hit(
        &mut self,
        ep: &EndpointInfo,
        flow: Flow,
        st: FlowState,
        closing: bool,
        forward: bool,
    ) -> Option<Judgement> {
        let hit = if forward {
            Reason::AllowEstablished
        } else {
            Reason::AllowReply
        };
        let stale = st.revision != ep.revision;
        if (st.pending || stale) && forward && self.service_of(&flow).is_none() {
            // Its key names another flow now, or none: forgotten.
            self.flows.remove(&flow);
            return None;
        }
        if st.pending {
            return Some(verdict(if forward { Reason::PassService } else { hit }));
        }
        if stale {
            match self.rejudge_backend(ep, flow) {
                Some(j) if j.reason.is_drop() => return Some(j),
                Some(_) => {}
                None if forward => {
                    if let Some(st) = self.flows.get_mut(&flow) {
                        st.pending = true;
                    }
                    return Some(verdict(Reason::PassService));
                }
                None => return Some(verdict(hit)),
            }
        }
        if closing && let Some(st) = self.flows.get_mut(&flow) {
            st.closing = true;
        }
        // Judged, yet DNAT may send it elsewhere (kube-proxy deletes a UDP
        // flow's conntrack entry when its endpoint leaves; a reused tuple
        // meets a new choice): checked after DNAT again.
        Some(verdict(if forward { Reason::PassService } else { hit }))
    }

    /// An ICMP error about a Service flow: related while pending or still
    /// allowed (judged again against the backend on a revision change;
    /// denied, with what that judgement found).
    pub(super) fn service_related(
        &mut self,
        ep: &EndpointInfo,
        flow: Flow,
        st: FlowState,
    ) -> Judgement {
        if !st.pending
            && st.revision != ep.revision
            && let Some(j) = self.rejudge_backend(ep, flow)
            && j.reason.is_drop()
        {
            return Judgement {
                peer: IpcacheEntry::UNKNOWN,
                matched: None,
                ..j
            };
        }
        verdict(Reason::AllowRelated)
    }
}
