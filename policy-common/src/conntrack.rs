//! Connection tracking: lets replies of allowed flows through and lets an
//! established flow skip the policy lookups.
use crate::assert_size;

/// Key of `CONNTRACK`: one flow at one host-side interface, named from
/// the pod's side: its `local` address and port, the peer's `remote` ones.
/// Both directions of a flow thus share one key (what the pod sends:
/// source local, destination remote; what reaches it: the other way
/// round), so a packet of either direction costs one lookup, and the
/// value says which way the flow was opened ([`CtEntry::direction`]): a
/// packet going the same way continues it, one going the other way
/// answers it.
///
/// The ifindex is part of the key because one pod-to-pod flow on a node
/// crosses two interfaces, each judged by its own pod's policy; an entry
/// made at one must never admit traffic at the other. IPv4 addresses use
/// the first 4 bytes, the rest zero. Ports are host order; ICMP echo uses
/// the identifier as both ports, and only echo keeps its opener's
/// direction in the key (`opener`): a request continues only the flow it
/// opened and a reply answers only a request (see [`ct_lookups`]), so the
/// two roles must not meet under one key. Every other protocol has
/// [`CT_OPENER_EITHER`] there.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtKey {
    pub ifindex: u32,
    /// The pod's side: the source of what it sends.
    pub local: [u8; 16],
    /// The peer's side.
    pub remote: [u8; 16],
    pub local_port: u16,
    pub remote_port: u16,
    pub protocol: u8,
    /// [`crate::family`].
    pub family: u8,
    /// ICMP echo: the [`crate::direction`] its request travelled;
    /// [`CT_OPENER_EITHER`] for every other protocol.
    pub opener: u8,
    pub _pad: u8,
}
assert_size!(CtKey, 44);

/// [`CtKey::opener`] of every flow but ICMP echo: one key for both ways.
pub const CT_OPENER_EITHER: u8 = 0xff;

/// [`CtKey::opener`] for a packet of `protocol` travelling `dir` that
/// opens a flow (`opening`) or looks one up in the role [`ct_lookups`]
/// gives it: an echo reply looks for the request that went the other way.
#[inline(always)]
pub const fn ct_opener(protocol: u8, icmp_type: u8, dir: u8, opening: bool) -> u8 {
    if !matches!(protocol, crate::proto::ICMP | crate::proto::ICMPV6) {
        return CT_OPENER_EITHER;
    }
    if !opening && ct_lookups(protocol, icmp_type) == CT_LOOKUP_REPLY {
        crate::direction::opposite(dir)
    } else {
        dir
    }
}

impl CtKey {
    /// The opener's tuple as its first packet travelled: (source, its
    /// port, destination, its port), given the entry's `direction`.
    #[inline(always)]
    pub const fn as_opened(&self, direction: u8) -> ([u8; 16], u16, [u8; 16], u16) {
        if direction == crate::direction::EGRESS {
            (self.local, self.local_port, self.remote, self.remote_port)
        } else {
            (self.remote, self.remote_port, self.local, self.local_port)
        }
    }
}

/// [`ct_lookups`]: the packet may continue a flow as it was opened.
pub const CT_LOOKUP_FORWARD: u8 = 1 << 0;
/// [`ct_lookups`]: the packet may answer a flow opened from the other side.
pub const CT_LOOKUP_REPLY: u8 = 1 << 1;

/// Which conntrack lookups a packet may hit (and whether it may open an
/// entry: any lookup at all). ICMP echo is tracked by its identifier
/// alone, so its type decides the role: a request only continues its own
/// flow and a reply only answers a request. Otherwise a request from the
/// far side that happens to use the same identifier would pass as a reply
/// without being judged. Other ICMP is never tracked: errors are judged as
/// related to the flow they quote, and any other message is judged on its
/// own (an entry keyed 0/0 would let the peer send every kind back).
#[inline(always)]
pub const fn ct_lookups(protocol: u8, icmp_type: u8) -> u8 {
    const ICMP_ECHO_REPLY: u8 = 0;
    const ICMP_ECHO: u8 = 8;
    const ICMPV6_ECHO_REQUEST: u8 = 128;
    const ICMPV6_ECHO_REPLY: u8 = 129;
    match (protocol, icmp_type) {
        (crate::proto::ICMP, ICMP_ECHO) | (crate::proto::ICMPV6, ICMPV6_ECHO_REQUEST) => {
            CT_LOOKUP_FORWARD
        }
        (crate::proto::ICMP, ICMP_ECHO_REPLY) | (crate::proto::ICMPV6, ICMPV6_ECHO_REPLY) => {
            CT_LOOKUP_REPLY
        }
        (crate::proto::ICMP | crate::proto::ICMPV6, _) => 0,
        _ => CT_LOOKUP_FORWARD | CT_LOOKUP_REPLY,
    }
}

/// A TCP FIN or RST was seen: the entry expires after [`CT_CLOSING_TIMEOUT_NS`].
pub const CT_FLAG_CLOSING: u8 = 1 << 0;
/// Only a SYN has been seen so far.
pub const CT_FLAG_SYN_ONLY: u8 = 1 << 1;
/// A flow to a Service frontend: its egress is judged after DNAT, where
/// the backend is known (see [`crate::service`]).
pub const CT_FLAG_SERVICE: u8 = 1 << 2;
/// Of a service flow: not judged yet (the verdict after DNAT has not come
/// back, or the revision moved and the backend is unknown here).
pub const CT_FLAG_PENDING: u8 = 1 << 3;

