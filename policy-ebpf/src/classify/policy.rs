//! The peer's identity (the ipcache) and the policy lookup for one
//! peer identity.
use policy_common::{
    conntrack::{ORIGIN_FORWARDED, ORIGIN_SOURCE},
    direction, encapsulation,
    endpoint::{EndpointInfo, lookups},
    family, identity,
    ipcache::IpcacheEntry,
    policy::{ENTRY_TIERS_ONLY, PORT_PREFIX_LENGTHS, PolicyEntry, PolicyKey, TierSlot, Tiers},
    proto,
    verdict::Reason,
};

use super::endpoint;
use crate::{
    maps::{IPCACHE_HOSTS_V4, IPCACHE_HOSTS_V6, IPCACHE_V4, IPCACHE_V6, POLICY, SCRATCH, Scratch},
    parse::IpPacket,
};

/// The identities of `addr`: its own entry (a pod's address: one hash
/// probe), else the longest prefix holding it (the trie walk, several
/// times dearer).
#[inline(always)]
pub(super) fn ipcache_lookup(fam: u8, addr: &[u8; 16]) -> IpcacheEntry {
    let hit = if fam == family::IPV4 {
        let host = [addr[0], addr[1], addr[2], addr[3]];
        match IPCACHE_HOSTS_V4.get_ptr(&host) {
            // SAFETY: a map value pointer, valid for this program run.
            Some(e) => Some(unsafe { *e }),
            None => {
                let key = aya_ebpf::btf_maps::lpm_trie::Key::new(32, host);
                IPCACHE_V4.get(&key).copied()
            }
        }
    } else {
        match IPCACHE_HOSTS_V6.get_ptr(addr) {
            // SAFETY: as above.
            Some(e) => Some(unsafe { *e }),
            None => {
                let key = aya_ebpf::btf_maps::lpm_trie::Key::new(128, *addr);
                IPCACHE_V6.get(&key).copied()
            }
        }
    };
    hit.unwrap_or(IpcacheEntry::UNKNOWN)
}

/// A key built by [`PolicyKey::words`], as the map takes it.
#[inline(always)]
fn as_key(words: &[u64; 2]) -> &PolicyKey {
    // SAFETY: `PolicyKey` is 16 bytes of plain integers (align 4), and
    // `words` holds its little-endian bytes (align 8).
    unsafe { &*words.as_ptr().cast::<PolicyKey>() }
}

/// The port-prefix bits of the lengths the agent writes
/// (`PORT_PREFIX_LENGTHS`).
const GIVEN_PREFIXES: u32 = {
    let mut bits = 0;
    let mut i = 0;
    while i < PORT_PREFIX_LENGTHS.len() {
        bits |= lookups::port_prefix(PORT_PREFIX_LENGTHS[i]);
        i += 1;
    }
    bits
};

/// Probes the entry of port prefix `len` for one peer, if `bits` says
/// the endpoint has one; true when `hit` says to stop.
#[inline(always)]
fn visit_len(
    endpoint: u32,
    peer: u32,
    packed: u32,
    bits: u32,
    len: u8,
    hit: &mut impl FnMut(&PolicyEntry) -> bool,
) -> bool {
    if bits & lookups::port_prefix(len) == 0 {
        return false;
    }
    let key = PolicyKey::new(
        endpoint,
        (packed >> 24) as u8,
        peer,
        (packed >> 16) as u8,
        len,
        packed as u16,
    )
    .words();
    match POLICY.get_ptr(as_key(&key)) {
        // SAFETY: a map value pointer stays valid under RCU for the rest
        // of this program run.
        Some(entry) => hit(unsafe { &*entry }),
        None => false,
    }
}

/// Visits the policy entries for one peer identity, in the documented
/// order: port prefixes present for this endpoint, longest first, then
/// the any-protocol entry; stops when `hit` says so. `packed` is
/// direction << 24 | protocol << 16 | port.
#[inline(always)]
fn visit_peer(
    endpoint: u32,
    peer: u32,
    packed: u32,
    bits: u32,
    mut hit: impl FnMut(&PolicyEntry) -> bool,
) -> bool {
    let protocol = (packed >> 16) as u8;
    if proto::has_ports(protocol) {
        let present = bits & lookups::PORT_PREFIXES;
        if present & !GIVEN_PREFIXES == 0 {
            // The lengths the agent writes: seven tests where the loop
            // below takes seventeen.
            for len in PORT_PREFIX_LENGTHS {
                if visit_len(endpoint, peer, packed, bits, len, &mut hit) {
                    return true;
                }
                // No shorter prefix present: the rest would probe nothing
                // (a typical endpoint has only single ports, the longest).
                if present & (lookups::port_prefix(len) - 1) == 0 {
                    break;
                }
            }
        } else {
            // Some other length (an entry an older agent wrote): every
            // length, so that none is skipped.
            let mut len: u8 = 17;
            while len > 0 {
                len -= 1;
                if visit_len(endpoint, peer, packed, bits, len, &mut hit) {
                    return true;
                }
                if present & (lookups::port_prefix(len) - 1) == 0 {
                    break;
                }
            }
        }
    }
    if bits & lookups::ANY_PROTOCOL != 0 {
        let key = PolicyKey::new(endpoint, (packed >> 24) as u8, peer, proto::ANY, 0, 0).words();
        if let Some(entry) = POLICY.get_ptr(as_key(&key)) {
            // SAFETY: as above.
            if hit(unsafe { &*entry }) {
                return true;
            }
        }
    }
    false
}

