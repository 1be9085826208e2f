//! Header walk: Ethernet (none on a device without a link-layer header),
//! IPv4 (with options) or IPv6 (with a bounded walk over extension
//! headers), then the first bytes of TCP/UDP/SCTP/ICMP.
//!
//! Every read is bounds-checked against `data_end`. Explicit outcomes:
//! - not IPv4/IPv6 (ARP, LLDP, ...) → [`NOT_IP`], passed;
//! - 802.1Q/802.1ad tagged frames, a bad version/IHL, a truncated IP or L4
//!   header, or more than [`MAX_V6_EXT_HEADERS`] IPv6 extension headers →
//!   [`MALFORMED`], dropped (they cannot be judged, and a pod has no
//!   business sending them on a routed veth);
//! - a non-first fragment carries no L4 header: `frag == FRAG_LATER`, the
//!   classifier judges it by its first fragment.
//!
//! Headers that are not in the skb's linear area (a pod can send them
//! that way) are pulled in first, up to [`PULL_LEN`] bytes: a header beyond
//! that is malformed, not a reason to pass.
use aya_ebpf::programs::TcContext;
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use policy_common::{conntrack::CtKey, family, proto};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

/// IPv6 extension headers walked; one more is dropped as malformed.
pub const MAX_V6_EXT_HEADERS: usize = 6;

/// Bytes made linear before parsing when the skb's linear area is shorter:
/// Ethernet, IPv6 and its extension headers, the L4 header, and an ICMP
/// error's quoted headers fit in it.
pub const PULL_LEN: u32 = 512;

const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;

/// ICMP errors quoting a header further in than this are judged as plain
/// ICMP (no Ethernet + IP + ICMP header stack reaches it in practice).
const MAX_QUOTED_OFFSET: usize = 1024;

pub const FRAG_NONE: u8 = 0;
/// First fragment of a fragmented datagram (offset 0, more fragments).
pub const FRAG_FIRST: u8 = 1;
/// A later fragment: no L4 header.
pub const FRAG_LATER: u8 = 2;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpPacket {
    pub family: u8,
    pub protocol: u8,
    pub frag: u8,
    pub tcp_flags: u8,
    pub frag_id: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// Host order. ICMP echo: the identifier in both.
    pub sport: u16,
    pub dport: u16,
    /// ICMP/ICMPv6 type (0 otherwise).
    pub icmp_type: u8,
    /// IPv4 TTL / IPv6 hop limit.
    pub hop_limit: u8,
    /// The protocol fragments of this datagram are keyed by: the IPv4
    /// protocol, or the IPv6 Fragment header's next header (the same in
    /// every fragment, unlike the final L4 protocol of the first).
    pub frag_proto: u8,
    /// For ICMP errors: offset of the quoted IP header (0: none).
    pub quoted_off: u16,
}

/// Outcomes of [`parse`]: the packet is in the scratch buffer for `IP`.
pub type Parsed = u8;
pub const IP: Parsed = 0;
pub const NOT_IP: Parsed = 1;
pub const MALFORMED: Parsed = 2;

#[inline(always)]
fn ptr_at<T>(ctx: &TcContext, offset: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + core::mem::size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *const T)
}

#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    // SAFETY: ptr_at checked that size_of::<T>() bytes lie inside the packet;
    // the header types are byte arrays, so alignment 1 is enough.
    ptr_at::<T>(ctx, offset).map(|p| unsafe { core::ptr::read_unaligned(p) })
}

#[inline(always)]
fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// An IPv4 address into the 16 bytes every address takes, the rest zero,
/// as four word stores: built as an array, LLVM zeroed the twelve bytes
/// with a call to `memset`, a byte loop, on every IPv4 packet.
///
/// # Safety
/// `to` is valid for writes and 4-aligned (the address fields of
/// [`IpPacket`] and `CtKey` are: checked below).
#[inline(always)]
unsafe fn put_v4(to: *mut [u8; 16], a: [u8; 4]) {
    use core::ptr::write_volatile;
    let w = to.cast::<u32>();
    // SAFETY: the caller's promise; each store within the 16 bytes.
    unsafe {
        write_volatile(w, u32::from_ne_bytes(a));
        write_volatile(w.add(1), 0);
        write_volatile(w.add(2), 0);
        write_volatile(w.add(3), 0);
    }
}

