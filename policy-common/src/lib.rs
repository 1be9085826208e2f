//! Layouts shared by the kernel classifier (`policy-ebpf`) and the agent.
//!
//! Every type here is `#[repr(C)]` with explicit padding fields and no
//! `bool`, so the byte image is identical on both sides and `bpftool map
//! dump` shows every field by name. Each struct has a compile-time size
//! assertion: changing one is a map layout change and needs a new
//! [`LAYOUT_VERSION`] (the pin directory carries it).
//!
//! With the `user` feature the crate also provides [`model`], a pure-Rust
//! re-statement of the kernel's lookup order that tests use as an oracle.
#![cfg_attr(not(feature = "user"), no_std)]

pub mod config;
pub mod conntrack;
pub mod conntrack_share;
pub mod endpoint;
pub mod event;
pub mod identity;
pub mod ipcache;
pub mod maps;
pub mod pod_range_guard;
pub mod policy;
pub mod rule_name;
pub mod service;
pub mod verdict;

#[cfg(feature = "user")]
pub mod model;

/// The map layout version. Pins live under `<pin root>/v{LAYOUT_VERSION}`, so
/// an agent never opens a map written with another layout.
pub const LAYOUT_VERSION: u32 = 4;

/// Direction of a packet relative to the local pod.
///
/// Host-veth egress delivers traffic to the pod (the pod's ingress);
/// host-veth ingress carries what the pod sends (the pod's egress).
pub mod direction {
    /// Traffic delivered to the pod: judged by the pod's ingress rules.
    pub const INGRESS: u8 = 0;
    /// Traffic sent by the pod: judged by the pod's egress rules.
    pub const EGRESS: u8 = 1;

    /// The other direction.
    #[inline(always)]
    pub const fn opposite(direction: u8) -> u8 {
        if direction == INGRESS {
            EGRESS
        } else {
            INGRESS
        }
    }

    /// "ingress" / "egress": the NetworkPolicy field and the name in logs.
    pub const fn name(direction: u8) -> &'static str {
        if direction == INGRESS {
            "ingress"
        } else {
            "egress"
        }
    }
}

/// IP protocol numbers the datapath distinguishes.
pub mod proto {
    /// In a policy key: any protocol (also: no L4 header known).
    pub const ANY: u8 = 0;
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const ICMPV6: u8 = 58;
    pub const SCTP: u8 = 132;

    /// Whether the protocol carries ports a policy can name (TCP, UDP,
    /// SCTP); for every other protocol the policy port is 0.
    #[inline(always)]
    pub const fn has_ports(protocol: u8) -> bool {
        protocol == TCP || protocol == UDP || protocol == SCTP
    }

    /// The destination port a policy judges: the packet's for protocols
    /// with ports, 0 otherwise.
    #[inline(always)]
    pub const fn policy_port(protocol: u8, port: u16) -> u16 {
        if has_ports(protocol) { port } else { 0 }
    }
}

/// ICMPv6 link control that passes without policy at a pod's ingress, as
/// RFC 4861 and 3810 have nodes send it: neighbour discovery (133-137)
/// only with hop limit 255 (so it cannot have been routed: the node itself
/// sent it, e.g. its unreachability probes to the pod's global address),
/// MLD (130-132, 143) only from a link-local or the unspecified source
/// with hop limit 1. Anything else of these types is judged as ordinary
/// ICMPv6.
#[inline(always)]
pub fn icmpv6_link_control(icmp_type: u8, src: &[u8; 16], hop_limit: u8) -> bool {
    match icmp_type {
        133..=137 => hop_limit == 255,
        130..=132 | 143 => hop_limit == 1 && (ipv6_link_local(src) || addr_eq(src, &[0; 16])),
        _ => false,
    }
}

/// The same link control at a pod's egress, where a hop limit proves
/// nothing (the node is about to forward the packet): it passes only
/// towards a destination that cannot leave the link ([`ipv6_link_scoped`]:
/// what the pod's own address resolution and unreachability detection
/// use), from the pod's own address (`own_src`), its link-local one or the
/// unspecified one (duplicate address detection). Anything else of these
/// types is judged as ordinary ICMPv6, after the source check.
#[inline(always)]
pub fn icmpv6_link_control_from_pod(
    icmp_type: u8,
    src: &[u8; 16],
    dst: &[u8; 16],
    hop_limit: u8,
    own_src: bool,
) -> bool {
    icmpv6_link_control(icmp_type, src, hop_limit)
        && ipv6_link_scoped(dst)
        && (own_src || ipv6_link_local(src) || addr_eq(src, &[0; 16]))
}

