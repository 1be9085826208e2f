//! What the rules a `POLICY` entry references are called: the value of
//! `RULE_NAMES` (userspace only), so `dump` can name each entry's rules
//! from the pins alone, whichever agent wrote them.
//!
//! An entry references up to three rules: the NetworkPolicy rule of its
//! `rule_ref`, and per tier the ClusterNetworkPolicy rule of its slot's
//! rank. The agent keeps one name for each rule some entry references.
use crate::assert_size;

/// Kinds stored in [`RuleKey::kind`].
pub mod kind {
    /// A NetworkPolicy rule: the id is its `PolicyEntry::rule_ref`.
    pub const NETWORK_POLICY: u8 = 0;
    /// An Admin-tier ClusterNetworkPolicy rule: the id is its slot's rank.
    pub const ADMIN: u8 = 1;
    /// A Baseline-tier ClusterNetworkPolicy rule: the id is its rank.
    pub const BASELINE: u8 = 2;
}

/// Key of `RULE_NAMES`.
///
/// The direction is part of the key: a ClusterNetworkPolicy's ingress
/// rule `i` and its egress rule `i` share one rank (each list counts
/// from 0), and only the entry's direction tells them apart.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RuleKey {
    /// One of [`kind`].
    pub kind: u8,
    /// [`crate::direction`].
    pub direction: u8,
    pub _pad: u16,
    /// The `rule_ref` or the rank (see [`kind`]).
    pub id: u32,
}
assert_size!(RuleKey, 8);

impl RuleKey {
    pub const fn new(kind: u8, direction: u8, id: u32) -> Self {
        Self {
            kind,
            direction,
            _pad: 0,
            id,
        }
    }
}

/// Bytes of [`RuleName::text`].
pub const RULE_TEXT_LEN: usize = 256;

/// The texts of a [`RuleName`], in the order they are stored.
pub mod text {
    /// The NetworkPolicy's namespace (empty for a ClusterNetworkPolicy).
    pub const NAMESPACE: usize = 0;
    /// The policy's name.
    pub const POLICY: usize = 1;
    /// The rule's `name` (ClusterNetworkPolicy rules may have one).
    pub const RULE: usize = 2;
}

/// Value of `RULE_NAMES` (userspace only): the rule a [`RuleKey`] stands
/// for. Three texts share one area, each cut to fit when they do not all
/// do; their full lengths are kept so a cut text can be marked as such.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RuleName {
    /// [`crate::direction`].
    pub direction: u8,
    pub _pad: u8,
    /// The rule's place in its policy's `ingress` or `egress` list.
    pub rule_index: u16,
    /// The ClusterNetworkPolicy's priority (0 for a NetworkPolicy).
    pub priority: u32,
    /// Full byte length of each text (indexed by [`text`]).
    pub full_len: [u16; 3],
    /// Bytes of each text stored in `text`, one after another.
    pub stored_len: [u16; 3],
    pub text: [u8; RULE_TEXT_LEN],
}
assert_size!(RuleName, 276);

#[cfg(feature = "user")]
crate::user_pod!(RuleKey, RuleName);
