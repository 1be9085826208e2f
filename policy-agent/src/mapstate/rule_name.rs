//! Building and reading [`RuleName`] values, and which rules a policy
//! entry references (what `RULE_NAMES` must name).
use std::collections::BTreeSet;

use policy_common::{
    policy::{ENTRY_TIERS_ONLY, PolicyEntry, PolicyKey},
    rule_name::{RULE_TEXT_LEN, RuleKey, RuleName, kind, text},
};

use super::MapState;

/// The rules `entry` (at `key`) references: its NetworkPolicy rule unless
/// it holds tier slots only, and the rule of each tier slot it holds.
pub fn entry_rules(key: &PolicyKey, entry: &PolicyEntry) -> impl Iterator<Item = RuleKey> {
    let dir = key.direction;
    let np = (entry.flags & ENTRY_TIERS_ONLY == 0)
        .then(|| RuleKey::new(kind::NETWORK_POLICY, dir, entry.rule_ref));
    let admin =
        (!entry.admin.is_none()).then(|| RuleKey::new(kind::ADMIN, dir, entry.admin.rank()));
    let baseline = (!entry.baseline.is_none())
        .then(|| RuleKey::new(kind::BASELINE, dir, entry.baseline.rank()));
    np.into_iter().chain(admin).chain(baseline)
}

impl<K: Ord> MapState<K> {
    /// Every rule some policy entry references: the keys `rule_names`
    /// holds once the compiler has named them.
    pub fn referenced_rules(&self) -> BTreeSet<RuleKey> {
        self.policy
            .iter()
            .flat_map(|(k, e)| entry_rules(k, e))
            .collect()
    }
}

/// The stored form of a rule's name: `namespace` empty for a
/// ClusterNetworkPolicy, `rule` empty when the rule has no name. The texts
/// share [`RULE_TEXT_LEN`] bytes fairly: each gets an equal share of what
/// is left until it fits, cut at a character boundary.
pub fn rule_name(
    direction: u8,
    rule_index: usize,
    priority: u32,
    namespace: &str,
    policy: &str,
    rule: &str,
) -> RuleName {
    let texts = [namespace, policy, rule];
    let stored = shares(texts.map(str::len));
    let mut n = RuleName {
        direction,
        _pad: 0,
        rule_index: u16::try_from(rule_index).unwrap_or(u16::MAX),
        priority,
        full_len: texts.map(|t| u16::try_from(t.len()).unwrap_or(u16::MAX)),
        stored_len: [0; 3],
        text: [0; RULE_TEXT_LEN],
    };
    let mut at = 0;
    for (i, t) in texts.iter().enumerate() {
        let mut len = stored[i];
        while !t.is_char_boundary(len) {
            len -= 1;
        }
        n.text[at..at + len].copy_from_slice(&t.as_bytes()[..len]);
        n.stored_len[i] = len as u16;
        at += len;
    }
    n
}

/// How many bytes of each text fit: equal shares of the room left, over
/// the texts not stored whole yet, until all fit or the room is used.
fn shares(lens: [usize; 3]) -> [usize; 3] {
    let mut stored = [0; 3];
    let mut left = RULE_TEXT_LEN;
    loop {
        let open: Vec<usize> = (0..3).filter(|i| stored[*i] < lens[*i]).collect();
        if open.is_empty() || left == 0 {
            return stored;
        }
        let share = (left / open.len()).max(1);
        for i in open {
            let add = share.min(lens[i] - stored[i]).min(left);
            stored[i] += add;
            left -= add;
        }
    }
}

/// A rule's name as text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleText {
    pub namespace: String,
    pub policy: String,
    pub rule: String,
}

/// The (possibly cut) texts, each marked with "…" when cut.
pub fn rule_name_text(n: &RuleName) -> RuleText {
    let mut at = 0;
    let mut out = [String::new(), String::new(), String::new()];
    for (i, slot) in out.iter_mut().enumerate() {
        let len = usize::from(n.stored_len[i]).min(RULE_TEXT_LEN - at);
        *slot = String::from_utf8_lossy(&n.text[at..at + len]).into_owned();
        if usize::from(n.full_len[i]) > len {
            slot.push('…');
        }
        at += len;
    }
    let [namespace, policy, rule] = out;
    RuleText {
        namespace,
        policy,
        rule,
    }
}