/// Set in `bits` (never in a map) when every entry must be folded in.
const FOLD_ALL: u32 = 1 << 31;

/// Probes the policy entries for one peer identity. NetworkPolicy alone:
/// whether any NetworkPolicy entry exists (any such hit allows). With `FOLD_ALL` (an
/// endpoint with ClusterNetworkPolicy rules): folds every entry into the
/// scratch `tiers` and returns 0, every shape counting (see `Tiers`).
///
/// A global function (exported by the linker, see build.rs; scalar
/// arguments only): the verifier checks it once, on its own, instead of
/// once per call in every caller's state. Folding all 17 shapes at each of
/// the six places a flow is judged took the pod programs to 957,000 of the
/// verifier's 1,000,000 instructions; as a global function they need
/// about 120,000.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn probe_peer(endpoint: u32, peer: u32, packed: u32, bits: u32) -> u32 {
    if bits & FOLD_ALL == 0 {
        // An entry of tier slots alone allows nothing here (it may land
        // before its endpoint's tier flag does).
        return u32::from(visit_peer(endpoint, peer, packed, bits, |entry| {
            if entry.flags & ENTRY_TIERS_ONLY != 0 {
                return false;
            }
            // The rule a flow record names (fetched on a hit only).
            if let Some(scratch) = SCRATCH.get_ptr_mut(0) {
                // SAFETY: the per-CPU scratch value, ours for this run.
                unsafe { (*scratch).tiers.network_policy_rule = entry.rule_ref };
            }
            true
        }));
    }
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    visit_peer(endpoint, peer, packed, bits, |entry| {
        // SAFETY: the per-CPU scratch value, ours for this program run.
        unsafe { (*scratch).tiers.add(entry) };
        false
    });
    0
}

/// Zeroes `t` field by field: assigned whole, LLVM made it a call to
/// `memset`, a byte loop, on every new flow.
///
/// # Safety
/// `t` points to a live `Tiers` only this program run writes.
#[inline(always)]
unsafe fn clear_tiers(t: *mut Tiers) {
    // SAFETY: as the caller promises; volatile keeps the stores apart.
    unsafe {
        core::ptr::write_volatile(&raw mut (*t).admin, TierSlot::NONE);
        core::ptr::write_volatile(&raw mut (*t).baseline, TierSlot::NONE);
        core::ptr::write_volatile(&raw mut (*t).network_policy, 0);
        core::ptr::write_volatile(&raw mut (*t).network_policy_rule, 0);
    }
}

/// Where a flow's peer address is, for [`judge_flow`]: one of the
/// scratch's addresses, named by `at` (a global function's pointer
/// argument is memory the 6.1 verifier refuses as a map key, and a copy on
/// the stack took the call chain past its 512 bytes).
#[derive(Clone, Copy)]
pub(super) struct Peer<'a> {
    /// The address itself, for the caller's own checks.
    pub addr: &'a [u8; 16],
    at: u8,
}

const AT_PACKET_SOURCE: u8 = 0;
const AT_PACKET_DESTINATION: u8 = 1;
const AT_TRACKED_REMOTE: u8 = 2;
const AT_COPIED: u8 = 3;

impl<'a> Peer<'a> {
    /// The source of the scratch's packet (`s.pkt.src`).
    #[inline(always)]
    pub(super) fn packet_source(pkt: &'a IpPacket) -> Self {
        Self {
            addr: &pkt.src,
            at: AT_PACKET_SOURCE,
        }
    }

    /// The destination of the scratch's packet (`s.pkt.dst`).
    #[inline(always)]
    pub(super) fn packet_destination(pkt: &'a IpPacket) -> Self {
        Self {
            addr: &pkt.dst,
            at: AT_PACKET_DESTINATION,
        }
    }

    /// The remote end of the scratch's conntrack key (`s.ct.remote`).
    #[inline(always)]
    pub(super) fn tracked_remote(addr: &'a [u8; 16]) -> Self {
        Self {
            addr,
            at: AT_TRACKED_REMOTE,
        }
    }

