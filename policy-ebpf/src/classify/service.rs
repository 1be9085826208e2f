//! Flows to Service frontends: deferred at the client, judged after DNAT
//! against the backend reached, and the uplink's hook.
use aya_ebpf::{bindings::BPF_ANY, programs::TcContext};
use policy_common::{
    addr_eq,
    conntrack::{
        CT_FLAG_CLOSING, CT_FLAG_PENDING, CT_FLAG_SERVICE, CT_FLAG_SYN_ONLY, CT_OPENER_EITHER,
        CT_REFRESH_NS, CtEntry, CtKey, ORIGIN_SOURCE,
    },
    direction,
    endpoint::EndpointInfo,
    family,
    ipcache::IpcacheEntry,
    proto,
    service::{
        SERVICE_FLOW_RESOLVED, ServiceFlow, ServiceFlowKey, mark, service_addr, service_prefix_len,
    },
    verdict::Reason,
};

use super::{
    DROP, PASS, TCP_ACK, TCP_FIN, TCP_RST,
    conntrack::{fill_ct_key, live, share_allows, syn_only},
    count, emit_record, endpoint,
    policy::{Peer, judge_backend},
    record_meta,
};
use crate::{
    maps::{CONNTRACK, SCRATCH, SERVICE_FLOWS, SERVICES, Scratch},
    parse::{IP, IpPacket, parse_at},
};

/// Whether `addr` is a Service frontend (or in a Service range). Out of
/// line: its key gets a frame of its own.
#[inline(never)]
pub(super) fn is_frontend(fam: u8, addr: &[u8; 16]) -> bool {
    let key = aya_ebpf::btf_maps::lpm_trie::Key::new(
        service_prefix_len(if fam == family::IPV4 { 32 } else { 128 }),
        service_addr(fam, addr),
    );
    SERVICES.get(&key).is_some()
}

/// The `SERVICE_FLOWS` entry of the client flow `key` (a service
/// flow's conntrack key: the pre-DNAT tuple), if it is this flow's: the
/// entry is keyed by what survives DNAT, so it may name another frontend
/// the client reached from the same port, or be gone (LRU). `flow` is
/// filled with its key.
#[inline(always)]
pub(super) fn service_flow_of(
    flow: &mut ServiceFlowKey,
    key: &CtKey,
) -> Option<&'static mut ServiceFlow> {
    flow.ifindex = key.ifindex;
    flow.src = key.local;
    flow.sport = key.local_port;
    flow.protocol = key.protocol;
    flow.family = key.family;
    // SAFETY: a pointer to the map value, valid for this program run.
    let f = unsafe { &mut *SERVICE_FLOWS.get_ptr_mut(&*flow)? };
    if addr_eq(&f.frontend, &key.remote) && f.frontend_port == key.remote_port {
        Some(f)
    } else {
        None
    }
}

/// A judged service flow at a stale revision: judged again against the
/// backend it landed on (the egress of its client). None: the backend is
/// not known here. Denied → both entries are removed.
#[inline(always)]
pub(super) fn rejudge_backend(
    entry: &mut CtEntry,
    key: &CtKey,
    flow: &mut ServiceFlowKey,
    ep: &EndpointInfo,
) -> Option<(Reason, IpcacheEntry)> {
    let f = service_flow_of(flow, key)?;
    if f.flags & SERVICE_FLOW_RESOLVED == 0 {
        return None;
    }
    let port = proto::policy_port(key.protocol, f.backend_port);
    // Its own Service's backend may be the pod itself: judged as after
    // DNAT (see `judge_backend`).
    let (reason, peer) = judge_backend(
        ep,
        key.family,
        Peer::elsewhere(&f.backend),
        key.protocol,
        port,
    );
    if reason.is_drop() {
        let _ = CONNTRACK.remove(key);
        let _ = SERVICE_FLOWS.remove(&*flow);
        return Some((Reason::DropPolicyChanged, peer));
    }
    entry.revision = ep.revision;
    Some((reason, peer))
}

