//! Numeric identities.
//!
//! Two kinds share one number space, split by range so a number alone says
//! what it is:
//! - label identities (`FIRST_LABEL..FIRST_CIDR`): one per distinct set of
//!   namespace + pod labels; every pod with that set carries it;
//! - address-class identities (`FIRST_CIDR..`): one per prefix that some
//!   ipBlock `cidr` or `except` carves out, naming the addresses whose
//!   longest matching carved prefix is that one.
//!
//! An address has at most one of each, and the ipcache returns both, so an
//! ipBlock that covers a pod's IP matches as well as a selector does.
use crate::assert_size;

/// Wildcard peer in a policy key; also "no label identity" in the ipcache.
pub const ANY: u32 = 0;
/// The local node: its addresses are always allowed, both ways.
pub const NODE: u32 = 1;
/// Addresses nobody claims (no pod, no carved prefix).
pub const WORLD: u32 = 2;
/// An address in transit between two entries: no policy entry ever names
/// it, so nothing allows it. The agent writes it for the moment a change
/// could otherwise let the address meet an allow neither its old nor its
/// new entry grants (see the agent's write order).
pub const IN_TRANSIT: u32 = 3;
/// First label identity.
pub const FIRST_LABEL: u32 = 256;
/// First address-class identity (as Cilium's local CIDR scope, 1 << 24).
pub const FIRST_CIDR: u32 = 1 << 24;

/// Kinds stored in [`IdentityName::kind`].
pub mod kind {
    pub const RESERVED: u32 = 0;
    pub const LABELS: u32 = 1;
    pub const CIDR: u32 = 2;
}

/// Whether `id` is an address-class identity.
#[inline(always)]
pub const fn is_cidr(id: u32) -> bool {
    id >= FIRST_CIDR
}

/// Length of [`IdentityName::name`].
pub const IDENTITY_NAME_LEN: usize = 240;

/// Value of `IDENTITY_NAMES` (userspace only): what an identity stands for,
/// so `dump` can print it and a restarted agent can adopt the numbers.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable, Hash))]
pub struct IdentityName {
    /// Stable 64-bit hash of the full canonical name (the name may be cut).
    pub name_hash: u64,
    /// One of [`kind`].
    pub kind: u32,
    /// Length of the canonical name before truncation.
    pub name_len: u32,
    /// Canonical name, NUL-padded: sorted `key=value` labels for label
    /// identities, the prefix for address classes.
    pub name: [u8; IDENTITY_NAME_LEN],
}
assert_size!(IdentityName, 256);

#[cfg(feature = "user")]
crate::user_pod!(IdentityName);
