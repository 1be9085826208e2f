//! Drop events, sent through the `DROP_EVENTS` ring buffer.
use crate::assert_size;

#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct DropEvent {
    pub timestamp_ns: u64,
    /// Host-side interface of the local pod.
    pub ifindex: u32,
    pub endpoint_identity: u32,
    /// Label identity of the peer (0: none).
    pub peer_identity: u32,
    /// Address-class identity of the peer.
    pub peer_cidr_identity: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub protocol: u8,
    pub family: u8,
    /// [`crate::direction`].
    pub direction: u8,
    /// [`crate::verdict::Reason`] as u8.
    pub reason: u8,
}
assert_size!(DropEvent, 64);

#[cfg(feature = "user")]
crate::user_pod!(DropEvent);
