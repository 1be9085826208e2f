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
    /// A NetworkPolicy that isolates the pods of one label identity in
    /// the key's direction: the id is that identity, [`super::RuleKey::index`]
    /// counts the policies from 0 (by namespace and name), and the value
    /// names the policy with [`super::RuleName::rule_index`]
    /// [`super::NO_RULE`]. What a flow record names for a policy drop.
    pub const ISOLATING: u8 = 3;
}

/// [`RuleName::rule_index`] of a name that stands for a whole policy.
pub const NO_RULE: u16 = u16::MAX;

/// At most this many isolating policies are named per identity and
/// direction; past it the last one kept says how many more there are
/// (its rule name reads "and N more").
pub const MAX_ISOLATING: u16 = 64;

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
    /// 0, but for [`kind::ISOLATING`].
    pub index: u16,
    /// The `rule_ref`, the rank or the identity (see [`kind`]).
    pub id: u32,
}
assert_size!(RuleKey, 8);

impl RuleKey {
    pub const fn new(kind: u8, direction: u8, id: u32) -> Self {
        Self {
            kind,
            direction,
            index: 0,
            id,
        }
    }

    /// The key of the `index`-th policy isolating `identity` in `direction`.
    pub const fn isolating(direction: u8, identity: u32, index: u16) -> Self {
        Self {
            kind: kind::ISOLATING,
            direction,
            index,
            id: identity,
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
