//! Crafted Ethernet frames for BPF_PROG_TEST_RUN (tests and benchmarks),
//! and IP packets for raw sockets.
//!
//! The IPv4 header checksum is filled: a kernel drops a packet without
//! one, and the packet inside an encapsulation reaches the kernel as if
//! from the wire when a tunnel device takes it out. Transport checksums
//! are left zero: the classifier never reads them, and a capture sees a
//! packet before the receiver's transport layer checks them.
use std::net::IpAddr;

use policy_common::proto;

/// The transport part of a crafted packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        flags: u8,
    },
    Udp {
        sport: u16,
        dport: u16,
    },
    Sctp {
        sport: u16,
        dport: u16,
    },
    /// ICMP or ICMPv6 echo (request, or reply when `reply`).
    Echo {
        id: u16,
        reply: bool,
    },
    /// ICMP/ICMPv6 destination unreachable quoting `quoted`.
    Unreachable {
        quoted: Box<Packet>,
    },
    /// Any ICMP/ICMPv6 type with an empty body (e.g. ND types).
    Icmp {
        kind: u8,
    },
    /// `inner` carried as a node decapsulates it: IP-in-IP (protocol 4 for
    /// an IPv4 inner packet, 41 for IPv6) or GRE (47).
    Tunnel {
        gre: bool,
        inner: Box<Packet>,
    },
    /// `inner` as an Ethernet frame in VXLAN (UDP to `dport`, VNI `vni`).
    Vxlan {
        sport: u16,
        dport: u16,
        vni: u32,
        inner: Box<Packet>,
    },
}

/// Fragmentation of the IP packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment {
    pub id: u32,
    /// Offset in 8-byte units.
    pub offset: u16,
    pub more: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub l4: L4,
    pub fragment: Option<Fragment>,
    /// IPv4 option bytes (a multiple of 4, at most 40).
    pub ipv4_options: Vec<u8>,
    /// IPv6: number of empty destination-options headers before L4 (and
    /// before a Fragment header).
    pub ipv6_ext_headers: usize,
    /// IPv6: destination-options headers after the Fragment header.
    pub ipv6_ext_after_fragment: usize,
    /// IPv4 TTL / IPv6 hop limit.
    pub hop_limit: u8,
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

impl Packet {
    pub fn new(src: IpAddr, dst: IpAddr, l4: L4) -> Self {
        Self {
            src,
            dst,
            l4,
            fragment: None,
            ipv4_options: Vec::new(),
            ipv6_ext_headers: 0,
            ipv6_ext_after_fragment: 0,
            hop_limit: 64,
        }
    }

    pub fn tcp(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, flags: u8) -> Self {
        Self::new(
            src,
            dst,
            L4::Tcp {
                sport,
                dport,
                flags,
            },
        )
    }