const _: () = {
    use core::mem::{align_of, offset_of};
    assert!(align_of::<IpPacket>() >= 4 && align_of::<CtKey>() >= 4);
    assert!(offset_of!(IpPacket, src) % 4 == 0 && offset_of!(IpPacket, dst) % 4 == 0);
    assert!(offset_of!(CtKey, local) % 4 == 0 && offset_of!(CtKey, remote) % 4 == 0);
};

/// First 4 bytes of TCP/UDP/SCTP: source and destination port.
#[derive(Clone, Copy)]
#[repr(C)]
struct Ports {
    src: [u8; 2],
    dst: [u8; 2],
}

/// First 8 bytes of ICMP/ICMPv6.
#[derive(Clone, Copy)]
#[repr(C)]
struct IcmpHdr {
    kind: u8,
    code: u8,
    _csum: [u8; 2],
    id: [u8; 2],
    _seq: [u8; 2],
}

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_ECHO: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROB: u8 = 12;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PARAM_PROB: u8 = 4;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;

/// Makes the headers linear (see [`PULL_LEN`]).
#[inline(always)]
fn pull(ctx: &TcContext) {
    let linear = (ctx.data_end() - ctx.data()) as u32;
    let len = ctx.len();
    if linear < len && linear < PULL_LEN {
        // A failed pull leaves the headers short: they parse as malformed.
        let _ = ctx.pull_data(if len < PULL_LEN { len } else { PULL_LEN });
    }
}

/// Parses a packet of a device with a link-layer header (`L3` false:
/// Ethernet) or without one (`L3` true: IP-in-IP, GRE, sit, WireGuard,
/// tun, where the packet starts with its IP header and the version nibble
/// says the family) into `pkt`.
#[inline(always)]
pub fn parse_at<const L3: bool>(ctx: &TcContext, pkt: &mut IpPacket) -> Parsed {
    if !L3 {
        return parse(ctx, pkt);
    }
    pull(ctx);
    // Twenty bytes, the shortest IP header: a one-byte bounds check
    // compiles to a comparison the verifier cannot use.
    let Some(head) = read::<[u8; 20]>(ctx, 0) else {
        return MALFORMED;
    };
    match head[0] >> 4 {
        4 => parse_v4(ctx, 0, pkt),
        6 => parse_v6(ctx, 0, pkt),
        _ => MALFORMED,
    }
}

/// Parses an Ethernet frame into `pkt` (a per-CPU scratch buffer: the BPF
/// stack is small).
pub fn parse(ctx: &TcContext, pkt: &mut IpPacket) -> Parsed {
    pull(ctx);
    let Some(eth) = read::<EthHdr>(ctx, 0) else {
        return MALFORMED;
    };
    // The ether_type field is a raw big-endian u16 in network-types 0.2.
    let ether_type = u16::from_be(eth.ether_type);
    match ether_type {
        ETH_P_IP => parse_v4(ctx, EthHdr::LEN, pkt),
        ETH_P_IPV6 => parse_v6(ctx, EthHdr::LEN, pkt),
        ETH_P_8021Q | ETH_P_8021AD => MALFORMED,
        _ => NOT_IP,
    }
}

