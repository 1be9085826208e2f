//! The pod-range guard (see `policy_common::pod_range_guard`): an address in the
//! node's pod ranges that is not enforced yet belongs to a pod whose veth
//! carries no classifier, so nothing may reach it or come from it past
//! the hooks that are there: the peer pod's veth and the uplinks.
//!
//! Cost: one array load when no range is configured; else one LPM lookup,
//! and one hash lookup for addresses inside a range. A packet of a flow
//! tracked at its endpoint's current revision does not pay it (see
//! `classify::decide`).
//!
//! `ENFORCED` also says where a local pod's address may enter the node:
//! only at its own interface ([`held_elsewhere`]).
use aya_ebpf::{bindings::TC_ACT_SHOT, btf_maps::lpm_trie::Key, programs::TcContext};
use policy_common::{
    config::CONFIG_POD_RANGES,
    direction, family,
    pod_range_guard::{ENFORCED_NODE, local_addr, range_prefix_len},
    verdict::{Reason, counter_index},
};

use crate::{
    maps::{CONFIG, COUNTERS, ENFORCED, POD_RANGES, SCRATCH, Scratch},
    parse::{IP, IpPacket, parse_at},
};

const PASS: i32 = aya_ebpf::bindings::TC_ACT_UNSPEC;

/// Whether `addr` is in the node's pod ranges without being enforced.
/// Out of line: its keys get a frame of their own.
#[inline(never)]
fn unenforced(fam: u8, addr: &[u8; 16]) -> bool {
    let data = local_addr(fam, addr);
    let bits = if fam == family::IPV4 { 32 } else { 128 };
    let key = Key::new(range_prefix_len(bits), data);
    if POD_RANGES.get(&key).is_none() {
        return false;
    }
    // SAFETY: the pointer is only tested, never dereferenced.
    ENFORCED.get_ptr(&data).is_none()
}

/// Whether `addr` is a local pod's (enforced at an interface) other than
/// `iif`. Out of line: its key gets a frame of its own.
#[inline(never)]
pub fn held_elsewhere(fam: u8, addr: &[u8; 16], iif: u32) -> bool {
    let data = local_addr(fam, addr);
    match ENFORCED.get_ptr(&data) {
        // SAFETY: a pointer to the map value, valid for this program run.
        Some(ifindex) => {
            let ifindex = unsafe { *ifindex };
            ifindex != ENFORCED_NODE && ifindex != iif
        }
        None => false,
    }
}

#[inline(always)]
fn configured() -> bool {
    CONFIG
        .get(0)
        .is_some_and(|c| c.flags & CONFIG_POD_RANGES != 0)
}

/// Whether `addr` is in the node's pod ranges without being enforced,
/// when the guard is on.
#[inline(always)]
pub fn addr_unenforced(fam: u8, addr: &[u8; 16]) -> bool {
    configured() && unenforced(fam, addr)
}

/// At a pod's hook: whether the packet's peer (the destination of what
/// the pod sends, the source of what reaches it) is a local address not
/// enforced yet.
#[inline(always)]
pub fn peer_unenforced(pkt: &IpPacket, dir: u8) -> bool {
    if !configured() {
        return false;
    }
    let peer = if dir == direction::EGRESS {
        &pkt.dst
    } else {
        &pkt.src
    };
    unenforced(pkt.family, peer)
}

/// At the uplink's egress (`to_uplink`, after its Service judgement): a
/// packet leaving from a local address that is not enforced (a new pod's,
/// routed out before its veth is attached) is dropped. True: drop.
#[inline(always)]
pub fn uplink_out_unenforced<const L3: bool>(ctx: &TcContext, s: &mut Scratch) -> bool {
    if !configured() || parse_at::<L3>(ctx, &mut s.pkt) != IP {
        return false;
    }
    if unenforced(s.pkt.family, &s.pkt.src) {
        // Counted as the unenforced pod's egress; no drop event: there is
        // no endpoint to name.
        count(Reason::DropUnenforced, direction::EGRESS);
        return true;
    }
    false
}

#[inline(always)]
fn count(reason: Reason, dir: u8) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter_index(reason, dir)) {
        // SAFETY: per-CPU slot, only this CPU touches it while we run.
        unsafe { *slot += 1 };
    }
}

/// The uplink's ingress (`from_uplink`): a packet entering the node for a
/// local address that is not enforced is dropped; everything else passes
/// untouched (judged, if it reaches a pod, at the pod's veth). `L3`: the
/// device has no link-layer header.
#[inline(always)]
pub fn from_uplink<const L3: bool>(ctx: &TcContext) -> i32 {
    if !configured() {
        return PASS;
    }
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return PASS;
    };
    // SAFETY: this CPU's slot; programs do not nest on one CPU.
    let s = unsafe { &mut *scratch };
    if parse_at::<L3>(ctx, &mut s.pkt) != IP {
        return PASS;
    }
    if unenforced(s.pkt.family, &s.pkt.dst) {
        // Counted as the unenforced pod's ingress; no drop event: there
        // is no endpoint to name.
        count(Reason::DropUnenforced, direction::INGRESS);
        return TC_ACT_SHOT;
    }
    PASS
}
