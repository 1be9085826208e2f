//! Output keys: the policy-map entries one rule gives one endpoint
//! identity, added or removed together.
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

/// Add or remove.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Write {
    Add,
    Remove,
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

fn write_keys(
    out: &mut Output,
    e: u32,
    dir: u8,
    peer: u32,
    ports: &[PortKey],
    rule_ref: u32,
    w: Write,
) {
    for &(protocol, len, port) in ports {
        let key = PolicyKey::new(e, dir, peer, protocol, len, port);
        match w {
            Write::Add => out.add_policy(key, rule_ref),
            Write::Remove => out.remove_policy(key, rule_ref),
        }
    }
}

/// The keys rule `rule` gives endpoint `e` for member `x` with `bits`
/// (`base`: the rule's peer-independent ports for `e`, when known).
#[allow(clippy::too_many_arguments)]
pub(super) fn write_member(
    out: &mut Output,
    idents: &BTreeMap<u32, Ident>,
    rule: &Rule,
    base: Option<&[PortKey]>,
    e: u32,
    x: u32,
    bits: u8,
    w: Write,
) {
    let Some(e_ident) = idents.get(&e) else {
        return;
    };
    let mut ports: Vec<PortKey> = Vec::new();
    if bits & SEL != 0 {
        match base {
            Some(b) => ports.extend_from_slice(b),
            None => ports = base_ports(rule, &e_ident.key),
        }
    }
    if bits & NAMED != 0
        && let Some(x_ident) = idents.get(&x)
    {
        ports.extend(port_keys(&rule.ports, Some(&x_ident.key), false, true));
        ports.sort_unstable();
        ports.dedup();
    }
    write_keys(out, e, rule.direction, x, &ports, rule.rule_ref, w);
}

/// Every key rule `rule` gives endpoint `e`.
pub(super) fn write_rule(
    out: &mut Output,
    idents: &BTreeMap<u32, Ident>,
    rule: &Rule,
    rs: &RuleState,
    e: u32,
    w: Write,
) {
    let Some(e_ident) = idents.get(&e) else {
        return;
    };
    let base = base_ports(rule, &e_ident.key);
    if matches!(rule.peers, Peers::All) {
        write_keys(out, e, rule.direction, ANY, &base, rule.rule_ref, w);
    }
    for c in &rs.classes {
        write_keys(out, e, rule.direction, *c, &base, rule.rule_ref, w);
    }
    for (x, bits) in &rs.members {
        write_member(out, idents, rule, Some(&base), e, *x, *bits, w);
    }
}