/// Every field but the addresses, for a packet of `family`: one store
/// each (together LLVM made the zeroes a call to `memset`).
#[inline(always)]
fn reset(pkt: &mut IpPacket, family: u8) {
    use core::ptr::write_volatile;
    // SAFETY: fields of a valid, exclusive `IpPacket`.
    unsafe {
        write_volatile(&raw mut pkt.family, family);
        write_volatile(&raw mut pkt.protocol, 0);
        write_volatile(&raw mut pkt.frag, FRAG_NONE);
        write_volatile(&raw mut pkt.tcp_flags, 0);
        write_volatile(&raw mut pkt.frag_id, 0);
        write_volatile(&raw mut pkt.sport, 0);
        write_volatile(&raw mut pkt.dport, 0);
        write_volatile(&raw mut pkt.icmp_type, 0);
        write_volatile(&raw mut pkt.hop_limit, 0);
        write_volatile(&raw mut pkt.frag_proto, 0);
        write_volatile(&raw mut pkt.quoted_off, 0);
    }
}

fn parse_v4(ctx: &TcContext, off: usize, pkt: &mut IpPacket) -> Parsed {
    let Some(ip) = read::<Ipv4Hdr>(ctx, off) else {
        return MALFORMED;
    };
    let ihl = (ip.vihl & 0x0f) as usize;
    if ip.vihl >> 4 != 4 || ihl < 5 {
        return MALFORMED;
    }
    let l4 = off + ihl * 4;
    // Options must be inside the packet too.
    if ctx.data() + l4 > ctx.data_end() {
        return MALFORMED;
    }
    reset(pkt, family::IPV4);
    // SAFETY: the packet's address fields (4-aligned, see `put_v4`).
    unsafe {
        put_v4(&raw mut pkt.src, ip.src_addr);
        put_v4(&raw mut pkt.dst, ip.dst_addr);
    }
    pkt.protocol = ip.proto;
    pkt.frag_proto = ip.proto;
    pkt.hop_limit = ip.ttl;
    let frags = be16(ip.frags);
    let offset = frags & 0x1fff;
    let more = frags & 0x2000 != 0;
    pkt.frag_id = be16(ip.id) as u32;
    if offset != 0 {
        pkt.frag = FRAG_LATER;
        return IP;
    }
    if more {
        pkt.frag = FRAG_FIRST;
    }
    parse_l4(ctx, l4, pkt)
}

fn parse_v6(ctx: &TcContext, off: usize, pkt: &mut IpPacket) -> Parsed {
    let Some(ip) = read::<Ipv6Hdr>(ctx, off) else {
        return MALFORMED;
    };
    if ip.vcf[0] >> 4 != 6 {
        return MALFORMED;
    }
    reset(pkt, family::IPV6);
    pkt.src = ip.src_addr;
    pkt.dst = ip.dst_addr;
    pkt.hop_limit = ip.hop_limit;
    let mut next = ip.next_hdr;
    let mut l4 = off + Ipv6Hdr::LEN;
    let mut i = 0;
    // One slot per extension header, and one for the final header.
    while i < MAX_V6_EXT_HEADERS + 1 {
        i += 1;
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let Some(h) = read::<[u8; 2]>(ctx, l4) else {
                    return MALFORMED;
                };
                next = h[0];
                l4 += (h[1] as usize + 1) * 8;
            }
            IPPROTO_AH => {
                let Some(h) = read::<[u8; 2]>(ctx, l4) else {
                    return MALFORMED;
                };
                next = h[0];
                l4 += (h[1] as usize + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                let Some(h) = read::<[u8; 8]>(ctx, l4) else {
                    return MALFORMED;
                };
                next = h[0];
                pkt.frag_proto = next;
                l4 += 8;
                let field = u16::from_be_bytes([h[2], h[3]]);
                pkt.frag_id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                if field & 0xfff8 != 0 {
                    pkt.protocol = next;
                    pkt.frag = FRAG_LATER;
                    return IP;
                }
                if field & 1 != 0 {
                    pkt.frag = FRAG_FIRST;
                }
            }
            _ => {
                pkt.protocol = next;
                return parse_l4(ctx, l4, pkt);
            }
        }
    }
    MALFORMED
}