/// Whether an IPv6 address is link-local unicast (fe80::/10).
#[inline(always)]
pub fn ipv6_link_local(a: &[u8; 16]) -> bool {
    a[0] == 0xfe && a[1] & 0xc0 == 0x80
}

/// Whether an IPv6 destination cannot leave the link: link-local unicast
/// (fe80::/10), or multicast of interface- or link-local scope (ff01::/16,
/// ff02::/16: all-nodes, all-routers, solicited-node). A router forwards
/// neither.
#[inline(always)]
pub fn ipv6_link_scoped(a: &[u8; 16]) -> bool {
    ipv6_link_local(a) || (a[0] == 0xff && (a[1] & 0x0f) <= 2)
}

/// Encapsulations a node may decapsulate (IP-in-IP, IPv6-in-IPv4, GRE,
/// EtherIP, MPLS-in-IP; VXLAN on IANA's port and Linux's old default
/// (flannel's), GENEVE). A pod's packet of these to a node address is not
/// node traffic: decapsulated, its inner packet would travel on with a
/// source the pod chose.
pub mod encapsulation {
    use crate::proto;

    pub const IPIP: u8 = 4;
    pub const IPV6_IN_IP: u8 = 41;
    pub const GRE: u8 = 47;
    pub const ETHERIP: u8 = 97;
    pub const MPLS_IN_IP: u8 = 137;
    pub const VXLAN_PORT: u16 = 4789;
    pub const VXLAN_LINUX_PORT: u16 = 8472;
    pub const GENEVE_PORT: u16 = 6081;

    /// Whether a packet of `protocol` to destination port `dport` (0 for
    /// protocols without ports) is one of them.
    #[inline(always)]
    pub const fn is(protocol: u8, dport: u16) -> bool {
        match protocol {
            IPIP | IPV6_IN_IP | GRE | ETHERIP | MPLS_IN_IP => true,
            proto::UDP => matches!(dport, VXLAN_PORT | VXLAN_LINUX_PORT | GENEVE_PORT),
            _ => false,
        }
    }

    /// The same list for a renderer that matches them one by one (the
    /// iptables fallback): these protocols whatever the port, and UDP to
    /// these ports.
    pub const PROTOCOLS: [u8; 5] = [IPIP, IPV6_IN_IP, GRE, ETHERIP, MPLS_IN_IP];
    pub const UDP_PORTS: [u16; 3] = [VXLAN_PORT, VXLAN_LINUX_PORT, GENEVE_PORT];

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_lists_say_what_is_says() {
            for protocol in 0..=u8::MAX {
                for dport in [0, 1, 53, VXLAN_PORT, VXLAN_LINUX_PORT, GENEVE_PORT, 65535] {
                    let listed = PROTOCOLS.contains(&protocol)
                        || (protocol == proto::UDP && UDP_PORTS.contains(&dport));
                    assert_eq!(is(protocol, dport), listed, "{protocol}/{dport}");
                }
            }
        }
    }
}

/// Address family tags used in conntrack keys and events.
pub mod family {
    pub const IPV4: u8 = 4;
    pub const IPV6: u8 = 6;
}

/// Compares two 16-byte address fields in two words (a byte-array `==`
/// could lower to a memcmp call, which BPF lacks).
#[inline(always)]
pub fn addr_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let a0 = u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
    let a1 = u64::from_ne_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]);
    let b0 = u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let b1 = u64::from_ne_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
    a0 == b0 && a1 == b1
}

/// Implements `aya::Pod` for shared types when building userspace.
#[cfg(feature = "user")]
macro_rules! user_pod {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: the type is #[repr(C)], Copy, and has no implicit padding
            // (bytemuck's derive proves it at compile time).
            unsafe impl aya::Pod for $t {}
        )*
    };
}
#[cfg(feature = "user")]
pub(crate) use user_pod;

/// Asserts a layout's size at compile time.
macro_rules! assert_size {
    ($t:ty, $n:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $n);
    };
}
pub(crate) use assert_size;