/// A conntrack hit on a flow to a Service frontend, at the client (the
/// entry's key is the pre-DNAT tuple). `forward`: the client sends (its
/// egress hook); else a reply reaches it. Its verdict is the one taken
/// after DNAT: pending → sent on to be judged there (a reply passes: the
/// request was let through to the backend, which alone answers); on a
/// stale revision the flow is judged again against the backend it landed
/// on (`SERVICE_FLOWS`), or, unknown here, after DNAT again. None: the
/// flow is forgotten, the packet is new — what the client sends while
/// the flow waits for a verdict (pending or stale) must be the flow its
/// `SERVICE_FLOWS` entry names, or a verdict after DNAT on it would land
/// on another.
#[inline(always)]
pub(super) fn service_hit(
    entry: &mut CtEntry,
    key: &CtKey,
    flow: &mut ServiceFlowKey,
    ep: &EndpointInfo,
    pkt: &IpPacket,
    now: u64,
    forward: bool,
) -> Option<(Reason, IpcacheEntry)> {
    let unknown = IpcacheEntry::UNKNOWN;
    let hit = if forward {
        Reason::AllowEstablished
    } else {
        Reason::AllowReply
    };
    let stale = entry.revision != ep.revision;
    if forward
        && (stale || entry.flags & CT_FLAG_PENDING != 0)
        && service_flow_of(flow, key).is_none()
    {
        let _ = CONNTRACK.remove(key);
        return None;
    }
    if policy_common::conntrack::age_ns(now, entry.last_seen_ns) > CT_REFRESH_NS {
        entry.last_seen_ns = now;
    }
    if entry.flags & CT_FLAG_PENDING != 0 {
        return Some(if forward {
            (Reason::PassService, unknown)
        } else {
            (hit, unknown)
        });
    }
    if stale {
        match rejudge_backend(entry, key, flow, ep) {
            Some((Reason::DropPolicyChanged, peer)) => {
                return Some((Reason::DropPolicyChanged, peer));
            }
            Some(_) => {}
            None if forward => {
                entry.flags |= CT_FLAG_PENDING;
                return Some((Reason::PassService, unknown));
            }
            None => return Some((hit, unknown)),
        }
    }
    if pkt.protocol == proto::TCP {
        if pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            entry.flags |= CT_FLAG_CLOSING;
        }
        if pkt.tcp_flags & TCP_ACK != 0 {
            entry.flags &= !CT_FLAG_SYN_ONLY;
        }
    }
    if forward {
        // Judged, yet DNAT may send this packet elsewhere (kube-proxy
        // deletes a UDP flow's conntrack entry when its endpoint leaves;
        // a reused tuple meets a new choice): checked after DNAT again.
        return Some((Reason::PassService, unknown));
    }
    Some((hit, unknown))
}

/// The key a client's flow is known by after DNAT: its interface,
/// address and port.
#[inline(always)]
fn fill_flow_key(key: &mut ServiceFlowKey, client: u32, pkt: &IpPacket) {
    key.ifindex = client;
    key.src = pkt.src;
    key.sport = pkt.sport;
    key.protocol = pkt.protocol;
    key.family = pkt.family;
}

/// A new flow of an egress-isolated pod to a Service frontend: tracked as
/// pending (its pre-DNAT tuple, and the frontend by the client's source)
/// and sent on with the mark, to be judged after DNAT.
#[inline(always)]
pub(super) fn defer(s: &mut Scratch, ifindex: u32, ep: &EndpointInfo, now: u64) -> Reason {
    if mark::pending(ifindex).is_none() {
        // The mark cannot carry this interface: the backend cannot be
        // judged, so the flow is refused (stay closed where unsure).
        return Reason::DropPolicy;
    }
    let pkt = &s.pkt;
    // After DNAT a flow is known by its client's port alone: while a live
    // flow to another frontend holds it, this one cannot be told apart.
    fill_flow_key(&mut s.flow, ifindex, pkt);
    if let Some(f) = SERVICE_FLOWS.get_ptr(&s.flow) {
        // SAFETY: a pointer to the map value, valid for this run.
        let f = unsafe { &*f };
        if !(addr_eq(&f.frontend, &pkt.dst) && f.frontend_port == pkt.dport) {
            fill_ct_key(&mut s.ct, ifindex, direction::EGRESS, pkt, CT_OPENER_EITHER);
            s.ct.remote = f.frontend;
            s.ct.remote_port = f.frontend_port;
            if let Some(other) = CONNTRACK.get_ptr(&s.ct)
                // SAFETY: as above.
                && live(unsafe { &*other }, pkt.protocol, now)
            {
                return Reason::DropPolicy;
            }
        }
    }
    if !share_allows(ifindex, now) {
        // Untracked: each packet is judged after DNAT on its own, and
        // replies as new.
        count(Reason::CtShareFull, direction::EGRESS);
        return Reason::PassService;
    }
    fill_ct_key(&mut s.ct, ifindex, direction::EGRESS, pkt, CT_OPENER_EITHER);
    let mut flags = CT_FLAG_SERVICE | CT_FLAG_PENDING;
    if syn_only(pkt) {
        flags |= CT_FLAG_SYN_ONLY;
    }
    let entry = CtEntry {
        last_seen_ns: now,
        revision: ep.revision,
        direction: direction::EGRESS,
        flags,
        origin: ORIGIN_SOURCE,
    };
    if CONNTRACK.insert(&s.ct, &entry, BPF_ANY as u64).is_err() {
        count(Reason::CtCreateFailed, direction::EGRESS);
    }
    let flow = ServiceFlow {
        frontend: pkt.dst,
        backend: [0; 16],
        frontend_port: pkt.dport,
        backend_port: 0,
        flags: 0,
    };
    let _ = SERVICE_FLOWS.insert(&s.flow, &flow, BPF_ANY as u64);
    Reason::PassService
}