impl RuleText {
    /// `namespace/name` for a NetworkPolicy, the name alone otherwise.
    pub fn qualified(&self) -> String {
        if self.namespace.is_empty() {
            self.policy.clone()
        } else {
            format!("{}/{}", self.namespace, self.policy)
        }
    }
}

const _: () = assert!(text::NAMESPACE == 0 && text::POLICY == 1 && text::RULE == 2);

#[cfg(test)]
mod tests {
    use policy_common::{direction, policy::TierSlot, proto};

    use super::*;
    use crate::mapstate::{MapOp, diff};

    #[test]
    fn texts_round_trip_and_cut_texts_are_marked() {
        let n = rule_name(direction::EGRESS, 3, 0, "team-a", "allow-dns", "");
        let t = rule_name_text(&n);
        assert_eq!(t.qualified(), "team-a/allow-dns");
        assert_eq!((t.rule.as_str(), n.rule_index), ("", 3));

        let long = "p".repeat(253);
        let rule = "r".repeat(200);
        let n = rule_name(direction::INGRESS, 0, 20, "", &long, &rule);
        let t = rule_name_text(&n);
        assert!(t.policy.ends_with('…') && t.rule.ends_with('…'));
        assert_eq!(
            n.stored_len.iter().map(|l| usize::from(*l)).sum::<usize>(),
            RULE_TEXT_LEN
        );
        assert_eq!(n.stored_len, [0, 128, 128]);
        // What a short text leaves goes to the longer one.
        let n = rule_name(direction::INGRESS, 0, 20, "", &long, &"r".repeat(50));
        assert_eq!(n.stored_len, [0, 206, 50]);
        assert_eq!(rule_name_text(&n).rule, "r".repeat(50));
    }

    #[test]
    fn multibyte_text_is_cut_at_a_character_boundary() {
        let n = rule_name(direction::INGRESS, 0, 1, "", &"é".repeat(200), "");
        let t = rule_name_text(&n);
        assert!(t.policy.ends_with('…'));
        assert!(!t.policy.contains('\u{fffd}'));
    }

    fn entry(rule_ref: u32, admin: TierSlot) -> PolicyEntry {
        PolicyEntry {
            rule_ref,
            admin,
            ..PolicyEntry::default()
        }
    }

    /// Names land before the entries naming them and go after the last
    /// entry naming them is removed.
    #[test]
    fn names_come_before_their_entries_and_go_after() {
        let key = PolicyKey::new(300, direction::INGRESS, 301, proto::TCP, 16, 80);
        let admin = TierSlot::new(TierSlot::rule_rank(10, 0, 1), 2);
        let mut new: MapState<u32> = MapState::default();
        new.policy.insert(key, entry(7, admin));
        let refs = new.referenced_rules();
        assert_eq!(
            refs.iter().map(|k| (k.kind, k.id)).collect::<Vec<_>>(),
            [(kind::NETWORK_POLICY, 7), (kind::ADMIN, admin.rank())]
        );
        for k in &refs {
            new.rule_names
                .insert(*k, rule_name(k.direction, 0, 0, "ns", "p", ""));
        }
        let old = MapState::default();
        let ops = diff(&old, &new);
        let policy_at = ops
            .iter()
            .position(|o| matches!(o, MapOp::UpsertPolicy(..)))
            .unwrap();
        let names_at: Vec<usize> = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, MapOp::UpsertRuleName(..)))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(names_at.len(), 2);
        assert!(names_at.iter().all(|i| *i < policy_at), "{ops:?}");

        let ops = diff(&new, &old);
        let policy_at = ops
            .iter()
            .position(|o| matches!(o, MapOp::DeletePolicy(_)))
            .unwrap();
        let names_at: Vec<usize> = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, MapOp::DeleteRuleName(_)))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(names_at.len(), 2);
        assert!(names_at.iter().all(|i| *i > policy_at), "{ops:?}");
    }
}