    /// Anywhere else: copied to the scratch for the judgement.
    #[inline(always)]
    pub(super) fn elsewhere(addr: &'a [u8; 16]) -> Self {
        Self {
            addr,
            at: AT_COPIED,
        }
    }
}

/// The peer a flow is judged by (see `CtEntry::origin`): the address's
/// identities; for a forwarded flow the same, except that a node address
/// does not make it the node; for a pod's flow something rewrote, that
/// pod's own (unknown, judged as an address nobody claims, once the pod is
/// gone). And whether that pod is `ep` itself (what reaches it from its
/// own interface: a Service hairpin).
#[inline(always)]
fn peer_of(ep: &EndpointInfo, origin: u16, fam: u8, peer_addr: &[u8; 16]) -> (IpcacheEntry, bool) {
    if origin == ORIGIN_SOURCE || origin == ORIGIN_FORWARDED {
        let mut peer = ipcache_lookup(fam, peer_addr);
        if origin == ORIGIN_FORWARDED && peer.identity == identity::NODE {
            peer.identity = identity::ANY;
        }
        return (peer, false);
    }
    match endpoint(u32::from(origin)).and_then(|client| client.address(fam)) {
        Some(addr) => (ipcache_lookup(fam, &addr), ep.owns(fam, &addr)),
        None => (IpcacheEntry::UNKNOWN, false),
    }
}

/// Judges a flow of `ep` with `peer_addr` in `dir` as if it were new, its
/// peer as `origin` says.
///
/// Node traffic (the peer is one of the node's own addresses, and the
/// node itself sent it or the pod sends it to the node) is always
/// allowed, but for an encapsulation a pod sends to the node: decapsulated
/// there, its inner packet would travel on with a source the pod chose, so
/// it is judged by the address's class as any other peer. What a pod
/// ClusterNetworkPolicy tiers judge sends the node is judged by the tiers
/// (`nodes` and `networks` peers), the NetworkPolicy tier allowing it.
///
/// A pod's traffic to itself through a Service is allowed, but where
/// tiers judge it: "A Pod connecting to a Service IP that the service
/// proxy load-balances back to the same Pod is subject to
/// ClusterNetworkPolicy" (api-overview); the NetworkPolicy tier allows it.
/// `to_itself`: the client's egress after DNAT reached the client itself
/// (see `judge_backend`).
///
/// One call of [`judge_flow`], a global function the verifier checks once
/// per program instead of at each of the places a flow is judged.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn judge(
    ep: &EndpointInfo,
    dir: u8,
    fam: u8,
    peer_addr: Peer<'_>,
    protocol: u8,
    port: u16,
    origin: u16,
    to_itself: bool,
) -> (Reason, IpcacheEntry) {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return (Reason::DropPolicy, IpcacheEntry::UNKNOWN);
    };
    if peer_addr.at == AT_COPIED {
        // SAFETY: the per-CPU scratch value, ours for this program run.
        unsafe { (*scratch).judged_addr = *peer_addr.addr };
    }
    let packed = u64::from(dir)
        | (u64::from(fam) << 8)
        | (u64::from(protocol) << 16)
        | (u64::from(to_itself) << 24)
        | (u64::from(peer_addr.at) << 28)
        | (u64::from(port) << 32)
        | (u64::from(origin) << 48);
    let reason = judge_flow(ep, packed);
    // SAFETY: as above.
    let peer = unsafe { (*scratch).judged_peer };
    // Anything but a reason `judge_flow` returns is refused.
    let reason = Reason::from_u8(reason as u8).unwrap_or(Reason::DropPolicy);
    (reason, peer)
}

/// [`judge`] as a global function (exported by the linker, see build.rs):
/// the verifier checks it once per program, with its arguments unknown
/// (pointers it must test for null), where the pod programs inlined it at
/// each place a flow is judged and checked each copy in its caller's
/// states. The peer's address is in the scratch, where `packed` says
/// (see [`Peer`]). Returns the reason; the peer's identities go to the
/// scratch (`judged_peer`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn judge_flow(ep: *const EndpointInfo, packed: u64) -> u32 {
    // SAFETY: null or the caller's endpoint entry, valid for this program
    // run (the verifier holds every caller to its size).
    let Some(ep) = (unsafe { ep.as_ref() }) else {
        return Reason::DropPolicy as u32;
    };
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return Reason::DropPolicy as u32;
    };
    // SAFETY: fields of the per-CPU scratch value, ours for this program
    // run; the judgement writes only `tiers` and `judged_peer`.
    let peer_addr = unsafe {
        match ((packed >> 28) & 0xf) as u8 {
            AT_PACKET_SOURCE => &(*scratch).pkt.src,
            AT_PACKET_DESTINATION => &(*scratch).pkt.dst,
            AT_TRACKED_REMOTE => &(*scratch).ct.remote,
            _ => &(*scratch).judged_addr,
        }
    };
    let (reason, peer) = judge_inline(
        scratch,
        ep,
        packed as u8,
        (packed >> 8) as u8,
        peer_addr,
        (packed >> 16) as u8,
        (packed >> 32) as u16,
        (packed >> 48) as u16,
        (packed >> 24) & 1 != 0,
    );
    // SAFETY: as above.
    unsafe { (*scratch).judged_peer = peer };
    reason as u32
}

