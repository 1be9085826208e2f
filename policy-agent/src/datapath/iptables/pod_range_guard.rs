//! The pod-range guard on the iptables datapath (the node's pod ranges; the BPF one is
//! `policy_common::pod_range_guard`): per family a `hash:ip` set of the enforced
//! local addresses (pods whose chains are installed, and the node's own)
//! and, first in the agent's FORWARD chain, a drop of whatever comes from
//! or goes to an address in the pod ranges that is not in it:
//! ```text
//! pa-agent:FORWARD:  -s <range> -m set ! --match-set pa-agent:L-…-4 src -j DROP
//!                    -d <range> -m set ! --match-set pa-agent:L-…-4 dst -j DROP
//!                    (then source validation, RELATED,ESTABLISHED, …)
//! ```
//! First, so an established flow to an address that stops being enforced
//! (its pod went, a new one has it) stops too. Traffic between a pod and
//! its node is INPUT/OUTPUT and never meets it. A new pod's address joins
//! the set only once its chains are installed (the driver applies twice:
//! see `driver.rs`).
use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;

use super::ruleset::{FORWARD_CHAIN, Family, IpSet, Ruleset, SetKind, SetName};
use crate::mapstate::fnv1a64;

/// The enforced set's name in `fam`.
pub fn set_name(fam: Family) -> String {
    SetName {
        kind: SetKind::Enforced,
        hash: fnv1a64(b"enforced local addresses"),
    }
    .render(fam)
}

fn family_of(ip: &IpAddr) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

/// Adds the sets and the leading FORWARD rules for `ranges`, with
/// `enforced` in the sets. Without ranges in a family, nothing.
pub fn add(ruleset: &mut Ruleset, ranges: &[IpNet], enforced: &BTreeSet<IpAddr>) {
    for fam in Family::BOTH {
        let fam_ranges: Vec<&IpNet> = ranges.iter().filter(|n| Family::of(n) == fam).collect();
        if fam_ranges.is_empty() {
            continue;
        }
        let name = set_name(fam);
        ruleset
            .sets
            .insert(name.clone(), enforced_set(&name, fam, enforced));
        let Some(forward) = ruleset
            .chains
            .entry(fam)
            .or_default()
            .iter_mut()
            .find(|c| c.name == FORWARD_CHAIN)
        else {
            continue;
        };
        let mut lead = Vec::new();
        for net in fam_ranges {
            for (side, set_side) in [("-s", "src"), ("-d", "dst")] {
                lead.push(format!(
                    "{side} {net} -m set ! --match-set {name} {set_side} -m comment --comment \"{COMMENT}\" -j DROP"
                ));
            }
        }
        forward.rules.splice(0..0, lead);
    }
}

/// The comment on the guard's drops.
const COMMENT: &str = "pa-agent: unenforced";

/// The ranges of the guard's drops in `iptables-save` output: what an
/// earlier agent installed, kept until the node's ranges are known.
pub fn installed_ranges(save: &str) -> Vec<IpNet> {
    let prefix = format!("-A {FORWARD_CHAIN} -s ");
    save.lines()
        .filter(|l| l.contains(COMMENT))
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter_map(|net| net.parse::<IpNet>().ok())
        .map(|n| n.trunc())
        .collect()
}

fn enforced_set(name: &str, fam: Family, enforced: &BTreeSet<IpAddr>) -> IpSet {
    IpSet {
        name: name.to_owned(),
        kind: SetKind::Enforced,
        family: fam,
        entries: enforced
            .iter()
            .filter(|ip| family_of(ip) == fam)
            .map(|ip| (IpNet::from(*ip), false))
            .collect(),
    }
}

/// Replaces the enforced sets' content (the chains stay as they are).
pub fn set_enforced(ruleset: &mut Ruleset, enforced: &BTreeSet<IpAddr>) {
    for fam in Family::BOTH {
        let name = set_name(fam);
        if ruleset.sets.contains_key(&name) {
            ruleset
                .sets
                .insert(name.clone(), enforced_set(&name, fam, enforced));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::iptables::{Chain, is_own_set};

    #[test]
    fn the_drops_come_first_and_name_an_own_set() {
        let mut r = Ruleset::default();
        r.chains.insert(
            Family::V4,
            vec![Chain {
                name: FORWARD_CHAIN.into(),
                rules: vec!["-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN".into()],
            }],
        );
        let ranges: Vec<IpNet> = vec!["10.244.1.0/24".parse().unwrap()];
        let enforced: BTreeSet<IpAddr> = ["10.244.1.5".parse().unwrap()].into();
        add(&mut r, &ranges, &enforced);
        let name = set_name(Family::V4);
        assert!(is_own_set(&name), "{name}");
        let rules = &r.chains[&Family::V4][0].rules;
        assert_eq!(rules.len(), 3);
        assert!(rules[0].starts_with(&format!("-s 10.244.1.0/24 -m set ! --match-set {name} src")));
        assert!(rules[1].starts_with(&format!("-d 10.244.1.0/24 -m set ! --match-set {name} dst")));
        assert_eq!(r.sets[&name].entries.len(), 1);
        // No IPv6 range: no IPv6 set, no IPv6 rules.
        assert!(!r.sets.contains_key(&set_name(Family::V6)));
    }

    #[test]
    fn the_installed_ranges_are_read_back_from_iptables_save() {
        let name = set_name(Family::V4);
        let save = format!(
            "*filter\n:{FORWARD_CHAIN} - [0:0]\n-A {FORWARD_CHAIN} -m comment --comment \"policy-agent:00ff\"\n-A {FORWARD_CHAIN} -s 10.244.1.0/24 -m set ! --match-set {name} src -m comment --comment \"{COMMENT}\" -j DROP\n-A {FORWARD_CHAIN} -d 10.244.1.0/24 -m set ! --match-set {name} dst -m comment --comment \"{COMMENT}\" -j DROP\n-A {FORWARD_CHAIN} -s 10.0.0.0/8 -j RETURN\nCOMMIT\n"
        );
        let got: Vec<String> = installed_ranges(&save)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["10.244.1.0/24"]);
    }
}