fn parse_l4(ctx: &TcContext, l4: usize, pkt: &mut IpPacket) -> Parsed {
    match pkt.protocol {
        proto::TCP => {
            // The fixed 20-byte header: ports plus the flags at byte 13.
            let Some(h) = read::<[u8; 20]>(ctx, l4) else {
                return MALFORMED;
            };
            pkt.sport = u16::from_be_bytes([h[0], h[1]]);
            pkt.dport = u16::from_be_bytes([h[2], h[3]]);
            pkt.tcp_flags = h[13];
        }
        proto::UDP | proto::SCTP => {
            // UDP's header is 8 bytes, SCTP's common header 12.
            let need_sctp = pkt.protocol == proto::SCTP;
            let ok = if need_sctp {
                ptr_at::<[u8; 12]>(ctx, l4).is_some()
            } else {
                ptr_at::<[u8; 8]>(ctx, l4).is_some()
            };
            let Some(p) = read::<Ports>(ctx, l4) else {
                return MALFORMED;
            };
            if !ok {
                return MALFORMED;
            }
            pkt.sport = be16(p.src);
            pkt.dport = be16(p.dst);
        }
        proto::ICMP | proto::ICMPV6 => {
            let Some(h) = read::<IcmpHdr>(ctx, l4) else {
                return MALFORMED;
            };
            pkt.icmp_type = h.kind;
            let v6 = pkt.protocol == proto::ICMPV6;
            let echo = if v6 {
                h.kind == ICMPV6_ECHO_REQUEST || h.kind == ICMPV6_ECHO_REPLY
            } else {
                h.kind == ICMP_ECHO || h.kind == ICMP_ECHO_REPLY
            };
            let error = if v6 {
                (ICMPV6_DEST_UNREACH..=ICMPV6_PARAM_PROB).contains(&h.kind)
            } else {
                h.kind == ICMP_DEST_UNREACH
                    || h.kind == ICMP_TIME_EXCEEDED
                    || h.kind == ICMP_PARAMETER_PROB
            };
            if echo {
                let id = be16(h.id);
                pkt.sport = id;
                pkt.dport = id;
            } else if error {
                pkt.quoted_off = (l4 + 8) as u16;
            }
        }
        _ => {}
    }
    IP
}

/// Reads the header an ICMP error quotes into `key` (the flow it is
/// about, as the quoted packet travelled: `local` its source, `remote`
/// its destination; the caller turns it to the pod's side). `None` if it
/// cannot be read:
/// the error is then judged as an ordinary ICMP packet.
pub fn quoted_flow(ctx: &TcContext, off: usize, v6: bool, key: &mut CtKey) -> Option<()> {
    // A bound the verifier can see; real quoted headers start far earlier.
    if off > MAX_QUOTED_OFFSET {
        return None;
    }
    let l4;
    if v6 {
        let ip = read::<Ipv6Hdr>(ctx, off)?;
        key.local = ip.src_addr;
        key.remote = ip.dst_addr;
        key.protocol = ip.next_hdr;
        l4 = off + Ipv6Hdr::LEN;
    } else {
        let ip = read::<Ipv4Hdr>(ctx, off)?;
        let ihl = (ip.vihl & 0x0f) as usize;
        if ihl < 5 {
            return None;
        }
        // SAFETY: the key's address fields (4-aligned, see `put_v4`).
        unsafe {
            put_v4(&raw mut key.local, ip.src_addr);
            put_v4(&raw mut key.remote, ip.dst_addr);
        }
        key.protocol = ip.proto;
        l4 = off + ihl * 4;
    }
    match key.protocol {
        proto::TCP | proto::UDP | proto::SCTP => {
            let p = read::<Ports>(ctx, l4)?;
            key.local_port = be16(p.src);
            key.remote_port = be16(p.dst);
        }
        proto::ICMP | proto::ICMPV6 => {
            let h = read::<IcmpHdr>(ctx, l4)?;
            let id = be16(h.id);
            key.local_port = id;
            key.remote_port = id;
        }
        _ => {
            key.local_port = 0;
            key.remote_port = 0;
        }
    }
    Some(())
}
