//! Each endpoint's share of `CONNTRACK`.
//!
//! One LRU map holds the flows of every pod on the node. Without a bound,
//! one pod opening flows as fast as it can (SYNs to anything its policy
//! allows) turns the whole map over and evicts the entries of every other
//! pod: their replies are then judged as new, and dropped where no rule
//! admits them. So each endpoint may hold at most `share` entries.
//!
//! The kernel counts what each interface opens (`CT_USAGE[ifindex,
//! OPENED]`, only the classifier writes it). The agent counts what the
//! map still holds for each interface, live, and writes how many of the
//! opened ones are gone (`CT_USAGE[ifindex, RELEASED]`, only the agent
//! writes it): `opened - released` is then what the interface holds, or
//! more (what it opened since the agent's count). Nothing an agent writes
//! races with the kernel's increments: they are separate keys.
//!
//! LRU evictions are silent, so between two counts the estimate only
//! grows. The bound binds only while the count is fresh
//! ([`CT_SHARE_FRESH_NS`]): an agent that stopped counting must not leave
//! every busy pod refused for good. Without an agent the map is shared as
//! before the bound existed.
use crate::assert_size;

/// [`CtUsageKey::counter`]: flows the interface opened (kernel-written,
/// wrapping).
pub const CT_USAGE_OPENED: u32 = 0;
/// [`CtUsageKey::counter`]: of those, how many the agent's last count did
/// not find in `CONNTRACK` (agent-written).
pub const CT_USAGE_RELEASED: u32 = 1;

/// A count is fresh this long after the agent wrote it.
pub const CT_SHARE_FRESH_NS: u64 = 60 * 1_000_000_000;

/// Key of `CT_USAGE` (hash, value `u64`).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtUsageKey {
    pub ifindex: u32,
    /// [`CT_USAGE_OPENED`] or [`CT_USAGE_RELEASED`].
    pub counter: u32,
}
assert_size!(CtUsageKey, 8);

/// Slot 0 of the `CT_SHARE` array (agent-written). All zero: no bound.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtShare {
    /// When the agent last counted (`bpf_ktime_get_coarse_ns`'s clock,
    /// CLOCK_MONOTONIC).
    pub counted_ns: u64,
    /// The most entries one interface may hold; 0: no bound.
    pub share: u32,
    pub _pad: u32,
}
assert_size!(CtShare, 16);

impl CtShare {
    /// Whether the bound applies at `now`: set, and counted recently.
    #[inline(always)]
    pub const fn binds(&self, now: u64) -> bool {
        self.share != 0
            && self.counted_ns != 0
            && crate::conntrack::age_ns(now, self.counted_ns) <= CT_SHARE_FRESH_NS
    }

    /// Whether an interface that opened `opened` flows, of which the agent
    /// found `released` gone, may open one more at `now`.
    #[inline(always)]
    pub const fn may_open(&self, opened: u64, released: u64, now: u64) -> bool {
        !self.binds(now) || opened.wrapping_sub(released) < self.share as u64
    }
}

#[cfg(feature = "user")]
crate::user_pod!(CtUsageKey, CtShare);

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000 * 1_000_000_000;

    #[test]
    fn the_share_binds_only_while_the_count_is_fresh() {
        let s = CtShare {
            counted_ns: NOW,
            share: 10,
            _pad: 0,
        };
        assert!(s.may_open(9, 0, NOW));
        assert!(!s.may_open(10, 0, NOW));
        assert!(s.may_open(10, 1, NOW), "one released: room for one");
        assert!(!s.may_open(10, 0, NOW + CT_SHARE_FRESH_NS));
        assert!(s.may_open(10, 0, NOW + CT_SHARE_FRESH_NS + 1), "stale");
        let off = CtShare { share: 0, ..s };
        assert!(off.may_open(u64::MAX, 0, NOW));
        let never = CtShare { counted_ns: 0, ..s };
        assert!(never.may_open(1_000, 0, NOW), "never counted");
    }

    #[test]
    fn counters_may_wrap() {
        let s = CtShare {
            counted_ns: NOW,
            share: 10,
            _pad: 0,
        };
        assert!(s.may_open(3, u64::MAX - 2, NOW), "6 held");
        assert!(!s.may_open(7, u64::MAX - 2, NOW), "10 held");
    }
}
