//! The verdict. `policy_common::model` states the same procedure in plain
//! Rust; the differential test holds the two together.
//!
//! The packet and the keys built from it live in a per-CPU scratch buffer
//! (`SCRATCH`): the BPF stack is 512 bytes for the whole call chain.
//!
//! - this file: the entry ([`classify`]) and the decision ([`decide`]) in
//!   its documented order, drop events and counters;
//! - [`policy`]: the peer's identity and the policy lookup;
//! - [`conntrack`]: conntrack and fragment keys, hits, related ICMP;
//! - [`service`]: flows to Service frontends, judged after DNAT.
mod clock;
mod conntrack;
mod policy;
mod service;

pub use self::service::{dnat_hook, marked, uplink};
pub(crate) use self::{clock::ClockCache, conntrack::fill_ct_key};
use aya_ebpf::{
    bindings::{BPF_ANY, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_coarse_ns,
    programs::TcContext,
};
use aya_log_ebpf::debug;
use policy_common::{
    addr_eq,
    config::{CONFIG_DEBUG_LOG, CONFIG_NO_DROP_EVENTS},
    conntrack::{
        CT_FLAG_CLOSING, CT_FLAG_SYN_ONLY, CtEntry, FragEntry, ORIGIN_FORWARDED, ORIGIN_SOURCE,
        ct_lookups, ct_opener,
    },
    direction,
    endpoint::{ENDPOINT_SLOT_USED, EndpointInfo},
    event::{RECORD_NEW_FLOW, RuleRef},
    icmpv6_link_control, icmpv6_link_control_from_pod,
    ipcache::IpcacheEntry,
    policy::TierSlot,
    proto,
    service::mark,
    verdict::{Reason, counter_index},
};

use self::{
    conntrack::{fill_frag_key, related, share_allows, syn_only, tracked},
    policy::{Peer, judge_packet},
    service::{defer, is_frontend},
};
use crate::{
    maps::{
        CONFIG, CONNTRACK, COUNTERS, DROP_EVENTS, ENDPOINT_SLOTS, ENDPOINTS, FLOW_BUDGET,
        FRAGMENTS, SCRATCH, Scratch,
    },
    parse::{FRAG_FIRST, FRAG_LATER, IP, IpPacket, MALFORMED, parse},
};

/// Allowed: hand the packet on (TCX_NEXT / next tc filter), so programs
/// after ours still see it.
const PASS: i32 = TC_ACT_UNSPEC;
pub const DROP: i32 = TC_ACT_SHOT;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[inline(always)]
fn count(reason: Reason, dir: u8) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter_index(reason, dir)) {
        // SAFETY: per-CPU slot, only this CPU touches it while we run.
        unsafe { *slot += 1 };
    }
}

#[inline(always)]
fn config_flags() -> u32 {
    match CONFIG.get(0) {
        Some(c) => c.flags,
        None => 0,
    }
}

/// The local endpoint behind `ifindex`: its array slot when the array
/// reaches that far (the writer never puts such an ifindex in the hash),
/// the overflow hash otherwise.
#[inline(always)]
fn endpoint(ifindex: u32) -> Option<&'static EndpointInfo> {
    if let Some(slot) = ENDPOINT_SLOTS.get(ifindex) {
        return if slot.flags & ENDPOINT_SLOT_USED != 0 {
            Some(slot)
        } else {
            None
        };
    }
    // SAFETY: a map value pointer, valid for this program run (the entry
    // is read, never written, by the classifier; not copied: the stack is
    // 512 bytes for the whole call chain).
    ENDPOINTS.get_ptr(ifindex).map(|ep| unsafe { &*ep })
}

/// What the interface a packet reaching the pod entered the node at says
/// about its peer.
enum Arrival {
    /// Decided already.
    Judged(Reason),
    /// Judged by its peer as [`CtEntry::origin`] says.
    Origin(u16),
}

