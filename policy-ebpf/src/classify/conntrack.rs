//! Conntrack and fragment keys, what a conntrack hit allows, and ICMP
//! errors related to a tracked flow.
use aya_ebpf::{bindings::BPF_NOEXIST, programs::TcContext};
use core::intrinsics::{AtomicOrdering, atomic_xadd};
use policy_common::{
    addr_eq,
    conntrack::{
        CT_FLAG_CLOSING, CT_FLAG_PENDING, CT_FLAG_SERVICE, CT_FLAG_SYN_ONLY, CT_OPENER_EITHER,
        CT_REFRESH_NS, CtEntry, CtKey, FragKey,
    },
    conntrack_share::{CT_USAGE_OPENED, CT_USAGE_RELEASED, CtUsageKey},
    direction,
    endpoint::EndpointInfo,
    family,
    ipcache::IpcacheEntry,
    proto,
    service::ServiceFlowKey,
    verdict::Reason,
};

use super::{
    TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
    policy::{Peer, judge},
    service::{rejudge_backend, service_hit},
};
use crate::{
    maps::{CONNTRACK, CT_SHARE, CT_USAGE, Scratch},
    parse::{IpPacket, quoted_flow},
};

/// A tracked flow judged again, as its opener was (`dir` the way it was
/// opened, `port` its destination port): its peer first checked by the
/// pod-range guard, which the flow's packets skip while the endpoint's
/// revision stands.
#[inline(always)]
fn judge_again(
    ep: &EndpointInfo,
    dir: u8,
    fam: u8,
    peer_addr: Peer<'_>,
    protocol: u8,
    port: u16,
    origin: u16,
) -> (Reason, IpcacheEntry) {
    if crate::pod_range_guard::addr_unenforced(fam, peer_addr.addr) {
        return (Reason::DropUnenforced, IpcacheEntry::UNKNOWN);
    }
    judge(ep, dir, fam, peer_addr, protocol, port, origin, false)
}

/// A conntrack hit: still allowed under the endpoint's current revision?
/// `orig_port` is the destination port of the packet that opened the flow.
#[inline(always)]
pub(super) fn on_ct_hit(
    entry: &mut CtEntry,
    key: &CtKey,
    ep: &EndpointInfo,
    pkt: &IpPacket,
    peer_addr: Peer<'_>,
    orig_port: u16,
    now: u64,
    hit: Reason,
) -> (Reason, IpcacheEntry) {
    let mut peer = IpcacheEntry::UNKNOWN;
    if entry.revision != ep.revision {
        let (reason, p) = judge_again(
            ep,
            entry.direction,
            pkt.family,
            peer_addr,
            pkt.protocol,
            proto::policy_port(pkt.protocol, orig_port),
            entry.origin,
        );
        peer = p;
        if reason.is_drop() {
            let _ = CONNTRACK.remove(key);
            return (reason.when_judged_again(), peer);
        }
        entry.revision = ep.revision;
    }
    if pkt.protocol == proto::TCP {
        if pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            entry.flags |= CT_FLAG_CLOSING;
        }
        if pkt.tcp_flags & TCP_ACK != 0 && entry.flags & CT_FLAG_SYN_ONLY != 0 {
            entry.flags &= !CT_FLAG_SYN_ONLY;
        }
    }
    if policy_common::conntrack::age_ns(now, entry.last_seen_ns) > CT_REFRESH_NS {
        entry.last_seen_ns = now;
    }
    (hit, peer)
}