/// After DNAT (`s.pkt` is the rewritten packet): the egress of the client
/// at interface `client` is judged against the backend it reached, and
/// the client's waiting flow learns the verdict and the backend. Out of
/// line: small frame, and the programs share it.
#[inline(never)]
pub(super) fn judge_service(s: &mut Scratch, client: u32) -> u32 {
    let Some(ep) = endpoint(client) else {
        // The client is gone: nothing to judge its egress by.
        count(Reason::DropPolicy, direction::EGRESS);
        return 0;
    };
    let pkt = &s.pkt;
    fill_flow_key(&mut s.flow, client, pkt);
    if let Some(f) = SERVICE_FLOWS.get_ptr(&s.flow) {
        // SAFETY: a pointer to the map value, valid for this run.
        let f = unsafe { &*f };
        if f.flags & SERVICE_FLOW_RESOLVED != 0
            && addr_eq(&f.backend, &pkt.dst)
            && f.backend_port == pkt.dport
        {
            // Where it was judged (at the client, on a policy change).
            count(Reason::AllowEstablished, direction::EGRESS);
            return 1;
        }
    }
    // A pod to its own Service (hairpin): the backend is the client,
    // allowed but where tiers judge it (see `judge_backend`).
    let (reason, peer) = judge_backend(
        ep,
        pkt.family,
        Peer::packet_destination(pkt),
        pkt.protocol,
        proto::policy_port(pkt.protocol, pkt.dport),
    );
    if let Some(f) = SERVICE_FLOWS.get_ptr_mut(&s.flow) {
        // SAFETY: a pointer to the map value, valid for this run.
        let f = unsafe { &mut *f };
        s.ct.ifindex = client;
        s.ct.local = pkt.src;
        s.ct.remote = f.frontend;
        s.ct.local_port = pkt.sport;
        s.ct.remote_port = f.frontend_port;
        s.ct.protocol = pkt.protocol;
        s.ct.family = pkt.family;
        s.ct.opener = CT_OPENER_EITHER;
        s.ct._pad = 0;
        if reason.is_drop() {
            let _ = CONNTRACK.remove(&s.ct);
            let _ = SERVICE_FLOWS.remove(&s.flow);
        } else {
            f.backend = pkt.dst;
            f.backend_port = pkt.dport;
            f.flags |= SERVICE_FLOW_RESOLVED;
            if let Some(e) = CONNTRACK.get_ptr_mut(&s.ct) {
                // SAFETY: as above.
                let e = unsafe { &mut *e };
                e.flags &= !CT_FLAG_PENDING;
                e.revision = ep.revision;
            }
        }
    }
    count(reason, direction::EGRESS);
    // The flow's one record: judged here, after DNAT, by its backend.
    emit_record(
        ep,
        record_meta(client, reason, direction::EGRESS, true),
        Some(&s.pkt),
        &peer,
    );
    u32::from(!reason.is_drop())
}

/// A packet marked at a client's veth, at the first hook after DNAT:
/// judges the client's egress (see [`judge_service`]) and clears the mark.
/// False: drop. A marked packet that is not IP is none of a client's (the
/// client's hook marks IP packets only, and drops malformed ones): there
/// is nothing to judge. Out of line: only marked packets take it.
#[inline(never)]
pub(super) fn after_dnat<const L3: bool>(ctx: &TcContext, s: &mut Scratch) -> bool {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run.
    let m = unsafe { (*ctx.skb.skb).mark };
    let Some(client) = mark::client(m) else {
        return true;
    };
    ctx.set_mark(m & !mark::MASK);
    if parse_at::<L3>(ctx, &mut s.pkt) != IP {
        return true;
    }
    judge_service(s, client) != 0
}

/// Whether the packet carries a client's mark (see [`after_dnat`]): most
/// do not, and skip the judgement after DNAT.
#[inline(always)]
pub fn marked(ctx: &TcContext) -> bool {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run.
    mark::client(unsafe { (*ctx.skb.skb).mark }).is_some()
}

/// The judgement after DNAT at a hook where it can happen (see
/// [`after_dnat`]); false: drop. The programs call it before the
/// classifier, never inside it, and reach the classifier through a call
/// (`classify_out_of_line`): a path through it then reaches the
/// classifier at a call, where the verifier of kernels before 6.4 (no
/// precision tracking across subprograms) prunes it; inside, every such
/// path re-explored the whole classifier and 6.1 gave up at a million
/// instructions.
#[inline(always)]
pub fn dnat_hook(ctx: &TcContext) -> bool {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        // The classifier refuses the packet then, where it takes the slot.
        return true;
    };
    // SAFETY: this CPU's slot; programs do not nest on one CPU.
    let s = unsafe { &mut *scratch };
    after_dnat::<false>(ctx, s)
}

/// The uplink's egress: a pod's packet to a Service whose backend is on
/// another node, judged after DNAT; a local pod's packet leaving before
/// it is enforced is dropped; anything else passes. `L3`: the device has
/// no link-layer header.
#[inline(always)]
pub fn uplink<const L3: bool>(ctx: &TcContext) -> i32 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return PASS;
    };
    // SAFETY: this CPU's slot; programs do not nest on one CPU.
    let s = unsafe { &mut *scratch };
    if !after_dnat::<L3>(ctx, s) || crate::pod_range_guard::uplink_out_unenforced::<L3>(ctx, s) {
        DROP
    } else {
        PASS
    }
}
