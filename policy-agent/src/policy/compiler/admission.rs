//! Admitting a policy within the budgets ([`super::budget`]): its entries
//! are counted before they are built, and a policy that would pass its
//! budget, or what the others leave of the total, is refused instead.
//! Growth is checked the same way where it happens (an identity born or
//! moved, a new local endpoint: `pods.rs`).
use std::collections::{BTreeMap, BTreeSet};

use super::{
    Compiler,
    budget::Refusal,
    index::{Ident, IdentityIndex},
    keys::{Keys, Plan, write_rule},
    output::Output,
    selection::{PolicyState, rule_state},
};
use crate::{cluster::PolicyRef, policy::parse::ParsedPolicy};

/// Drops everything `ps` compiled (its keys and the identities its rules
/// reach) and marks it refused; returns the entries freed. It keeps its
/// selection: the pods stay isolated.
pub(super) fn refuse(
    ps: &mut PolicyState,
    out: &mut Output,
    idents: &BTreeMap<u32, Ident>,
    why: Refusal,
) -> u64 {
    let freed = if ps.refused.is_none() {
        ps.entries()
    } else {
        0
    };
    let endpoints: Vec<u32> = ps.keys.keys().copied().collect();
    for e in endpoints {
        for (rule, rs) in ps.rules() {
            write_rule(&mut Keys::Remove(out), idents, rule, rs, e);
        }
    }
    ps.rules = Vec::new();
    ps.keys.clear();
    ps.keys_total = 0;
    ps.members = 0;
    ps.refused = Some(why);
    freed
}

impl Compiler {
    /// Matches `parsed` against the identities in use and, if it fits the
    /// budgets, writes its keys; else it is kept refused (selecting, so
    /// isolating, but compiling to nothing).
    pub(super) fn add_policy_state(&mut self, parsed: ParsedPolicy) {
        self.carving.add(&parsed);
        let selected: BTreeSet<u32> = self
            .index
            .in_namespace(&parsed.name.namespace)
            .filter(|x| {
                self.index
                    .idents
                    .get(x)
                    .is_some_and(|i| parsed.selects(&i.key.namespace, &i.key.labels))
            })
            .collect();
        let endpoints: Vec<u32> = selected
            .iter()
            .copied()
            .filter(|e| self.index.endpoint_ids.contains(e))
            .collect();
        self.flags_dirty.extend(&endpoints);
        let mut ps = PolicyState::unmatched(parsed);
        ps.selected = selected;

        // Counted first: the identities each rule reaches (kept, a rule at
        // a time, until past the budget), then the keys (collected, not
        // written, until past it).
        let budget = self.options.budget;
        let mut plan = Plan::new(budget.per_policy);
        let mut rules = Vec::with_capacity(ps.parsed.rules.len());
        for rule in &ps.parsed.rules {
            let room = budget.per_policy.saturating_sub(plan.tally.n);
            match rule_state(rule, &self.classes, &self.index.idents, room) {
                Some(rs) => {
                    plan.tally.add(rs.members.len() as u64);
                    rules.push(rs);
                }
                None => {
                    plan.tally.add(room.saturating_add(1));
                    break;
                }
            }
        }
        let members = plan.tally.n;
        'plan: for e in &endpoints {
            for (rule, rs) in ps.parsed.rules.iter().zip(&rules) {
                if plan.tally.over() {
                    break 'plan;
                }
                write_rule(&mut Keys::Plan(&mut plan), &self.index.idents, rule, rs, *e);
            }
        }
        if let Some(why) = budget.refusal(0, &plan.tally, self.admitted) {
            ps.refused = Some(why);
        } else {
            ps.rules = rules;
            ps.members = members;
            plan.commit(&mut self.out, |e, n| ps.add_keys(e, n));
            self.admitted = self.admitted.saturating_add(ps.entries());
        }
        self.policies.insert(ps.parsed.name.clone(), ps);
    }

    /// After a full compile that turned policies away for the total
    /// budget (they came in name order): the smallest are admitted first,
    /// so one large policy does not keep many small ones out. Evictions
    /// come before admissions, so the total is never passed.
    pub(super) fn admit_smallest_first(&mut self) {
        let total = self.options.budget.total;
        let turned_away =
            |ps: &PolicyState| matches!(ps.refused, Some(Refusal::TotalBudget { .. }));
        if !self.policies.values().any(turned_away) {
            return;
        }
        let mut candidates: Vec<(u64, PolicyRef)> = self
            .policies
            .iter()
            .filter_map(|(name, ps)| match ps.refused {
                None => Some((ps.entries(), name.clone())),
                Some(Refusal::TotalBudget { entries, .. }) => Some((entries, name.clone())),
                Some(Refusal::PolicyBudget { .. }) => None,
            })
            .collect();
        candidates.sort();
        let mut used: u64 = 0;
        let mut admit: BTreeSet<PolicyRef> = BTreeSet::new();
        for (entries, name) in candidates {
            if used.saturating_add(entries) > total {
                break;
            }
            used += entries;
            admit.insert(name);
        }
        let (policies, index, out, admitted) = self.key_parts();
        for (name, ps) in policies.iter_mut() {
            if ps.refused.is_none() && !admit.contains(name) {
                let why = Refusal::TotalBudget {
                    entries: ps.entries(),
                    budget: total,
                };
                *admitted = admitted.saturating_sub(refuse(ps, out, &index.idents, why));
            }
        }
        let back: Vec<PolicyRef> = admit
            .into_iter()
            .filter(|name| self.policies.get(name).is_some_and(turned_away))
            .collect();
        for name in back {
            if let Some(ps) = self.policies.remove(&name) {
                self.carving.remove(&ps.parsed);
                self.add_policy_state(ps.parsed);
            }
        }
    }

    /// The parts of the compiler a key write borrows at once: the
    /// policies and the output mutably, the identities to read, and the
    /// tally of admitted entries.
    pub(super) fn key_parts(
        &mut self,
    ) -> (
        &mut BTreeMap<PolicyRef, PolicyState>,
        &IdentityIndex,
        &mut Output,
        &mut u64,
    ) {
        (
            &mut self.policies,
            &self.index,
            &mut self.out,
            &mut self.admitted,
        )
    }

    /// Whether some policy is refused for a budget.
    pub fn has_refusals(&self) -> bool {
        self.policies.values().any(|p| p.refused.is_some())
    }

    /// Entries the admitted policies hold (the total budget's use), and
    /// how many policies the budgets refuse.
    pub fn budget_use(&self) -> (u64, usize) {
        let refused = self
            .policies
            .values()
            .filter(|p| p.refused.is_some())
            .count();
        (self.admitted, refused)
    }
}