/// The verdict for a packet of a tracked flow, looked up under `key`
/// (see [`fill_ct_key`]); None when no usable entry holds it. The entry
/// says which way the flow was opened: a packet travelling `dir` the same
/// way continues it, one travelling the other way answers it. An echo
/// meets only the role its key asked for (the opener is in the key).
#[inline(always)]
pub(super) fn tracked(
    key: &CtKey,
    flow: &mut ServiceFlowKey,
    ep: &EndpointInfo,
    pkt: &IpPacket,
    peer_addr: Peer<'_>,
    now: u64,
    dir: u8,
) -> Option<(Reason, IpcacheEntry)> {
    let entry = CONNTRACK.get_ptr_mut(key)?;
    // SAFETY: a pointer to the map value, valid for this program run.
    let entry = unsafe { &mut *entry };
    if !usable(entry, pkt, now) {
        return None;
    }
    let forward = entry.direction == dir;
    if entry.flags & CT_FLAG_SERVICE != 0 {
        return service_hit(entry, key, flow, ep, pkt, now, forward);
    }
    // A reply is judged again (if stale) as its opener was, with the
    // opener's destination port, which is this packet's source.
    let (port, hit) = if forward {
        (pkt.dport, Reason::AllowEstablished)
    } else {
        (pkt.sport, Reason::AllowReply)
    };
    Some(on_ct_hit(entry, key, ep, pkt, peer_addr, port, now, hit))
}

#[inline(always)]
pub(super) fn live(entry: &CtEntry, protocol: u8, now: u64) -> bool {
    entry.is_live(protocol, now)
}

