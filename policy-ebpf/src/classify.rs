//! The verdict. `policy_common::model` states the same procedure in plain
//! Rust; the differential test holds the two together.
//!
//! The packet and the keys built from it live in a per-CPU scratch buffer
//! (`SCRATCH`): the BPF stack is 512 bytes for the whole call chain.
use aya_ebpf::{
    bindings::{BPF_ANY, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use policy_common::{
    addr_eq,
    config::{CONFIG_DEBUG_LOG, CONFIG_NO_DROP_EVENTS},
    conntrack::{
        CT_FLAG_CLOSING, CT_FLAG_PENDING, CT_FLAG_SERVICE, CT_FLAG_SYN_ONLY, CT_LOOKUP_FORWARD,
        CT_LOOKUP_REPLY, CT_REFRESH_NS, CtEntry, CtKey, FragEntry, FragKey, ct_lookups,
    },
    direction,
    endpoint::{ENDPOINT_SLOT_USED, EndpointInfo, lookups},
    event::DropEvent,
    family, icmpv6_link_control, identity,
    ipcache::IpcacheEntry,
    policy::PolicyKey,
    proto,
    service::{
        SERVICE_FLOW_RESOLVED, ServiceFlow, ServiceFlowKey, mark, service_addr, service_prefix_len,
    },
    verdict::{Reason, counter_index},
};

use crate::{
    maps::{
        CONFIG, CONNTRACK, COUNTERS, DROP_EVENTS, ENDPOINT_SLOTS, ENDPOINTS, FRAGMENTS, IPCACHE_V4,
        IPCACHE_V6, POLICY, SCRATCH, SERVICE_FLOWS, SERVICES, Scratch,
    },
    parse::{FRAG_FIRST, FRAG_LATER, IP, IpPacket, MALFORMED, parse, quoted_flow},
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

#[inline(always)]
fn ipcache_lookup(fam: u8, addr: &[u8; 16]) -> IpcacheEntry {
    let hit = if fam == family::IPV4 {
        let key = aya_ebpf::btf_maps::lpm_trie::Key::new(32, [addr[0], addr[1], addr[2], addr[3]]);
        IPCACHE_V4.get(&key).copied()
    } else {
        let key = aya_ebpf::btf_maps::lpm_trie::Key::new(128, *addr);
        IPCACHE_V6.get(&key).copied()
    };
    hit.unwrap_or(IpcacheEntry::UNKNOWN)
}

/// Probes the policy entries for one peer identity, in the documented
/// order: port prefixes present for this endpoint, longest first, then
/// the any-protocol entry. Out of line, so its key has a small frame of
/// its own. `packed` is direction << 24 | protocol << 16 | port.
#[inline(never)]
fn probe_peer(endpoint: u32, peer: u32, packed: u32, bits: u32) -> u32 {
    let dir = (packed >> 24) as u8;
    let protocol = (packed >> 16) as u8;
    let port = packed as u16;
    if proto::has_ports(protocol) {
        let mut len: u8 = 17;
        while len > 0 {
            len -= 1;
            if bits & lookups::port_prefix(len) != 0 {
                let key = PolicyKey::new(endpoint, dir, peer, protocol, len, port);
                if POLICY.get_ptr(&key).is_some() {
                    return 1;
                }
            }
        }
    }
    if bits & lookups::ANY_PROTOCOL != 0 {
        let key = PolicyKey::new(endpoint, dir, peer, proto::ANY, 0, 0);
        if POLICY.get_ptr(&key).is_some() {
            return 1;
        }
    }
    0
}

/// Judges a flow of `ep` with `peer_addr` in `dir` as if it were new.
#[inline(always)]
fn judge(
    ep: &EndpointInfo,
    dir: u8,
    fam: u8,
    peer_addr: &[u8; 16],
    protocol: u8,
    port: u16,
) -> (Reason, IpcacheEntry) {
    let peer = ipcache_lookup(fam, peer_addr);
    if peer.identity == identity::NODE {
        return (Reason::AllowNode, peer);
    }
    if !ep.isolated(dir) {
        return (Reason::AllowNotIsolated, peer);
    }
    let bits = ep.lookups(dir);
    let packed = (u32::from(dir) << 24) | (u32::from(protocol) << 16) | u32::from(port);
    if peer.identity != identity::ANY && probe_peer(ep.identity, peer.identity, packed, bits) != 0 {
        return (Reason::AllowPolicy, peer);
    }
    if probe_peer(ep.identity, peer.cidr_identity, packed, bits) != 0 {
        return (Reason::AllowPolicy, peer);
    }
    if bits & lookups::ANY_PEER != 0 && probe_peer(ep.identity, identity::ANY, packed, bits) != 0 {
        return (Reason::AllowPolicy, peer);
    }
    (Reason::DropPolicy, peer)
}

/// A conntrack hit: still allowed under the endpoint's current revision?
/// `orig_port` is the destination port of the packet that opened the flow.
#[inline(always)]
fn on_ct_hit(
    entry: &mut CtEntry,
    key: &CtKey,
    ep: &EndpointInfo,
    pkt: &IpPacket,
    peer_addr: &[u8; 16],
    orig_port: u16,
    now: u64,
    hit: Reason,
) -> (Reason, IpcacheEntry) {
    let mut peer = IpcacheEntry::UNKNOWN;
    if entry.revision != ep.revision {
        let (reason, p) = judge(
            ep,
            entry.direction,
            pkt.family,
            peer_addr,
            pkt.protocol,
            proto::policy_port(pkt.protocol, orig_port),
        );
        peer = p;
        if reason.is_drop() {
            let _ = CONNTRACK.remove(key);
            return (Reason::DropPolicyChanged, peer);
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
    if now.wrapping_sub(entry.last_seen_ns) > CT_REFRESH_NS {
        entry.last_seen_ns = now;
    }
    (hit, peer)
}

#[inline(always)]
fn live(entry: &CtEntry, protocol: u8, now: u64) -> bool {
    now.wrapping_sub(entry.last_seen_ns) <= entry.timeout_ns(protocol)
}

/// A TCP segment that opens a connection (SYN without ACK).
#[inline(always)]
fn syn_only(pkt: &IpPacket) -> bool {
    pkt.protocol == proto::TCP && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// Whether a packet may ride `entry`: it is live, and it is not a closing
/// flow whose tuple a new SYN reuses (that connection is judged afresh).
#[inline(always)]
fn usable(entry: &CtEntry, pkt: &IpPacket, now: u64) -> bool {
    live(entry, pkt.protocol, now) && !(syn_only(pkt) && entry.flags & CT_FLAG_CLOSING != 0)
}

#[inline(always)]
pub(crate) fn fill_ct_key(key: &mut CtKey, ifindex: u32, dir: u8, pkt: &IpPacket) {
    key.ifindex = ifindex;
    key.src = pkt.src;
    key.dst = pkt.dst;
    key.sport = pkt.sport;
    key.dport = pkt.dport;
    key.protocol = pkt.protocol;
    key.family = pkt.family;
    key.direction = dir;
    key._pad = 0;
}

#[inline(always)]
fn fill_frag_key(key: &mut FragKey, ifindex: u32, pkt: &IpPacket) {
    key.ifindex = ifindex;
    key.src = pkt.src;
    key.dst = pkt.dst;
    key.id = pkt.frag_id;
    key.protocol = pkt.frag_proto;
    key.family = pkt.family;
    key._pad = 0;
}

/// Whether `addr` is a Service frontend (or in a Service range). Out of
/// line: its key gets a frame of its own.
#[inline(never)]
fn is_frontend(fam: u8, addr: &[u8; 16]) -> bool {
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
fn service_flow_of(flow: &mut ServiceFlowKey, key: &CtKey) -> Option<&'static mut ServiceFlow> {
    flow.ifindex = key.ifindex;
    flow.src = key.src;
    flow.sport = key.sport;
    flow.protocol = key.protocol;
    flow.family = key.family;
    // SAFETY: a pointer to the map value, valid for this program run.
    let f = unsafe { &mut *SERVICE_FLOWS.get_ptr_mut(&*flow)? };
    if addr_eq(&f.frontend, &key.dst) && f.frontend_port == key.dport {
        Some(f)
    } else {
        None
    }
}

/// A judged service flow at a stale revision: judged again against the
/// backend it landed on (the egress of its client). None: the backend is
/// not known here. Denied → both entries are removed.
#[inline(always)]
fn rejudge_backend(
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
    // Its own Service's backend is the pod itself: allowed (as after DNAT).
    let (reason, peer) = if ep.owns(key.family, &f.backend) {
        (Reason::AllowSelf, IpcacheEntry::UNKNOWN)
    } else {
        judge(
            ep,
            direction::EGRESS,
            key.family,
            &f.backend,
            key.protocol,
            port,
        )
    };
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
fn service_hit(
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
    if now.wrapping_sub(entry.last_seen_ns) > CT_REFRESH_NS {
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

/// A new flow of an egress-isolated pod to a Service frontend: tracked as
/// pending (its pre-DNAT tuple, and the frontend by the client's source)
/// and sent on with the mark, to be judged after DNAT.
#[inline(always)]
fn defer(s: &mut Scratch, ifindex: u32, ep: &EndpointInfo, now: u64) -> Reason {
    if mark::pending(ifindex).is_none() {
        // The mark cannot carry this interface: the backend cannot be
        // judged, so the flow is refused (stay closed where unsure).
        return Reason::DropPolicy;
    }
    let pkt = &s.pkt;
    // After DNAT a flow is known by its client's port alone: while a live
    // flow to another frontend holds it, this one cannot be told apart.
    s.flow.ifindex = ifindex;
    s.flow.src = pkt.src;
    s.flow.sport = pkt.sport;
    s.flow.protocol = pkt.protocol;
    s.flow.family = pkt.family;
    if let Some(f) = SERVICE_FLOWS.get_ptr(&s.flow) {
        // SAFETY: a pointer to the map value, valid for this run.
        let f = unsafe { &*f };
        if !(addr_eq(&f.frontend, &pkt.dst) && f.frontend_port == pkt.dport) {
            fill_ct_key(&mut s.ct, ifindex, direction::EGRESS, pkt);
            s.ct.dst = f.frontend;
            s.ct.dport = f.frontend_port;
            if let Some(other) = CONNTRACK.get_ptr(&s.ct)
                // SAFETY: as above.
                && live(unsafe { &*other }, pkt.protocol, now)
            {
                return Reason::DropPolicy;
            }
        }
    }
    fill_ct_key(&mut s.ct, ifindex, direction::EGRESS, pkt);
    let mut flags = CT_FLAG_SERVICE | CT_FLAG_PENDING;
    if syn_only(pkt) {
        flags |= CT_FLAG_SYN_ONLY;
    }
    let entry = CtEntry {
        last_seen_ns: now,
        revision: ep.revision,
        direction: direction::EGRESS,
        flags,
        _pad: 0,
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
fn judge_service(s: &mut Scratch, client: u32, flags: u32) -> u32 {
    let Some(ep) = endpoint(client) else {
        // The client is gone: nothing to judge its egress by.
        count(Reason::DropPolicy, direction::EGRESS);
        return 0;
    };
    let pkt = &s.pkt;
    s.flow.ifindex = client;
    s.flow.src = pkt.src;
    s.flow.sport = pkt.sport;
    s.flow.protocol = pkt.protocol;
    s.flow.family = pkt.family;
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
    // A pod to its own Service (hairpin): the backend is the client, and
    // traffic a pod sends to itself is allowed (as a direct packet to
    // its own address is, and as the iptables datapath passes it).
    let (reason, peer) = if ep.owns(pkt.family, &pkt.dst) {
        (Reason::AllowSelf, IpcacheEntry::UNKNOWN)
    } else {
        judge(
            ep,
            direction::EGRESS,
            pkt.family,
            &pkt.dst,
            pkt.protocol,
            proto::policy_port(pkt.protocol, pkt.dport),
        )
    };
    if let Some(f) = SERVICE_FLOWS.get_ptr_mut(&s.flow) {
        // SAFETY: a pointer to the map value, valid for this run.
        let f = unsafe { &mut *f };
        s.ct.ifindex = client;
        s.ct.src = pkt.src;
        s.ct.dst = f.frontend;
        s.ct.sport = pkt.sport;
        s.ct.dport = f.frontend_port;
        s.ct.protocol = pkt.protocol;
        s.ct.family = pkt.family;
        s.ct.direction = direction::EGRESS;
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
    if reason.is_drop() {
        if flags & CONFIG_NO_DROP_EVENTS == 0 {
            emit_drop(
                ep,
                (u64::from(client) << 16) | ((reason as u64) << 8) | u64::from(direction::EGRESS),
                Some(&s.pkt),
                &peer,
            );
        }
        return 0;
    }
    1
}

/// A packet marked at a client's veth, at the first hook after DNAT:
/// judges the client's egress (see [`judge_service`]) and clears the mark.
/// False: drop. Out of line: only marked packets take it.
#[inline(never)]
fn after_dnat(ctx: &TcContext, s: &mut Scratch, flags: u32) -> bool {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run.
    let m = unsafe { (*ctx.skb.skb).mark };
    let Some(client) = mark::client(m) else {
        return true;
    };
    ctx.set_mark(m & !mark::MASK);
    if parse(ctx, &mut s.pkt) != IP {
        return true;
    }
    judge_service(s, client, flags) != 0
}

/// The judgement after DNAT at a hook where it can happen (see
/// [`after_dnat`]); false: drop. The programs call it before
/// [`classify`], never inside it: a path through it then reaches the
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
    after_dnat(ctx, s, config_flags())
}

/// The uplink's egress: a pod's packet to a Service whose backend is on
/// another node, judged after DNAT; a local pod's packet leaving before
/// it is enforced is dropped; anything else passes.
pub fn uplink(ctx: &TcContext) -> i32 {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return PASS;
    };
    // SAFETY: this CPU's slot; programs do not nest on one CPU.
    let s = unsafe { &mut *scratch };
    if !after_dnat(ctx, s, config_flags()) || crate::pod_range_guard::uplink_out_unenforced(ctx, s)
    {
        DROP
    } else {
        PASS
    }
}

/// An ICMP error about a flow of this endpoint (its quoted header is in
/// `s.pkt.quoted_off`): it must travel back to the quoted packet's sender,
/// the quoted packet must belong to a flow tracked here (it went the other
/// way: a flow opened that way, or a reply in one opened this way), and
/// that flow must still be allowed under the endpoint's revision. None:
/// not related, judge it as plain ICMP.
#[inline(always)]
fn related(
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
    quoted_flow(ctx, s.pkt.quoted_off as usize, v6, &mut s.ct)?;
    if !addr_eq(&s.pkt.dst, &s.ct.src) {
        return None;
    }
    s.ct.direction = direction::opposite(dir);
    let mut found = CONNTRACK.get_ptr_mut(&s.ct);
    if found.is_none() {
        s.ct = s.ct.reply();
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
        let opener = s.ct.direction;
        let peer = if opener == direction::EGRESS {
            s.ct.dst
        } else {
            s.ct.src
        };
        let port = proto::policy_port(s.ct.protocol, s.ct.dport);
        let (reason, _) = judge(ep, opener, s.ct.family, &peer, s.ct.protocol, port);
        if reason.is_drop() {
            let _ = CONNTRACK.remove(&s.ct);
            return Some(Reason::DropPolicyChanged);
        }
        entry.revision = ep.revision;
    }
    Some(Reason::AllowRelated)
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
    if pkt.protocol == proto::ICMPV6
        && pkt.frag != FRAG_LATER
        && icmpv6_link_control(pkt.icmp_type, &pkt.src, pkt.hop_limit)
    {
        return (Reason::AllowNeighborDiscovery, unknown);
    }
    if dir == direction::EGRESS {
        // The pod chooses every byte it sends: only its own source is it.
        if !ep.owns(pkt.family, &pkt.src) {
            return (Reason::DropSpoofed, unknown);
        }
        if addr_eq(&pkt.src, &pkt.dst) {
            return (Reason::AllowSelf, unknown);
        }
    }
    if crate::pod_range_guard::peer_unenforced(pkt, dir) {
        return (Reason::DropUnenforced, unknown);
    }
    if pkt.frag == FRAG_LATER {
        fill_frag_key(&mut s.frag, ifindex, pkt);
        return if FRAGMENTS.get_ptr(&s.frag).is_some() {
            (Reason::AllowFragment, unknown)
        } else {
            (Reason::DropFragmentUnknown, unknown)
        };
    }
    let peer_addr = if dir == direction::EGRESS {
        &pkt.dst
    } else {
        &pkt.src
    };
    let port = proto::policy_port(pkt.protocol, pkt.dport);
    if !ep.tracks() {
        // Isolated in no direction: nothing to track, nothing to deny.
        return judge(ep, dir, pkt.family, peer_addr, pkt.protocol, port);
    }
    // SAFETY: a helper without preconditions.
    let now = unsafe { bpf_ktime_get_coarse_ns() };

    if pkt.quoted_off != 0
        && let Some(reason) = related(ctx, s, ifindex, ep, dir, now)
    {
        return (reason, unknown);
    }
    let pkt = &s.pkt;
    let peer_addr = if dir == direction::EGRESS {
        &pkt.dst
    } else {
        &pkt.src
    };

    let lookups = ct_lookups(pkt.protocol, pkt.icmp_type);
    fill_ct_key(&mut s.ct, ifindex, dir, pkt);
    if lookups & CT_LOOKUP_FORWARD != 0
        && let Some(entry) = CONNTRACK.get_ptr_mut(&s.ct)
    {
        // SAFETY: a pointer to the map value, valid for this program run.
        let entry = unsafe { &mut *entry };
        if usable(entry, pkt, now) {
            if entry.flags & CT_FLAG_SERVICE != 0 {
                if let Some(verdict) = service_hit(entry, &s.ct, &mut s.flow, ep, pkt, now, true) {
                    return verdict;
                }
            } else {
                return on_ct_hit(
                    entry,
                    &s.ct,
                    ep,
                    pkt,
                    peer_addr,
                    pkt.dport,
                    now,
                    Reason::AllowEstablished,
                );
            }
        }
    }
    s.ct = s.ct.reply();
    if lookups & CT_LOOKUP_REPLY != 0
        && let Some(entry) = CONNTRACK.get_ptr_mut(&s.ct)
    {
        // SAFETY: as above.
        let entry = unsafe { &mut *entry };
        if usable(entry, pkt, now) {
            if entry.flags & CT_FLAG_SERVICE != 0 {
                if let Some(verdict) = service_hit(entry, &s.ct, &mut s.flow, ep, pkt, now, false) {
                    return verdict;
                }
            } else {
                // A reply: judged again (if stale) as its opener was, with
                // the opener's destination port, which is this packet's
                // source.
                return on_ct_hit(
                    entry,
                    &s.ct,
                    ep,
                    pkt,
                    peer_addr,
                    pkt.sport,
                    now,
                    Reason::AllowReply,
                );
            }
        }
    }
    let midstream = pkt.protocol == proto::TCP && pkt.tcp_flags & TCP_SYN == 0;
    if midstream {
        count(Reason::CtMidstreamMiss, dir);
    }
    // To a Service frontend: the backend is chosen after us (DNAT), so the
    // egress is judged there.
    if dir == direction::EGRESS && ep.isolated(direction::EGRESS) && proto::has_ports(pkt.protocol)
    {
        if is_frontend(pkt.family, &pkt.dst) {
            return (defer(s, ifindex, ep, now), unknown);
        }
    }
    let pkt = &s.pkt;
    let peer_addr = if dir == direction::EGRESS {
        &pkt.dst
    } else {
        &pkt.src
    };

    let (reason, peer) = judge(ep, dir, pkt.family, peer_addr, pkt.protocol, port);
    // Only a packet the pod sent (its source checked above) or one it
    // receives at its own address opens an entry; never a TCP packet
    // without SYN: mid-stream, who opened the connection is unknown, and a
    // pod answering a connection a policy change just cut would reopen it
    // in its own name (the peer's packets then pass as replies). Such a
    // flow is judged packet by packet both ways.
    let opens = dir == direction::EGRESS || ep.owns(pkt.family, &pkt.dst);
    if (reason == Reason::AllowPolicy || reason == Reason::AllowNotIsolated)
        && lookups != 0
        && opens
        && !midstream
    {
        let mut flags = 0;
        if pkt.protocol == proto::TCP {
            if syn_only(pkt) {
                flags |= CT_FLAG_SYN_ONLY;
            }
            if pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
                flags |= CT_FLAG_CLOSING;
            }
        }
        fill_ct_key(&mut s.ct, ifindex, dir, pkt);
        let entry = CtEntry {
            last_seen_ns: now,
            revision: ep.revision,
            direction: dir,
            flags,
            _pad: 0,
        };
        if CONNTRACK.insert(&s.ct, &entry, BPF_ANY as u64).is_err() {
            count(Reason::CtCreateFailed, dir);
        }
    }
    (reason, peer)
}

/// `meta` is ifindex << 16 | reason << 8 | direction (five arguments at
/// most for a BPF-to-BPF call). `pkt` is None for unparsed packets.
#[inline(never)]
fn emit_drop(ep: &EndpointInfo, meta: u64, pkt: Option<&IpPacket>, peer: &IpcacheEntry) {
    let ifindex = (meta >> 16) as u32;
    let reason = (meta >> 8) as u8;
    let dir = meta as u8;
    let Some(mut slot) = DROP_EVENTS.reserve(0) else {
        count(Reason::EventLost, dir);
        return;
    };
    // Fill the reserved slot in place rather than copying a stack image.
    let ev: &mut DropEvent = slot.write(DropEvent {
        // SAFETY: a helper without preconditions.
        timestamp_ns: unsafe { bpf_ktime_get_ns() },
        ifindex,
        endpoint_identity: ep.identity,
        peer_identity: peer.identity,
        peer_cidr_identity: peer.cidr_identity,
        src: [0; 16],
        dst: [0; 16],
        sport: 0,
        dport: 0,
        protocol: 0,
        family: 0,
        direction: dir,
        reason,
    });
    if let Some(p) = pkt {
        ev.src = p.src;
        ev.dst = p.dst;
        ev.sport = p.sport;
        ev.dport = p.dport;
        ev.protocol = p.protocol;
        ev.family = p.family;
    }
    slot.submit(0);
}

#[inline(never)]
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
        if flags & CONFIG_NO_DROP_EVENTS == 0 {
            emit_drop(
                ep,
                (u64::from(ifindex) << 16) | ((reason as u64) << 8) | u64::from(dir),
                pkt,
                &peer,
            );
        }
        DROP
    } else {
        PASS
    }
}
