//! `RULE_NAMES` in the compiled maps: a name for every rule some policy
//! entry references, and nothing else, so the table follows the entries.
//!
//! [`super::output::Output`] counts the references and says which rules
//! started or stopped being referenced; the rules whose policies came,
//! went or moved are looked at again too. Only those are named here, so
//! an incremental change costs what it touches: NetworkPolicy rules are
//! found by a pass over the policies only when one needs a name.
use std::collections::{BTreeMap, BTreeSet};

use policy_common::rule_name::{RuleKey, RuleName, kind};

use super::Compiler;
use crate::{mapstate::rule_name, policy::parse::ParsedPolicy};

/// The keys a NetworkPolicy's rules are named by.
pub(super) fn policy_rule_keys(p: &ParsedPolicy) -> impl Iterator<Item = RuleKey> + '_ {
    p.rules
        .iter()
        .map(|r| RuleKey::new(kind::NETWORK_POLICY, r.direction, r.rule_ref))
}

impl Compiler {
    /// Names the rules that need it (see the module's comment).
    pub(super) fn sync_rule_names(&mut self) {
        let dirty = self.out.take_dirty_rules();
        if dirty.is_empty() {
            return;
        }
        let wanted: BTreeSet<RuleKey> = dirty
            .iter()
            .filter(|k| k.kind == kind::NETWORK_POLICY && self.out.references(k))
            .copied()
            .collect();
        let np = self.network_policy_rule_names(&wanted);
        for key in dirty {
            let name = if !self.out.references(&key) {
                None
            } else if key.kind == kind::NETWORK_POLICY {
                np.get(&key).copied()
            } else {
                self.tier_rule_names.get(&key).copied()
            };
            self.out.set_rule_name(key, name);
        }
    }

    /// The names of the NetworkPolicy rules `wanted` (on a `rule_ref`
    /// collision the smallest, whatever the order policies came in).
    fn network_policy_rule_names(&self, wanted: &BTreeSet<RuleKey>) -> BTreeMap<RuleKey, RuleName> {
        let mut out: BTreeMap<RuleKey, RuleName> = BTreeMap::new();
        if wanted.is_empty() {
            return out;
        }
        for ps in self.policies.values() {
            let p = &ps.parsed;
            for (rule, key) in p.rules.iter().zip(policy_rule_keys(p)) {
                if !wanted.contains(&key) {
                    continue;
                }
                let name = rule_name(
                    rule.direction,
                    rule.index,
                    0,
                    &p.name.namespace,
                    &p.name.name,
                    "",
                );
                out.entry(key)
                    .and_modify(|n| *n = (*n).min(name))
                    .or_insert(name);
            }
        }
        out
    }

    /// Takes the tier rules' names as the tier layer ranked them; a rank
    /// named differently now is looked at again.
    pub(super) fn set_tier_rule_names(&mut self, names: BTreeMap<RuleKey, RuleName>) {
        let old = std::mem::take(&mut self.tier_rule_names);
        let changed: Vec<RuleKey> = old
            .iter()
            .filter(|(k, v)| names.get(k) != Some(v))
            .map(|(k, _)| *k)
            .chain(names.keys().filter(|k| !old.contains_key(k)).copied())
            .collect();
        self.out.mark_rules_dirty(changed);
        self.tier_rule_names = names;
    }
}
