//! Run-time switches the agent flips without reloading programs.
use crate::assert_size;

/// Kernel-side debug logging through aya-log (off by default: the fast
/// path then pays one array load and a branch).
pub const CONFIG_DEBUG_LOG: u32 = 1 << 0;
/// Stop emitting flow records (drops and new flows) to the ring buffer
/// (counters still count).
pub const CONFIG_NO_DROP_EVENTS: u32 = 1 << 1;
/// `POD_RANGES` holds at least one range (`--pod-cidr`): the classifier
/// drops traffic to and from local addresses that are not enforced yet
/// (see [`crate::pod_range_guard`]). Clear: no lookup at all.
pub const CONFIG_POD_RANGES: u32 = 1 << 2;

/// Slot 0 of the `CONFIG` array. All-zero is the default configuration.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Config {
    pub flags: u32,
    /// Userspace only: hash of the object the pinned programs came from,
    /// so an agent with a different build replaces them.
    pub object_hash: u32,
}
assert_size!(Config, 8);

#[cfg(feature = "user")]
crate::user_pod!(Config);
