//! The policy map: which peers a local identity may exchange traffic with.
//!
//! One hash map holds every allow entry. A port range becomes a handful of
//! entries, each a power-of-two aligned block written as (port, prefix
//! length), as an LPM key would. The classifier probes only the prefix
//! lengths present for the endpoint (see
//! [`crate::endpoint::lookups`]), so its cost is bounded by the shapes in
//! use, never by the number of entries. NetworkPolicy has no deny rules:
//! any hit allows.
use crate::assert_size;

/// Key of the `POLICY` map.
///
/// Port is in host byte order and already masked to its prefix length.
/// A wildcard protocol is protocol 0 with prefix length 0 and port 0.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyKey {
    /// Label identity of the local pod.
    pub endpoint_identity: u32,
    /// Peer identity (label or address class), or [`crate::identity::ANY`].
    pub peer_identity: u32,
    /// [`crate::direction`].
    pub direction: u8,
    /// IP protocol, or [`crate::proto::ANY`].
    pub protocol: u8,
    /// Significant leading bits of `port` (0..=16).
    pub port_prefix_len: u8,
    pub _pad0: u8,
    /// Destination port (host order), masked to `port_prefix_len` bits.
    pub port: u16,
    pub _pad1: u16,
}
assert_size!(PolicyKey, 16);

/// Value of the `POLICY` map.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyEntry {
    /// Agent-chosen reference to the rule that produced the entry (for
    /// debugging; the kernel does not read it).
    pub rule_ref: u32,
    pub _reserved: u32,
}
assert_size!(PolicyEntry, 8);

/// The mask keeping the top `len` bits of a port.
#[inline(always)]
pub const fn port_mask(len: u8) -> u16 {
    if len == 0 {
        0
    } else if len >= 16 {
        0xffff
    } else {
        !(0xffffu16 >> len)
    }
}

impl PolicyKey {
    /// The [`crate::endpoint::lookups`] bits this key needs set on its
    /// endpoint for the classifier to probe it: its port prefix length (or
    /// any-protocol), plus any-peer when its peer is the wildcard. The one
    /// statement of the rule: the agent sums it over an endpoint's keys,
    /// the classifier probes exactly the shapes whose bits are set.
    #[inline(always)]
    pub const fn lookup_bits(&self) -> u32 {
        let shape = if self.protocol == crate::proto::ANY {
            crate::endpoint::lookups::ANY_PROTOCOL
        } else {
            let len = if self.port_prefix_len > 16 {
                16
            } else {
                self.port_prefix_len
            };
            crate::endpoint::lookups::port_prefix(len)
        };
        if self.peer_identity == crate::identity::ANY {
            shape | crate::endpoint::lookups::ANY_PEER
        } else {
            shape
        }
    }

    /// A key for one probe of the lookup order.
    #[inline(always)]
    pub const fn new(
        endpoint_identity: u32,
        direction: u8,
        peer_identity: u32,
        protocol: u8,
        port_prefix_len: u8,
        port: u16,
    ) -> Self {
        Self {
            endpoint_identity,
            peer_identity,
            direction,
            protocol,
            port_prefix_len,
            _pad0: 0,
            port: port & port_mask(port_prefix_len),
            _pad1: 0,
        }
    }
}

#[cfg(feature = "user")]
crate::user_pod!(PolicyKey, PolicyEntry);
