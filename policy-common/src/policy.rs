//! The policy map: which peers a local identity may exchange traffic with.
//!
//! One hash map holds every allow entry. A port range becomes a handful of
//! entries, each a power-of-two aligned block written as (port, prefix
//! length), as an LPM key would. The classifier probes only the prefix
//! lengths present for the endpoint (see
//! [`crate::endpoint::lookups`]), so its cost is bounded by the shapes in
//! use, never by the number of entries. NetworkPolicy has no deny rules:
//! for an endpoint only NetworkPolicies judge, any hit allows.
//!
//! ClusterNetworkPolicy rules are resolved in userspace into the same
//! keys: an entry also carries, per tier, the rule of highest precedence
//! among those matching its key ([`TierSlot`]). For an endpoint with tier
//! entries ([`crate::endpoint::EndpointInfo::tiered`]) the classifier
//! probes every shape, keeps per tier the slot of highest precedence, and
//! decides with [`Tiers::decide`]: still a bounded number of lookups,
//! whatever the number of policies or priorities.
use crate::{assert_size, verdict::Reason};

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
    /// Agent-chosen reference to the NetworkPolicy rule that produced the
    /// entry (for debugging; the kernel does not read it).
    pub rule_ref: u32,
    /// [`ENTRY_TIERS_ONLY`].
    pub flags: u32,
    /// The Admin-tier rule of highest precedence matching this key.
    pub admin: TierSlot,
    /// The Baseline-tier rule of highest precedence matching this key.
    pub baseline: TierSlot,
}
assert_size!(PolicyEntry, 16);

/// The entry exists only for its tier slots: no NetworkPolicy rule allows
/// its key. (Zero, the default, is a NetworkPolicy allow.)
pub const ENTRY_TIERS_ONLY: u32 = 1 << 0;

/// A ClusterNetworkPolicy action.
pub mod action {
    /// "Accepts the selected traffic, including replies to that traffic
    /// and related ICMP traffic."
    pub const ACCEPT: u32 = 1;
    /// "Drops the selected traffic."
    pub const DENY: u32 = 2;
    /// "Skips all further ClusterNetworkPolicy rules in the current tier
    /// for the selected traffic, and passes evaluation to the next tier."
    pub const PASS: u32 = 3;
}

/// One tier's verdict in an entry: 0 when no rule of the tier matches the
/// key, else `(MAX_RANK + 1 - rank) << 2 | action`. The rank orders every
/// rule of the tier in the cluster (priority, then policy, then the rule's
/// place in it), from 1; a lower rank has higher precedence, so the
/// greatest slot of all the entries a packet matches is the rule that
/// decides it (and no rule at all, 0, loses to any).
#[repr(transparent)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TierSlot(pub u32);

impl TierSlot {
    pub const NONE: Self = Self(0);
    /// The highest rank a slot can hold.
    pub const MAX_RANK: u32 = (u32::MAX >> 2) - 1;

    /// The slot of rule `rank` (1..=MAX_RANK) with `action`.
    #[inline(always)]
    pub const fn new(rank: u32, action: u32) -> Self {
        Self(((Self::MAX_RANK + 1 - rank) << 2) | (action & 3))
    }

    #[inline(always)]
    pub const fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The rule's rank (0 for none).
    #[inline(always)]
    pub const fn rank(self) -> u32 {
        if self.0 == 0 {
            0
        } else {
            Self::MAX_RANK + 1 - (self.0 >> 2)
        }
    }

    #[inline(always)]
    pub const fn action(self) -> u32 {
        self.0 & 3
    }

    /// The rank of rule `index` of a policy of `priority`, `place`-th
    /// among the policies of its tier and priority (by name): "Policies
    /// with lower priority values have higher precedence"; inside one,
    /// "a rule that appears at the top ... would take the highest
    /// precedence". 10 bits of priority (0-1000), 15 of place, 5 of index
    /// (at most 25 rules): a change to one policy moves the ranks of no
    /// policy of another priority.
    pub const fn rule_rank(priority: u32, place: u32, index: u32) -> u32 {
        let priority = if priority > 1023 { 1023 } else { priority };
        let place = if place > (1 << 15) - 1 {
            (1 << 15) - 1
        } else {
            place
        };
        let index = if index > 31 { 31 } else { index };
        1 + ((priority << 20) | (place << 5) | index)
    }