/// At the pod's ingress: who sent the packet, by the interface it entered
/// the node at (`ingress_ifindex`; 0: the node sent it). A pod's packet
/// is still that pod's when something on the way rewrote its source: a
/// packet from a local pod's interface not from that pod's address was
/// masqueraded (kube-proxy for a NodePort, an external IP,
/// `--masquerade-all`, hostPort) and is judged as the pod's; the pod's
/// own, hairpinned through a Service, is allowed. A packet that entered
/// at any other interface is never node traffic, whatever its source
/// says, nor a local pod's.
#[inline(always)]
fn arrival(ctx: &TcContext, ifindex: u32, ep: &EndpointInfo, pkt: &IpPacket) -> Arrival {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run.
    let iif = unsafe { (*ctx.skb.skb).ingress_ifindex };
    if iif == 0 {
        return Arrival::Origin(ORIGIN_SOURCE);
    }
    if iif == ifindex {
        // Its own packet, back through the node (a Service hairpin):
        // allowed, but where tiers judge either way (the egress ones for
        // tracking its answers, see `EndpointInfo::tracks_new`).
        if (ep.tiered(direction::INGRESS) || ep.tiered(direction::EGRESS))
            && iif < u32::from(ORIGIN_FORWARDED)
        {
            return Arrival::Origin(iif as u16);
        }
        return Arrival::Judged(Reason::AllowSelf);
    }
    let Some(client) = endpoint(iif) else {
        // A local pod's address never enters the node elsewhere than at
        // its own interface: a decapsulated inner packet, or a spoof from
        // outside.
        if crate::pod_range_guard::held_elsewhere(pkt.family, &pkt.src, iif) {
            return Arrival::Judged(Reason::DropSpoofed);
        }
        return Arrival::Origin(ORIGIN_FORWARDED);
    };
    if client.owns(pkt.family, &pkt.src) {
        return Arrival::Origin(ORIGIN_SOURCE);
    }
    if iif >= u32::from(ORIGIN_FORWARDED) {
        // The entry could not name the client: refused, never judged by
        // the address it wears (stay closed where unsure).
        return Arrival::Judged(Reason::DropPolicy);
    }
    Arrival::Origin(iif as u16)
}