/// The body of [`judge`], with `judge_flow`'s scratch (fetched once).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn judge_inline(
    scratch: *mut Scratch,
    ep: &EndpointInfo,
    dir: u8,
    fam: u8,
    peer_addr: &[u8; 16],
    protocol: u8,
    port: u16,
    origin: u16,
    to_itself: bool,
) -> (Reason, IpcacheEntry) {
    // What the lookup finds is kept for the flow record: nothing yet.
    // SAFETY: the per-CPU scratch value, ours for this program run.
    unsafe { clear_tiers(&raw mut (*scratch).tiers) };
    let (mut peer, from_itself) = peer_of(ep, origin, fam, peer_addr);
    let itself = to_itself || from_itself;
    if itself && !ep.tiered(dir) {
        return (Reason::AllowSelf, peer);
    }
    let mut to_node = false;
    if peer.identity == identity::NODE {
        let encapsulated = encapsulation::is(protocol, port);
        if dir == direction::INGRESS || (!encapsulated && !ep.tiered(dir)) {
            return (Reason::AllowNode, peer);
        }
        to_node = !encapsulated;
        peer.identity = identity::ANY;
    }
    if !ep.judged(dir) {
        return (Reason::AllowNotIsolated, peer);
    }
    // An address in transit matches no rule; under tiers no match is not
    // a denial (the default allows), so it is refused outright.
    if ep.updating(dir) || (ep.tiered(dir) && peer.cidr_identity == identity::IN_TRANSIT) {
        return (Reason::DropUpdating, peer);
    }
    let bits = ep.lookups(dir);
    let packed = (u32::from(dir) << 24) | (u32::from(protocol) << 16) | u32::from(port);
    // The same three probe calls either way: a hit returns only for an
    // endpoint NetworkPolicy alone judges. The scratch fold is touched
    // only under tiers. The class is probed only if some entry names one.
    let tiered = ep.tiered(dir);
    let bits = if tiered { bits | FOLD_ALL } else { bits };
    if peer.identity != identity::ANY && probe_peer(ep.identity, peer.identity, packed, bits) != 0 {
        return (Reason::AllowPolicy, peer);
    }
    if bits & lookups::CLASS_PEER != 0
        && probe_peer(ep.identity, peer.cidr_identity, packed, bits) != 0
    {
        return (Reason::AllowPolicy, peer);
    }
    if bits & lookups::ANY_PEER != 0 && probe_peer(ep.identity, identity::ANY, packed, bits) != 0 {
        return (Reason::AllowPolicy, peer);
    }
    if !tiered {
        return (Reason::DropPolicy, peer);
    }
    // SAFETY: as above.
    let tiers = unsafe { (*scratch).tiers };
    let reason = tiers.decide(ep.isolated(dir));
    if matches!(reason, Reason::DropPolicy) {
        if to_node {
            return (Reason::AllowNode, peer);
        }
        if itself {
            return (Reason::AllowSelf, peer);
        }
    }
    (reason, peer)
}

/// A client's egress judged after DNAT against the `backend` it reached,
/// which may be the client itself (a Service hairpin; see [`judge`]).
#[inline(always)]
pub(super) fn judge_backend(
    ep: &EndpointInfo,
    fam: u8,
    backend: Peer<'_>,
    protocol: u8,
    port: u16,
) -> (Reason, IpcacheEntry) {
    let itself = ep.owns(fam, backend.addr);
    judge(
        ep,
        direction::EGRESS,
        fam,
        backend,
        protocol,
        port,
        ORIGIN_SOURCE,
        itself,
    )
}

/// Judges the parsed packet `pkt` (the scratch's) of `ep` in `dir` as a
/// new flow: its peer is the destination of what the pod sends, the
/// source of what reaches it.
#[inline(always)]
pub(super) fn judge_packet(
    ep: &EndpointInfo,
    dir: u8,
    pkt: &IpPacket,
    origin: u16,
) -> (Reason, IpcacheEntry) {
    let peer_addr = if dir == direction::EGRESS {
        Peer::packet_destination(pkt)
    } else {
        Peer::packet_source(pkt)
    };
    let port = proto::policy_port(pkt.protocol, pkt.dport);
    judge(
        ep,
        dir,
        pkt.family,
        peer_addr,
        pkt.protocol,
        port,
        origin,
        false,
    )
}