/// Established TCP lifetime without traffic.
pub const CT_TCP_TIMEOUT_NS: u64 = 6 * 3600 * 1_000_000_000;
/// TCP lifetime after FIN/RST, and of a half-open (SYN only) flow.
pub const CT_CLOSING_TIMEOUT_NS: u64 = 10 * 1_000_000_000;
pub const CT_SYN_TIMEOUT_NS: u64 = 60 * 1_000_000_000;
/// UDP, ICMP, SCTP and other protocols.
pub const CT_OTHER_TIMEOUT_NS: u64 = 60 * 1_000_000_000;
/// `last_seen_ns` is refreshed at most this often, to spare cache lines.
pub const CT_REFRESH_NS: u64 = 1_000_000_000;
/// How far a reader's clock may run behind a stamp written on the same
/// clock: the agent reads its clock before a sweep, and the classifier
/// reuses a CPU's reading within a tick (a tick is 1-10 ms).
pub const CLOCK_LAG_NS: u64 = 1_000_000_000;

/// How long ago `stamp` was at `now`, both on the coarse clock: 0 for a
/// stamp up to [`CLOCK_LAG_NS`] ahead of `now` (written by a reader a
/// tick ahead), `u64::MAX` for one further ahead (a time the clock has
/// not reached: no such stamp is trusted).
#[inline(always)]
pub const fn age_ns(now: u64, stamp: u64) -> u64 {
    if now >= stamp {
        now - stamp
    } else if stamp - now <= CLOCK_LAG_NS {
        0
    } else {
        u64::MAX
    }
}

/// Value of `CONNTRACK`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtEntry {
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC at tick resolution: the
    /// timeouts are seconds, and the fine clock costs a clocksource read
    /// per packet) of the last refresh.
    pub last_seen_ns: u64,
    /// The endpoint revision the flow was last judged under.
    pub revision: u32,
    /// [`crate::direction`] of the packet that opened the flow: a packet
    /// travelling this way continues it, one travelling the other way
    /// answers it (see [`CtKey`]).
    pub direction: u8,
    /// `CT_FLAG_*`.
    pub flags: u8,
    /// Who the flow's peer is, when it was opened towards the pod
    /// ([`ORIGIN_SOURCE`], [`ORIGIN_FORWARDED`], or the local pod
    /// interface it came from): a flow is judged again as it was first.
    pub origin: u16,
}
assert_size!(CtEntry, 16);

/// [`CtEntry::origin`]: the peer is the packet's address (every flow a pod
/// opens, and what the node itself sends to a pod).
pub const ORIGIN_SOURCE: u16 = 0;
/// [`CtEntry::origin`]: the flow entered the node at an interface that is
/// no local pod's (an uplink, a tunnel): its peer is its address, but a
/// node address does not make it node traffic (the node only forwarded
/// it, after masquerading it or not).
pub const ORIGIN_FORWARDED: u16 = 0xffff;
// Any other value: the local pod interface the flow entered the node at,
// whose source something on the way rewrote (kube-proxy's masquerade for
// a NodePort, an external IP, `--masquerade-all`, hostPort): the peer is
// that pod, as if its packet had arrived unchanged.

impl CtEntry {
    /// Whether the entry is still in its lifetime at `now` (its clock).
    /// An entry stamped just after `now` is live (see [`age_ns`]).
    #[inline(always)]
    pub const fn is_live(&self, protocol: u8, now: u64) -> bool {
        age_ns(now, self.last_seen_ns) <= self.timeout_ns(protocol)
    }

    /// Lifetime of an idle entry.
    #[inline(always)]
    pub const fn timeout_ns(&self, protocol: u8) -> u64 {
        if protocol == crate::proto::TCP {
            if self.flags & CT_FLAG_CLOSING != 0 {
                CT_CLOSING_TIMEOUT_NS
            } else if self.flags & CT_FLAG_SYN_ONLY != 0 {
                CT_SYN_TIMEOUT_NS
            } else {
                CT_TCP_TIMEOUT_NS
            }
        } else {
            CT_OTHER_TIMEOUT_NS
        }
    }
}

/// Key of `FRAGMENTS`: one fragmented datagram at one interface.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragKey {
    pub ifindex: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// IPv4 identification (16 bits) or IPv6 fragment identification.
    pub id: u32,
    pub protocol: u8,
    pub family: u8,
    pub _pad: u16,
}
assert_size!(FragKey, 44);

/// Value of `FRAGMENTS`: the first fragment passed with these ports.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragEntry {
    pub sport: u16,
    pub dport: u16,
    pub _reserved: u32,
}
assert_size!(FragEntry, 8);

#[cfg(feature = "user")]
crate::user_pod!(CtKey, CtEntry, FragKey, FragEntry);

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(last_seen_ns: u64) -> CtEntry {
        CtEntry {
            last_seen_ns,
            ..CtEntry::default()
        }
    }

    #[test]
    fn an_entry_lives_out_its_timeout_and_no_longer() {
        let e = entry(5_000_000_000);
        let end = e.last_seen_ns + CT_OTHER_TIMEOUT_NS;
        assert!(e.is_live(crate::proto::UDP, end));
        assert!(!e.is_live(crate::proto::UDP, end + 1));
    }

    #[test]
    fn an_entry_stamped_past_the_clocks_lag_is_not() {
        let now = 5_000_000_000;
        assert!(!entry(now + CLOCK_LAG_NS + 1).is_live(crate::proto::TCP, now));
        assert!(entry(now + CLOCK_LAG_NS).is_live(crate::proto::TCP, now));
    }

    #[test]
    fn an_entry_stamped_after_the_readers_now_is_live() {
        // The agent's sweep reads its clock, then walks: a flow opened a
        // tick later is stamped after that reading and must not be swept.
        let now = 5_000_000_000;
        let e = entry(now + 4_000_000);
        assert!(e.is_live(crate::proto::TCP, now));
        assert!(e.is_live(crate::proto::UDP, now));
    }
}