/// The decision for the parsed packet in `s.pkt` at endpoint `ep`.
#[inline(always)]
fn decide(
    ctx: &TcContext,
    s: &mut Scratch,
    ifindex: u32,
    ep: &EndpointInfo,
    dir: u8,
) -> (Reason, IpcacheEntry) {
    let unknown = IpcacheEntry::UNKNOWN;
    let pkt = &s.pkt;
    if pkt.protocol == proto::ICMPV6 && pkt.frag != FRAG_LATER {
        let link_control = if dir == direction::INGRESS {
            icmpv6_link_control(pkt.icmp_type, &pkt.src, pkt.hop_limit)
        } else {
            icmpv6_link_control_from_pod(
                pkt.icmp_type,
                &pkt.src,
                &pkt.dst,
                pkt.hop_limit,
                ep.owns(pkt.family, &pkt.src),
            )
        };
        if link_control {
            return (Reason::AllowNeighborDiscovery, unknown);
        }
    }
    let origin = if dir == direction::EGRESS {
        // The pod chooses every byte it sends: only its own source is it.
        if !ep.owns(pkt.family, &pkt.src) {
            return (Reason::DropSpoofed, unknown);
        }
        if addr_eq(&pkt.src, &pkt.dst) {
            return (Reason::AllowSelf, unknown);
        }
        ORIGIN_SOURCE
    } else {
        match arrival(ctx, ifindex, ep, pkt) {
            Arrival::Judged(reason) => return (reason, unknown),
            Arrival::Origin(origin) => origin,
        }
    };
    // The pod-range guard, on every packet but those of a flow tracked at
    // the endpoint's current revision: the agent moves every revision when
    // an address leaves ENFORCED or the ranges change, and a flow judged
    // again checks its peer first (`on_ct_hit`, `related`).
    let unenforced = crate::pod_range_guard::peer_unenforced;
    if pkt.frag == FRAG_LATER {
        if unenforced(pkt, dir) {
            return (Reason::DropUnenforced, unknown);
        }
        fill_frag_key(&mut s.frag, ifindex, pkt);
        return if FRAGMENTS.get_ptr(&s.frag).is_some() {
            (Reason::AllowFragment, unknown)
        } else {
            (Reason::DropFragmentUnknown, unknown)
        };
    }
    if !ep.tracks() {
        if unenforced(pkt, dir) {
            return (Reason::DropUnenforced, unknown);
        }
        // Isolated in no direction: nothing to track, nothing to deny.
        // Without conntrack a new flow is known by its TCP SYN alone.
        let (reason, peer) = judge_packet(ep, dir, pkt, origin);
        if reason.admits_new_flow() && pkt.protocol == proto::TCP && syn_only(pkt) {
            emit_record(
                ep,
                record_meta(ifindex, reason, dir, true),
                Some(pkt),
                &peer,
            );
        }
        return (reason, peer);
    }
    let now = clock::coarse_now(&mut s.clock);

    if pkt.quoted_off != 0 {
        // An ICMP error from an unenforced address is never related.
        if unenforced(pkt, dir) {
            return (Reason::DropUnenforced, unknown);
        }
        if let Some(reason) = related(ctx, s, ifindex, ep, dir, now) {
            return (reason, unknown);
        }
    }
    let pkt = &s.pkt;
    let peer_addr = if dir == direction::EGRESS {
        Peer::packet_destination(pkt)
    } else {
        Peer::packet_source(pkt)
    };

    // One lookup, either way the packet travels (see `CtKey`).
    let lookups = ct_lookups(pkt.protocol, pkt.icmp_type);
    if lookups != 0 {
        let opener = ct_opener(pkt.protocol, pkt.icmp_type, dir, false);
        fill_ct_key(&mut s.ct, ifindex, dir, pkt, opener);
        if let Some(verdict) = tracked(&s.ct, &mut s.flow, ep, pkt, peer_addr, now, dir) {
            return verdict;
        }
    }
    if unenforced(pkt, dir) {
        return (Reason::DropUnenforced, unknown);
    }
    let midstream = pkt.protocol == proto::TCP && pkt.tcp_flags & TCP_SYN == 0;
    if midstream {
        count(Reason::CtMidstreamMiss, dir);
    }
    // To a Service frontend: the backend is chosen after us (DNAT), so the
    // egress is judged there.
    if dir == direction::EGRESS && ep.judged(direction::EGRESS) && proto::has_ports(pkt.protocol) {
        if is_frontend(pkt.family, &pkt.dst) {
            return (defer(s, ifindex, ep, now), unknown);
        }
    }
    let pkt = &s.pkt;
    let (reason, peer) = judge_packet(ep, dir, pkt, origin);
    // Only a packet the pod sent (its source checked above) or one it
    // receives at its own address opens an entry; never a TCP packet
    // without SYN: mid-stream, who opened the connection is unknown, and a
    // pod answering a connection a policy change just cut would reopen it
    // in its own name (the peer's packets then pass as replies). Such a
    // flow is judged packet by packet both ways.
    let opens = dir == direction::EGRESS || ep.owns(pkt.family, &pkt.dst);
    if ep.tracks_new(reason, dir) && lookups != 0 && opens && !midstream {
        let mut flags = 0;
        if pkt.protocol == proto::TCP {
            if syn_only(pkt) {
                flags |= CT_FLAG_SYN_ONLY;
            }
            if pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
                flags |= CT_FLAG_CLOSING;
            }
        }
        let opener = ct_opener(pkt.protocol, pkt.icmp_type, dir, true);
        fill_ct_key(&mut s.ct, ifindex, dir, pkt, opener);
        let entry = CtEntry {
            last_seen_ns: now,
            revision: ep.revision,
            direction: dir,
            flags,
            origin,
        };
        if !share_allows(ifindex, now) {
            count(Reason::CtShareFull, dir);
        } else if CONNTRACK.insert(&s.ct, &entry, BPF_ANY as u64).is_err() {
            count(Reason::CtCreateFailed, dir);
        }
        // The flow's one record (its drops are recorded by the caller).
        emit_record(
            ep,
            record_meta(ifindex, reason, dir, true),
            Some(&s.pkt),
            &peer,
        );
    }
    (reason, peer)
}