    pub fn udp(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Self {
        Self::new(src, dst, L4::Udp { sport, dport })
    }

    pub fn protocol(&self) -> u8 {
        let v6 = self.src.is_ipv6();
        match &self.l4 {
            L4::Tcp { .. } => proto::TCP,
            L4::Udp { .. } | L4::Vxlan { .. } => proto::UDP,
            L4::Tunnel { gre: true, .. } => 47,
            L4::Tunnel { inner, .. } if inner.src.is_ipv6() => 41,
            L4::Tunnel { .. } => 4,
            L4::Sctp { .. } => proto::SCTP,
            L4::Echo { .. } | L4::Unreachable { .. } | L4::Icmp { .. } if v6 => proto::ICMPV6,
            L4::Echo { .. } | L4::Unreachable { .. } | L4::Icmp { .. } => proto::ICMP,
        }
    }

    /// The ICMP/ICMPv6 type (0 for other protocols).
    pub fn icmp_type(&self) -> u8 {
        let v6 = self.src.is_ipv6();
        match &self.l4 {
            L4::Echo { reply: false, .. } if v6 => 128,
            L4::Echo { reply: true, .. } if v6 => 129,
            L4::Echo { reply: false, .. } => 8,
            L4::Echo { reply: true, .. } => 0,
            L4::Unreachable { .. } if v6 => 1,
            L4::Unreachable { .. } => 3,
            L4::Icmp { kind } => *kind,
            L4::Tcp { .. }
            | L4::Udp { .. }
            | L4::Sctp { .. }
            | L4::Tunnel { .. }
            | L4::Vxlan { .. } => 0,
        }
    }

    /// The transport ports a policy sees (0 for protocols without them;
    /// an ICMP echo's identifier in both).
    pub fn ports(&self) -> (u16, u16) {
        match &self.l4 {
            L4::Tcp { sport, dport, .. }
            | L4::Udp { sport, dport }
            | L4::Sctp { sport, dport }
            | L4::Vxlan { sport, dport, .. } => (*sport, *dport),
            L4::Echo { id, .. } => (*id, *id),
            L4::Unreachable { .. } | L4::Icmp { .. } | L4::Tunnel { .. } => (0, 0),
        }
    }

    /// The transport bytes.
    fn l4_bytes(&self) -> Vec<u8> {
        let v6 = self.src.is_ipv6();
        match &self.l4 {
            L4::Tcp {
                sport,
                dport,
                flags,
            } => {
                let mut b = vec![0u8; 20];
                b[0..2].copy_from_slice(&sport.to_be_bytes());
                b[2..4].copy_from_slice(&dport.to_be_bytes());
                b[12] = 5 << 4;
                b[13] = *flags;
                b[14..16].copy_from_slice(&64240u16.to_be_bytes());
                b
            }
            L4::Udp { sport, dport } => {
                let mut b = vec![0u8; 8];
                b[0..2].copy_from_slice(&sport.to_be_bytes());
                b[2..4].copy_from_slice(&dport.to_be_bytes());
                b[4..6].copy_from_slice(&8u16.to_be_bytes());
                b
            }
            L4::Sctp { sport, dport } => {
                // Common header (12 bytes) + an INIT chunk header.
                let mut b = vec![0u8; 16];
                b[0..2].copy_from_slice(&sport.to_be_bytes());
                b[2..4].copy_from_slice(&dport.to_be_bytes());
                b[12] = 1;
                b[14..16].copy_from_slice(&4u16.to_be_bytes());
                b
            }
            L4::Echo { id, .. } => {
                let mut b = vec![self.icmp_type(), 0, 0, 0];
                b.extend_from_slice(&id.to_be_bytes());
                b.extend_from_slice(&1u16.to_be_bytes());
                b
            }
            L4::Unreachable { quoted } => {
                let mut b = vec![self.icmp_type(), if v6 { 4 } else { 3 }, 0, 0, 0, 0, 0, 0];
                let inner = quoted.ip_bytes();
                b.extend_from_slice(&inner[..inner.len().min(if v6 { 40 + 8 } else { 28 })]);
                b
            }
            L4::Icmp { kind } => vec![*kind, 0, 0, 0, 0, 0, 0, 0],
            L4::Tunnel { gre: false, inner } => inner.ip_bytes(),
            L4::Tunnel { gre: true, inner } => {
                // No checksum, key or sequence: flags and version 0.
                let ether_type: u16 = if inner.src.is_ipv6() { 0x86dd } else { 0x0800 };
                let mut b = vec![0, 0];
                b.extend_from_slice(&ether_type.to_be_bytes());
                b.extend_from_slice(&inner.ip_bytes());
                b
            }
            L4::Vxlan {
                sport,
                dport,
                vni,
                inner,
            } => {
                let frame = inner.frame();
                let mut b = vec![0u8; 16];
                b[0..2].copy_from_slice(&sport.to_be_bytes());
                b[2..4].copy_from_slice(&dport.to_be_bytes());
                b[4..6].copy_from_slice(&((16 + frame.len()) as u16).to_be_bytes());
                // VXLAN: the I flag, the VNI in bytes 4..7.
                b[8] = 0x08;
                b[12..15].copy_from_slice(&vni.to_be_bytes()[1..]);
                b.extend_from_slice(&frame);
                b
            }
        }
    }

    /// The IP packet (no Ethernet header).
    pub fn ip_bytes(&self) -> Vec<u8> {
        let l4 = match self.fragment {
            Some(f) if f.offset != 0 => vec![0u8; 16],
            _ => self.l4_bytes(),
        };
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let hlen = 20 + self.ipv4_options.len();
                let mut b = vec![0u8; hlen];
                b[0] = 0x40 | (hlen / 4) as u8;
                let total = (hlen + l4.len()) as u16;
                b[2..4].copy_from_slice(&total.to_be_bytes());
                let mut frag = 0u16;
                if let Some(f) = self.fragment {
                    b[4..6].copy_from_slice(&(f.id as u16).to_be_bytes());
                    frag = (f.offset & 0x1fff) | if f.more { 0x2000 } else { 0 };
                }
                b[6..8].copy_from_slice(&frag.to_be_bytes());
                b[8] = self.hop_limit;
                b[9] = self.protocol();
                b[12..16].copy_from_slice(&s.octets());
                b[16..20].copy_from_slice(&d.octets());
                b[20..].copy_from_slice(&self.ipv4_options);
                let checksum = ipv4_header_checksum(&b);
                b[10..12].copy_from_slice(&checksum.to_be_bytes());
                b.extend_from_slice(&l4);
                b
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut ext = Vec::new();
                let mut chain: Vec<u8> = vec![60; self.ipv6_ext_headers];
                if self.fragment.is_some() {
                    chain.push(44);
                    chain.extend(std::iter::repeat_n(60, self.ipv6_ext_after_fragment));
                }
                let mut next_after = chain.iter().skip(1).copied().collect::<Vec<_>>();
                next_after.push(self.protocol());
                // A later fragment carries no headers of the fragmentable
                // part: its Fragment header still names the first of them.
                if self.fragment.is_some_and(|f| f.offset != 0) {
                    chain.truncate(self.ipv6_ext_headers + 1);
                }
                for (i, kind) in chain.iter().enumerate() {
                    let next = next_after[i];
                    if *kind == 44 {
                        let f = self.fragment.unwrap_or(Fragment {
                            id: 0,
                            offset: 0,
                            more: false,
                        });
                        let field = (f.offset << 3) | u16::from(f.more);
                        ext.push(next);
                        ext.push(0);
                        ext.extend_from_slice(&field.to_be_bytes());
                        ext.extend_from_slice(&f.id.to_be_bytes());
                    } else {
                        ext.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
                    }
                }
                let first = chain.first().copied().unwrap_or(self.protocol());
                let mut b = vec![0u8; 40];
                b[0] = 0x60;
                let payload = (ext.len() + l4.len()) as u16;
                b[4..6].copy_from_slice(&payload.to_be_bytes());
                b[6] = first;
                b[7] = self.hop_limit;
                b[8..24].copy_from_slice(&s.octets());
                b[24..40].copy_from_slice(&d.octets());
                b.extend_from_slice(&ext);
                b.extend_from_slice(&l4);
                b
            }
            _ => Vec::new(),
        }
    }

    /// The Ethernet frame.
    pub fn frame(&self) -> Vec<u8> {
        let ether_type: u16 = if self.src.is_ipv6() { 0x86dd } else { 0x0800 };
        ethernet(ether_type, &self.ip_bytes())
    }
}

/// The destination MAC address of every crafted frame (a device that
/// takes a frame out of a VXLAN packet must have it to take the frame as
/// its own).
pub const FRAME_DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
/// The source MAC address of every crafted frame.
pub const FRAME_SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

/// The Internet checksum of an IPv4 header whose checksum field is zero.
fn ipv4_header_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet frame around `payload`.
pub fn ethernet(ether_type: u16, payload: &[u8]) -> Vec<u8> {
    let mut b = FRAME_DST_MAC.to_vec();
    b.extend_from_slice(&FRAME_SRC_MAC);
    b.extend_from_slice(&ether_type.to_be_bytes());
    b.extend_from_slice(payload);
    b
}