    /// The policy priority of the slot's rule (see [`Self::rule_rank`]).
    pub const fn priority(self) -> u32 {
        self.rank().saturating_sub(1) >> 20
    }

    /// The index of the slot's rule in its policy.
    pub const fn rule_index(self) -> u32 {
        self.rank().saturating_sub(1) & 31
    }

    /// The name of the slot's action ("" for none).
    pub const fn action_name(self) -> &'static str {
        if self.is_none() {
            return "";
        }
        match self.action() {
            action::ACCEPT => "Accept",
            action::DENY => "Deny",
            _ => "Pass",
        }
    }

    /// The slot of higher precedence: the greater, computed without a
    /// branch (the classifier folds many entries; every branch there
    /// multiplies the verifier's work).
    #[inline(always)]
    pub const fn best(self, other: Self) -> Self {
        let (a, b) = (self.0 as i64, other.0 as i64);
        // All ones when a < b: both fit in 32 bits, so a - b is negative
        // exactly then.
        let take_b = ((a - b) >> 63) as u64;
        Self((a as u64 ^ ((a as u64 ^ b as u64) & take_b)) as u32)
    }
}

/// What every entry a new flow matches says together: the best slot of
/// each tier, and whether some NetworkPolicy rule allows it (non-zero).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Tiers {
    pub admin: TierSlot,
    pub baseline: TierSlot,
    pub network_policy: u32,
    /// The `rule_ref` of the first entry (in probe order) a NetworkPolicy
    /// rule allows: what a flow record names for an allow.
    pub network_policy_rule: u32,
}

impl Tiers {
    /// Folds one matching entry in.
    #[inline(always)]
    pub fn add(&mut self, entry: &PolicyEntry) {
        self.admin = self.admin.best(entry.admin);
        self.baseline = self.baseline.best(entry.baseline);
        // Branch-free, as `best`: the first allowing entry's rule is kept.
        let allows = !entry.flags & ENTRY_TIERS_ONLY;
        let first = allows & (self.network_policy ^ 1);
        self.network_policy_rule |= entry.rule_ref & first.wrapping_neg();
        self.network_policy |= allows;
    }

    /// The decision, tier by tier, for an endpoint a NetworkPolicy
    /// isolates in this direction (`isolated`) or not:
    ///
    /// "Policy tiers are evaluated in the following order: Admin tier,
    /// NetworkPolicy tier, Baseline tier. [...] If Admin tier has made a
    /// final decision (Accept or Deny) on a connection, then no further
    /// evaluation is done. [...] v1.NetworkPolicy always makes a final
    /// decision for selected pods. Further evaluation only happens for
    /// Pods not selected by a v1.NetworkPolicy. [...] If a given
    /// connection wasn't allowed or denied by any of the tiers, the
    /// default kubernetes policy is applied, which says that all pods can
    /// communicate with each other."
    #[inline(always)]
    pub const fn decide(&self, isolated: bool) -> Reason {
        match self.admin.action() {
            action::ACCEPT if !self.admin.is_none() => return Reason::AllowAdminTier,
            action::DENY if !self.admin.is_none() => return Reason::DropAdminTier,
            // Pass (or no Admin rule): the NetworkPolicy tier.
            _ => {}
        }
        if isolated {
            return if self.network_policy != 0 {
                Reason::AllowPolicy
            } else {
                Reason::DropPolicy
            };
        }
        match self.baseline.action() {
            action::ACCEPT if !self.baseline.is_none() => Reason::AllowBaselineTier,
            action::DENY if !self.baseline.is_none() => Reason::DropBaselineTier,
            // Pass, or nothing matched: the default.
            _ => Reason::AllowNotIsolated,
        }
    }
}