/// The `meta` argument of [`emit_record`]: the record's flags, the
/// interface, the reason and the direction.
#[inline(always)]
pub(super) fn record_meta(ifindex: u32, reason: Reason, dir: u8, new_flow: bool) -> u64 {
    let flags = if new_flow { RECORD_NEW_FLOW } else { 0 };
    (u64::from(flags) << 48) | (u64::from(ifindex) << 16) | ((reason as u64) << 8) | u64::from(dir)
}

/// Whether the per-CPU record budget lets one more record out now.
#[inline(always)]
fn budget_allows(now: u64) -> bool {
    match FLOW_BUDGET.get_ptr_mut(0) {
        // SAFETY: this CPU's slot; programs do not nest on one CPU.
        Some(b) => unsafe { (*b).take(now) },
        // Pins of an older agent lack the map: no limit but the ring's.
        None => true,
    }
}

/// A flow record: a new flow judged by policy, or a dropped packet, with
/// what the policy lookup of this packet found (kept by the reason: see
/// `RuleRef::kept_for`). `meta` is [`record_meta`] (five arguments at
/// most for a BPF-to-BPF call). `pkt` is None for unparsed packets.
/// Within the per-CPU budget; what it holds back is counted.
#[inline(never)]
pub(super) fn emit_record(
    ep: &EndpointInfo,
    meta: u64,
    pkt: Option<&IpPacket>,
    peer: &IpcacheEntry,
) {
    let flags = (meta >> 48) as u8;
    let ifindex = (meta >> 16) as u32;
    let reason = (meta >> 8) as u8;
    let dir = meta as u8;
    if config_flags() & CONFIG_NO_DROP_EVENTS != 0 {
        return;
    }
    let scratch = SCRATCH.get_ptr_mut(0);
    // The coarse clock (a tick's resolution) is enough for the budget and
    // the record's time, and cheaper on the path every drop takes; this
    // CPU's reading of it when there is one (see `clock`).
    let now = match scratch {
        // SAFETY: this CPU's slot, ours for this run; the clock is a field
        // no caller holds a reference to.
        Some(s) => clock::coarse_now(unsafe { &mut (*s).clock }),
        // SAFETY: a helper without preconditions.
        None => unsafe { bpf_ktime_get_coarse_ns() },
    };
    if !budget_allows(now) {
        count(Reason::RecordLimited, dir);
        return;
    }
    let Some(mut slot) = DROP_EVENTS.reserve(0) else {
        count(Reason::EventLost, dir);
        return;
    };
    // Every field written in place, one by one: a record built on the
    // stack first took the 6.1 verifier's combined stack past 512 bytes.
    // Every byte is written (the ring's memory holds older records).
    let ev = slot.as_mut_ptr();
    // SAFETY: `ev` is the reserved slot, ours until submitted; the
    // scratch value is this CPU's for this program run.
    unsafe {
        (*ev).timestamp_ns = now;
        (*ev).ifindex = ifindex;
        (*ev).endpoint_identity = ep.identity;
        (*ev).peer_identity = peer.identity;
        (*ev).peer_cidr_identity = peer.cidr_identity;
        match pkt {
            Some(p) => {
                (*ev).src = p.src;
                (*ev).dst = p.dst;
                (*ev).sport = p.sport;
                (*ev).dport = p.dport;
                (*ev).protocol = p.protocol;
                (*ev).family = p.family;
            }
            None => {
                (*ev).src = [0; 16];
                (*ev).dst = [0; 16];
                (*ev).sport = 0;
                (*ev).dport = 0;
                (*ev).protocol = 0;
                (*ev).family = 0;
            }
        }
        (*ev).direction = dir;
        (*ev).reason = reason;
        (*ev).rule = match (scratch, Reason::from_u8(reason)) {
            (Some(s), Some(r)) => {
                let t = &(*s).tiers;
                RuleRef {
                    network_policy: t.network_policy_rule,
                    admin: t.admin,
                    baseline: t.baseline,
                }
                .kept_for(r)
            }
            _ => RuleRef::default(),
        };
        (*ev).flags = flags;
        // The zeroes one by one: together LLVM made them a call to
        // `memset`, a byte loop, on every record.
        use core::ptr::write_volatile;
        write_volatile(&raw mut (*ev)._reserved_reason, 0);
        write_volatile(&raw mut (*ev)._pad, 0);
        write_volatile(&raw mut (*ev)._reserved_rule.network_policy, 0);
        write_volatile(&raw mut (*ev)._reserved_rule.admin, TierSlot::NONE);
        write_volatile(&raw mut (*ev)._reserved_rule.baseline, TierSlot::NONE);
        write_volatile(&raw mut (*ev)._pad1, 0);
    }
    slot.submit(0);
}

