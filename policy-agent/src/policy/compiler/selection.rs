//! Policy selection: which label identities each policy selects, and per
//! rule which identities its peers reach (its members), so a change of
//! one identity touches only the rules that mention it.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use policy_common::direction;

use super::{budget::Refusal, index::Ident, members::Members};
use crate::{
    cluster::PolicyRef,
    policy::{
        classes::Classes,
        evaluate,
        parse::{ParsedPolicy, Peers, Rule},
    },
};

/// `members` bit: a selector peer of the rule matches the identity.
pub(super) const SEL: u8 = 1;
/// `members` bit: the rule's egress named ports resolve on the identity.
pub(super) const NAMED: u8 = 2;

#[derive(Clone, Debug, Default)]
pub(super) struct RuleState {
    /// Address classes the rule's ipBlocks match.
    pub classes: Vec<u32>,
    /// Label identities the rule reaches, with SEL/NAMED bits.
    pub members: Members,
    /// Egress with named ports: NAMED applies.
    pub named_egress: bool,
    /// NAMED depends on the identity's addresses (ipBlock peers).
    pub ip_sensitive: bool,
}

#[derive(Clone, Debug)]
pub(super) struct PolicyState {
    pub parsed: ParsedPolicy,
    /// Label identities the policy selects (its namespace's), refused or
    /// not: they stay isolated.
    pub selected: BTreeSet<u32>,
    /// Parallel to `parsed.rules`; empty when refused.
    pub rules: Vec<RuleState>,
    /// Why the policy compiles to nothing (see [`super::budget`]).
    pub refused: Option<Refusal>,
    /// Entries (keys written) per local endpoint identity.
    pub keys: BTreeMap<u32, u64>,
    /// Their sum.
    pub keys_total: u64,
    /// Entries of the rules' `members`, summed.
    pub members: u64,
}

impl PolicyState {
    /// A policy not yet matched against any identity.
    pub fn unmatched(parsed: ParsedPolicy) -> Self {
        Self {
            parsed,
            selected: BTreeSet::new(),
            rules: Vec::new(),
            refused: None,
            keys: BTreeMap::new(),
            keys_total: 0,
            members: 0,
        }
    }

    /// Each rule with its state.
    pub fn rules(&self) -> impl Iterator<Item = (&Rule, &RuleState)> {
        self.parsed.rules.iter().zip(&self.rules)
    }

    /// Entries the policy holds (see [`super::budget`]).
    pub fn entries(&self) -> u64 {
        self.keys_total.saturating_add(self.members)
    }

    pub fn add_keys(&mut self, e: u32, n: u64) {
        *self.keys.entry(e).or_default() += n;
        self.keys_total += n;
    }

    pub fn remove_keys(&mut self, e: u32, n: u64) {
        if let Some(k) = self.keys.get_mut(&e) {
            *k = k.saturating_sub(n);
            if *k == 0 {
                self.keys.remove(&e);
            }
        }
        self.keys_total = self.keys_total.saturating_sub(n);
    }

    /// Drops the keys counted for endpoint `e` (its keys went at once);
    /// returns how many.
    pub fn forget_endpoint(&mut self, e: u32) -> u64 {
        let n = self.keys.remove(&e).unwrap_or(0);
        self.keys_total = self.keys_total.saturating_sub(n);
        n
    }
}

/// Which of SEL/NAMED rule `rule` has for identity `x`.
pub(super) fn member_bits(rule: &Rule, rs: &RuleState, x: &Ident) -> u8 {
    let sel = rule.selects_pod(&x.key);
    let mut bits = if sel { SEL } else { 0 };
    if rs.named_egress && evaluate::evaluate_named_port_reach(rule, sel, &x.ips) {
        bits |= NAMED;
    }
    bits
}

/// The state of `rule` against the identities in use and the classes;
/// None once it reaches more than `limit` identities (not built further).
pub(super) fn rule_state(
    rule: &Rule,
    classes: &Classes,
    idents: &BTreeMap<u32, Ident>,
    limit: u64,
) -> Option<RuleState> {
    let mut rs = RuleState {
        named_egress: rule.direction == direction::EGRESS && rule.has_named_ports(),
        ..RuleState::default()
    };
    rs.ip_sensitive =
        rs.named_egress && !matches!(rule.peers, Peers::All) && rule.blocks().next().is_some();
    let mut allowed: BTreeSet<u32> = BTreeSet::new();
    for b in rule.blocks() {
        allowed.extend(classes.allowed(b));
    }
    rs.classes = allowed.into_iter().collect();
    if rs.named_egress || rule.selector_peers().next().is_some() {
        for (x, ident) in idents {
            let bits = member_bits(rule, &rs, ident);
            if bits != 0 {
                if rs.members.len() as u64 >= limit {
                    return None;
                }
                rs.members.insert(*x, bits);
            }
        }
        rs.members.shrink_to_fit();
    }
    Some(rs)
}

/// The policies of `namespace` that select endpoint identity `e` (only a
/// policy of its own namespace can), in name order.
pub(super) fn policies_selecting<'a>(
    policies: &'a BTreeMap<PolicyRef, PolicyState>,
    namespace: &'a str,
    e: u32,
) -> impl Iterator<Item = &'a PolicyState> {
    policies
        .range(PolicyRef::new(namespace, "")..)
        .take_while(move |(k, _)| *k.namespace == *namespace)
        .map(|(_, ps)| ps)
        .filter(move |ps| ps.selected.contains(&e))
}

/// Reference counts of the prefixes valid policies carve: a policy change
/// that carves a new prefix or drops the last use of one re-carves the
/// address classes (a full recompile).
#[derive(Clone, Debug, Default)]
pub(super) struct Carving {
    refs: BTreeMap<IpNet, usize>,
}

impl Carving {
    fn prefixes(p: Option<&ParsedPolicy>) -> BTreeSet<IpNet> {
        p.filter(|p| p.is_valid())
            .map(ParsedPolicy::prefixes)
            .unwrap_or_default()
    }

    /// Whether replacing `old` by `new` changes the set of carved prefixes.
    pub fn changes(&self, old: Option<&ParsedPolicy>, new: Option<&ParsedPolicy>) -> bool {
        let (old, new) = (Self::prefixes(old), Self::prefixes(new));
        new.iter().any(|n| !self.refs.contains_key(n))
            || old
                .iter()
                .any(|n| !new.contains(n) && self.refs.get(n).is_some_and(|c| *c <= 1))
    }

    pub fn add(&mut self, p: &ParsedPolicy) {
        for net in Self::prefixes(Some(p)) {
            *self.refs.entry(net).or_insert(0) += 1;
        }
    }

    pub fn remove(&mut self, p: &ParsedPolicy) {
        for net in Self::prefixes(Some(p)) {
            if let Some(c) = self.refs.get_mut(&net) {
                *c -= 1;
                if *c == 0 {
                    self.refs.remove(&net);
                }
            }
        }
    }
}