/// The port prefix lengths the agent writes: a port range is split into
/// aligned blocks of 1, 4, 16, 64, 256 or 4096 ports, or every port of a
/// protocol, as a multibit trie holds it (strides of 2 bits down to 8,
/// then 4). A packet then probes at most seven lengths per peer where all
/// seventeen would take seventeen; a range takes about 1.5 times the
/// entries of the fewest blocks of any length (measured over ranges of 1
/// to 3,000 ports; a range of a few dozen ports about the same), where
/// strides of 4 bits only (five lengths) took 3.2 times. The classifier
/// probes whatever lengths an endpoint's bits say are present, so an
/// entry of another length (written by an older agent) still counts.
pub const PORT_PREFIX_LENGTHS: [u8; 7] = [16, 14, 12, 10, 8, 4, 0];

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
    /// any-protocol), plus any-peer when its peer is the wildcard and the
    /// class bit when its peer is not a label identity. The one
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
        let peer = self.peer_identity;
        if peer == crate::identity::ANY {
            shape | crate::endpoint::lookups::ANY_PEER
        } else if peer >= crate::identity::FIRST_LABEL && !crate::identity::is_cidr(peer) {
            shape
        } else {
            shape | crate::endpoint::lookups::CLASS_PEER
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

impl PolicyKey {
    /// The key's bytes as two little-endian words, so every byte (padding
    /// too) is written by two stores: built field by field in map-key
    /// memory, the key cost the classifier a call to `memset` (a byte
    /// loop) per probe. `PolicyKey::new(..).words()` stays in registers.
    #[inline(always)]
    pub const fn words(&self) -> [u64; 2] {
        [
            self.endpoint_identity as u64 | (self.peer_identity as u64) << 32,
            self.direction as u64
                | (self.protocol as u64) << 8
                | (self.port_prefix_len as u64) << 16
                | (self.port as u64) << 32,
        ]
    }
}

#[cfg(feature = "user")]
crate::user_pod!(PolicyKey, PolicyEntry);

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "user")]
    #[test]
    fn a_key_in_words_is_the_key_byte_for_byte() {
        for (len, port) in [(16, 8080), (13, 8007), (0, 443), (1, 65535)] {
            let key = PolicyKey::new(0xdead_beef, 1, 0x1234_5678, 6, len, port);
            let words = key.words();
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&words[0].to_le_bytes());
            bytes[8..].copy_from_slice(&words[1].to_le_bytes());
            assert_eq!(bytemuck::bytes_of(&key), &bytes[..], "{len} {port}");
        }
    }

    fn entry(rule_ref: u32, flags: u32, admin: TierSlot, baseline: TierSlot) -> PolicyEntry {
        PolicyEntry {
            rule_ref,
            flags,
            admin,
            baseline,
        }
    }

    #[test]
    fn the_fold_keeps_the_first_allowing_entrys_rule() {
        let none = TierSlot::NONE;
        let mut t = Tiers::default();
        // Tiers-only entries allow nothing: their rule_ref is not kept.
        t.add(&entry(
            7,
            ENTRY_TIERS_ONLY,
            TierSlot::new(5, action::PASS),
            none,
        ));
        assert_eq!((t.network_policy, t.network_policy_rule), (0, 0));
        t.add(&entry(11, 0, none, none));
        t.add(&entry(12, 0, TierSlot::new(2, action::DENY), none));
        t.add(&entry(13, ENTRY_TIERS_ONLY, none, none));
        assert_eq!((t.network_policy, t.network_policy_rule), (1, 11));
        // The slots fold apart: the best of every entry, allowing or not.
        assert_eq!(t.admin, TierSlot::new(2, action::DENY));
        assert_eq!(t.baseline, none);
    }

    #[test]
    fn the_fold_keeps_a_first_rule_of_zero() {
        // An allowing entry without a name (0) is still the first: a later
        // one does not take its place.
        let mut t = Tiers::default();
        t.add(&entry(0, 0, TierSlot::NONE, TierSlot::NONE));
        t.add(&entry(9, 0, TierSlot::NONE, TierSlot::NONE));
        assert_eq!((t.network_policy, t.network_policy_rule), (1, 0));
    }

    #[test]
    fn any_order_of_entries_keeps_the_first_allowing_one() {
        let slots = [
            TierSlot::NONE,
            TierSlot::new(1, action::ACCEPT),
            TierSlot::new(4, action::PASS),
        ];
        // Every sequence of four entries, each allowing or tiers-only.
        for bits in 0u32..16 {
            let entries: [PolicyEntry; 4] = core::array::from_fn(|i| {
                let flags = if bits & (1 << i) != 0 {
                    0
                } else {
                    ENTRY_TIERS_ONLY
                };
                entry(100 + i as u32, flags, slots[i % 3], slots[(i + 1) % 3])
            });
            let mut t = Tiers::default();
            for e in &entries {
                t.add(e);
            }
            let first = entries.iter().find(|e| e.flags & ENTRY_TIERS_ONLY == 0);
            assert_eq!(t.network_policy, u32::from(first.is_some()), "{bits:04b}");
            assert_eq!(
                t.network_policy_rule,
                first.map_or(0, |e| e.rule_ref),
                "{bits:04b}"
            );
        }
    }
}
