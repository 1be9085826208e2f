//! Output keys: the policy-map entries one rule gives one endpoint
//! identity, removed together, or planned together (collected within a
//! budget, then written only if they fit).
//!
//! What each key means, per rule r of a policy selecting endpoint
//! identity E (in a direction the policy isolates):
//! - `from`/`to` absent: peer ANY, ports of r;
//! - each address class c an ipBlock of r matches: peer c, ports of r;
//! - each label identity X a selector peer of r matches: peer X, ports of r;
//! - egress named ports: peer X for every identity X the rule reaches,
//!   the name resolved on X (see the module doc of the compiler).
use std::collections::BTreeMap;

use policy_common::{direction, identity::ANY, policy::PolicyKey};

use super::{
    budget::Tally,
    index::Ident,
    output::Output,
    selection::{NAMED, RuleState, SEL},
};
use crate::{
    identity::LabelKey,
    policy::{
        parse::{Peers, Rule},
        ports::{PortKey, port_keys},
    },
};

/// Where the keys of a rule go.
pub(super) enum Keys<'a> {
    Remove(&'a mut Output),
    /// Collected, not written yet: the budget is checked before the maps
    /// grow, and collecting stops once past the plan's limit.
    Plan(&'a mut Plan),
}

impl Keys<'_> {
    fn done(&self) -> bool {
        matches!(self, Keys::Plan(p) if p.tally.over())
    }
}

/// Keys a policy would add, within a limit (with the entries counted
/// beside them, such as identities its rules newly reach).
#[derive(Debug)]
pub(super) struct Plan {
    pub tally: Tally,
    keys: Vec<(PolicyKey, u32)>,
}

impl Plan {
    pub fn new(limit: u64) -> Self {
        Self {
            tally: Tally::new(limit),
            keys: Vec::new(),
        }
    }

    /// Empties the plan for another policy (keeping its buffer).
    pub fn reset(&mut self, limit: u64) {
        self.tally = Tally::new(limit);
        self.keys.clear();
    }

    /// Writes the keys; `counted(e, n)`: n of them went to endpoint
    /// identity e (called once per run of keys of one endpoint).
    pub fn commit(&mut self, out: &mut Output, mut counted: impl FnMut(u32, u64)) {
        let mut run: Option<(u32, u64)> = None;
        for (key, rule_ref) in self.keys.drain(..) {
            out.add_policy(key, rule_ref);
            match &mut run {
                Some((e, n)) if *e == key.endpoint_identity => *n += 1,
                _ => {
                    if let Some((e, n)) = run.take() {
                        counted(e, n);
                    }
                    run = Some((key.endpoint_identity, 1));
                }
            }
        }
        if let Some((e, n)) = run {
            counted(e, n);
        }
    }
}

/// The ports of `rule` that do not depend on the peer.
fn base_ports(rule: &Rule, e_key: &LabelKey) -> Vec<PortKey> {
    if rule.direction == direction::INGRESS {
        // Ingress: named ports resolve on the protected pod, E.
        port_keys(&rule.ports, Some(e_key), true, true)
    } else {
        // Egress: numeric only; named ports go with each peer identity.
        port_keys(&rule.ports, None, true, false)
    }
}

/// Returns how many keys went to `keys`.
fn write_keys(
    keys: &mut Keys<'_>,
    e: u32,
    dir: u8,
    peer: u32,
    ports: &[PortKey],
    rule_ref: u32,
) -> u64 {
    match keys {
        Keys::Remove(out) => {
            for &(protocol, len, port) in ports {
                out.remove_policy(PolicyKey::new(e, dir, peer, protocol, len, port), rule_ref);
            }
        }
        Keys::Plan(plan) => {
            plan.tally.add(ports.len() as u64);
            if !plan.tally.over() {
                plan.keys.extend(ports.iter().map(|&(protocol, len, port)| {
                    (PolicyKey::new(e, dir, peer, protocol, len, port), rule_ref)
                }));
            }
        }
    }
    ports.len() as u64
}

/// The keys rule `rule` gives endpoint `e` for member `x` with `bits`
/// (`base`: the rule's peer-independent ports for `e`, when known);
/// returns how many.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_member(
    keys: &mut Keys<'_>,
    idents: &BTreeMap<u32, Ident>,
    rule: &Rule,
    base: Option<&[PortKey]>,
    e: u32,
    x: u32,
    bits: u8,
) -> u64 {
    let Some(e_ident) = idents.get(&e) else {
        return 0;
    };
    let owned;
    let base = match base {
        Some(b) => b,
        None => {
            owned = base_ports(rule, &e_ident.key);
            &owned
        }
    };
    let named = match idents.get(&x) {
        Some(x_ident) if bits & NAMED != 0 => {
            port_keys(&rule.ports, Some(&x_ident.key), false, true)
        }
        _ => Vec::new(),
    };
    let sel = bits & SEL != 0;
    let mut ports: Vec<PortKey> = if sel { base.to_vec() } else { Vec::new() };
    if !named.is_empty() {
        ports.extend(named);
        ports.sort_unstable();
        ports.dedup();
    }
    write_keys(keys, e, rule.direction, x, &ports, rule.rule_ref)
}

/// Every key rule `rule` gives endpoint `e`; returns how many (a plan
/// stops early once past its limit).
pub(super) fn write_rule(
    keys: &mut Keys<'_>,
    idents: &BTreeMap<u32, Ident>,
    rule: &Rule,
    rs: &RuleState,
    e: u32,
) -> u64 {
    let Some(e_ident) = idents.get(&e) else {
        return 0;
    };
    let base = base_ports(rule, &e_ident.key);
    let mut n = 0;
    if matches!(rule.peers, Peers::All) {
        n += write_keys(keys, e, rule.direction, ANY, &base, rule.rule_ref);
    }
    for c in &rs.classes {
        n += write_keys(keys, e, rule.direction, *c, &base, rule.rule_ref);
    }
    for (x, bits) in &rs.members {
        if keys.done() {
            break;
        }
        n += write_member(keys, idents, rule, Some(&base), e, *x, *bits);
    }
    n
}