/// [`classify`] out of line, for `to_pod`: the judgement after DNAT
/// runs before it on some paths, and the verifier of kernels before 6.4
/// prunes those only at a call (see [`dnat_hook`]).
#[inline(never)]
pub fn classify_out_of_line(ctx: &TcContext, dir: u8) -> i32 {
    classify(ctx, dir)
}

/// The verdict on one packet at a pod's hook, inlined into `from_pod`: a
/// BPF-to-BPF call and its return cost an established packet about a
/// twelfth of its time.
#[inline(always)]
pub fn classify(ctx: &TcContext, dir: u8) -> i32 {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        // Cannot happen (a one-slot array); refuse rather than guess.
        count(Reason::DropMalformed, dir);
        return DROP;
    };
    // SAFETY: this CPU's slot; programs do not nest on one CPU.
    let s = unsafe { &mut *scratch };
    let flags = config_flags();
    let Some(ep) = endpoint(ifindex) else {
        count(Reason::PassNoEndpoint, dir);
        return PASS;
    };

    let parsed = parse(ctx, &mut s.pkt);
    let (reason, peer) = match parsed {
        IP => {
            let (reason, peer) = decide(ctx, s, ifindex, ep, dir);
            if s.pkt.frag == FRAG_FIRST && !reason.is_drop() {
                fill_frag_key(&mut s.frag, ifindex, &s.pkt);
                let entry = FragEntry {
                    sport: s.pkt.sport,
                    dport: s.pkt.dport,
                    _reserved: 0,
                };
                let _ = FRAGMENTS.insert(&s.frag, &entry, BPF_ANY as u64);
            }
            (reason, peer)
        }
        MALFORMED => (Reason::DropMalformed, IpcacheEntry::UNKNOWN),
        _ => (Reason::AllowNonIp, IpcacheEntry::UNKNOWN),
    };
    count(reason, dir);
    let pkt = if parsed == IP { Some(&s.pkt) } else { None };
    if flags & CONFIG_DEBUG_LOG != 0 {
        let (protocol, sport, dport) = match pkt {
            Some(p) => (p.protocol, p.sport, p.dport),
            None => (0, 0, 0),
        };
        debug!(
            ctx,
            "verdict ifindex={} dir={} proto={} sport={} dport={} peer_id={} peer_cidr={} reason={}",
            ifindex,
            dir,
            protocol,
            sport,
            dport,
            peer.identity,
            peer.cidr_identity,
            reason as u8
        );
    }
    if reason == Reason::PassService
        && let Some(m) = mark::pending(ifindex)
    {
        // SAFETY: the context pointer is the kernel's __sk_buff for this run.
        let old = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark((old & !mark::MASK) | m);
    }
    if reason.is_drop() {
        // A new flow's drop, or a dropped packet of another kind.
        let new_flow = matches!(
            reason,
            Reason::DropPolicy
                | Reason::DropAdminTier
                | Reason::DropBaselineTier
                | Reason::DropUpdating
        );
        emit_record(ep, record_meta(ifindex, reason, dir, new_flow), pkt, &peer);
        DROP
    } else {
        PASS
    }
}
