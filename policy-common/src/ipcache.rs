//! The IP → identity cache: per family, an LPM trie of prefixes and a
//! hash of full-length ones (see `crate::maps::IPCACHE_HOSTS_V4`).
use crate::assert_size;

/// LPM key data of `IPCACHE_V4` (after the u32 prefix length).
pub type Ipv4Bytes = [u8; 4];
/// LPM key data of `IPCACHE_V6` (after the u32 prefix length).
pub type Ipv6Bytes = [u8; 16];

/// Value of the ipcache maps.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct IpcacheEntry {
    /// Label identity of the pod holding this address,
    /// [`crate::identity::NODE`] for the node's addresses,
    /// [`crate::identity::ANY`] (0) when no pod holds it.
    pub identity: u32,
    /// Address-class identity: the longest ipBlock-carved prefix that
    /// contains this address, or [`crate::identity::WORLD`].
    pub cidr_identity: u32,
}
assert_size!(IpcacheEntry, 8);

impl IpcacheEntry {
    /// What an address matching no entry resolves to.
    pub const UNKNOWN: Self = Self {
        identity: crate::identity::ANY,
        cidr_identity: crate::identity::WORLD,
    };
}

#[cfg(feature = "user")]
crate::user_pod!(IpcacheEntry);