/// A TCP segment that opens a connection (SYN without ACK).
#[inline(always)]
pub(super) fn syn_only(pkt: &IpPacket) -> bool {
    pkt.protocol == proto::TCP && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// Whether a packet may ride `entry`: it is live, and it is not a closing
/// flow whose tuple a new SYN reuses (that connection is judged afresh).
#[inline(always)]
pub(super) fn usable(entry: &CtEntry, pkt: &IpPacket, now: u64) -> bool {
    live(entry, pkt.protocol, now) && !(syn_only(pkt) && entry.flags & CT_FLAG_CLOSING != 0)
}

/// Whether interface `ifindex` may open one more flow: it holds less
/// than its share of `CONNTRACK` (see `policy_common::conntrack_share`).
/// If so, the flow is counted as opened. Only new flows pay for this.
#[inline(always)]
pub(super) fn share_allows(ifindex: u32, now: u64) -> bool {
    let Some(share) = CT_SHARE.get(0) else {
        return true;
    };
    if share.share == 0 {
        return true;
    }
    let key = CtUsageKey {
        ifindex,
        counter: CT_USAGE_OPENED,
    };
    let mut opened = CT_USAGE.get_ptr_mut(&key);
    if opened.is_none() {
        let _ = CT_USAGE.insert(&key, &0, BPF_NOEXIST as u64);
        opened = CT_USAGE.get_ptr_mut(&key);
    }
    // No counter (the map is full of counters the agent has not swept
    // yet): this interface is not bounded until it has one. Refusing would
    // stall a pod for the agent's bookkeeping; the count says so.
    let Some(opened) = opened else {
        return true;
    };
    let released_key = CtUsageKey {
        ifindex,
        counter: CT_USAGE_RELEASED,
    };
    // SAFETY: a map value pointer, valid for this program run.
    let released = CT_USAGE.get_ptr(&released_key).map_or(0, |r| unsafe { *r });
    // SAFETY: as above (a racing add makes the read one short: the bound
    // is that loose).
    if !share.may_open(unsafe { *opened }, released, now) {
        return false;
    }
    // SAFETY: as above; an aligned u64 every CPU adds to atomically.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(opened, 1) };
    true
}

/// The key of the flow a packet travelling `dir` belongs to, named from
/// the pod's side (see `CtKey`); `opener` is [`ct_opener`]'s.
#[inline(always)]
pub(crate) fn fill_ct_key(key: &mut CtKey, ifindex: u32, dir: u8, pkt: &IpPacket, opener: u8) {
    key.ifindex = ifindex;
    if dir == direction::EGRESS {
        key.local = pkt.src;
        key.remote = pkt.dst;
        key.local_port = pkt.sport;
        key.remote_port = pkt.dport;
    } else {
        key.local = pkt.dst;
        key.remote = pkt.src;
        key.local_port = pkt.dport;
        key.remote_port = pkt.sport;
    }
    key.protocol = pkt.protocol;
    key.family = pkt.family;
    key.opener = opener;
    key._pad = 0;
}

#[inline(always)]
pub(super) fn fill_frag_key(key: &mut FragKey, ifindex: u32, pkt: &IpPacket) {
    key.ifindex = ifindex;
    key.src = pkt.src;
    key.dst = pkt.dst;
    key.id = pkt.frag_id;
    key.protocol = pkt.frag_proto;
    key.family = pkt.family;
    key._pad = 0;
}

/// An ICMP error about a flow of this endpoint (its quoted header is in
/// `s.pkt.quoted_off`): it must travel back to the quoted packet's sender,
/// the quoted packet must belong to a flow tracked here (it went the other
/// way: a flow opened that way, or a reply in one opened this way), and
/// that flow must still be allowed under the endpoint's revision. None:
/// not related, judge it as plain ICMP.
#[inline(always)]
pub(super) fn related(
    ctx: &TcContext,
    s: &mut Scratch,
    ifindex: u32,
    ep: &EndpointInfo,
    dir: u8,
    now: u64,
) -> Option<Reason> {
    s.ct.ifindex = ifindex;
    s.ct.family = s.pkt.family;
    s.ct._pad = 0;
    let v6 = s.pkt.family == family::IPV6;
    // Read as the quoted packet travelled: local its source, remote its
    // destination, then turned to the pod's side.
    quoted_flow(ctx, s.pkt.quoted_off as usize, v6, &mut s.ct)?;
    if !addr_eq(&s.pkt.dst, &s.ct.local) {
        return None;
    }
    let quoted_dir = direction::opposite(dir);
    if quoted_dir == direction::INGRESS {
        core::mem::swap(&mut s.ct.local, &mut s.ct.remote);
        core::mem::swap(&mut s.ct.local_port, &mut s.ct.remote_port);
    }
    // An echo is keyed by its request's way, which may be either.
    let echo = matches!(s.ct.protocol, proto::ICMP | proto::ICMPV6);
    s.ct.opener = if echo { quoted_dir } else { CT_OPENER_EITHER };
    let mut found = CONNTRACK.get_ptr_mut(&s.ct);
    if found.is_none() && echo {
        s.ct.opener = dir;
        found = CONNTRACK.get_ptr_mut(&s.ct);
    }
    let entry = found?;
    // SAFETY: a pointer to the map value, valid for this program run.
    let entry = unsafe { &mut *entry };
    if !live(entry, s.ct.protocol, now) {
        return None;
    }
    if entry.flags & CT_FLAG_SERVICE != 0 {
        // Its peer is the backend, not the frontend in the key: judged as
        // its packets are (pending: still to be judged after DNAT).
        if entry.flags & CT_FLAG_PENDING == 0
            && entry.revision != ep.revision
            && let Some((Reason::DropPolicyChanged, _)) =
                rejudge_backend(entry, &s.ct, &mut s.flow, ep)
        {
            return Some(Reason::DropPolicyChanged);
        }
        return Some(Reason::AllowRelated);
    }
    if entry.revision != ep.revision {
        // Judged again as the flow's opener was: its direction, its peer,
        // its destination port.
        let opener = entry.direction;
        let dport = if opener == direction::EGRESS {
            s.ct.remote_port
        } else {
            s.ct.local_port
        };
        let port = proto::policy_port(s.ct.protocol, dport);
        let (reason, _) = judge_again(
            ep,
            opener,
            s.ct.family,
            Peer::tracked_remote(&s.ct.remote),
            s.ct.protocol,
            port,
            entry.origin,
        );
        if reason.is_drop() {
            let _ = CONNTRACK.remove(&s.ct);
            return Some(reason.when_judged_again());
        }
        entry.revision = ep.revision;
    }
    Some(Reason::AllowRelated)
}
