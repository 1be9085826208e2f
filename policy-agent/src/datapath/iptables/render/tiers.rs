//! ClusterNetworkPolicy tiers as chains: the same decision the classifier
//! takes from its folded tier slots (`policy_common::policy::Tiers`).
//!
//! The classifier folds every entry a new flow matches and keeps the best
//! slot of each tier: the rule of lowest rank. iptables takes the first
//! rule that matches. So a tier chain holds each key the tier has a rule
//! for, best rank first, and its first match is the classifier's best
//! slot:
//! ```text
//! I-/E-<pod>:  clear mark
//!              -> <Admin chain>; mark set -> RETURN     (Admin Accept)
//!              isolated by a NetworkPolicy:
//!                  hairpin -> RETURN                    (itself via a Service)
//!                  -> P-<policy>...; mark set -> RETURN; DROP
//!              not isolated:
//!                  -> <Baseline chain>; RETURN          (the default allows)
//! tier chain:  <key> -> set mark, RETURN                (Accept)
//!              <key> -> DROP                            (Deny)
//!              <key> -> RETURN                          (Pass: the next tier)
//! ```
//! What such a pod sends the node itself never crosses FORWARD: INPUT
//! sends it (after the pod's source check, tracked flows aside) to a
//! chain of its own, where the tiers decide and the NetworkPolicy tier
//! allows (node traffic is always allowed there), as the classifier does:
//! ```text
//! N-<pod>:     clear mark; -> <Admin chain>; mark set -> RETURN
//!              not isolated: -> <Baseline chain>
//!              RETURN
//! ```
//! "Policy tiers are evaluated in the following order: Admin tier,
//! NetworkPolicy tier, Baseline tier. [...] v1.NetworkPolicy always makes
//! a final decision for selected pods. Further evaluation only happens for
//! Pods not selected by a v1.NetworkPolicy."
use policy_common::{
    direction,
    policy::{PolicyKey, TierSlot, action},
};

use super::{
    super::ruleset::{Chain, ChainKind},
    PodEntry,
    ports::Span,
};
use crate::{cluster::PodRef, mapstate::MapState};

/// The keys one tier has a rule for, for one endpoint identity and
/// direction, best rank first.
pub(super) type TierKeys = Vec<(PolicyKey, TierSlot)>;

/// The Admin and Baseline keys of `identity` in `dir`.
pub(super) fn tier_keys(maps: &MapState<PodRef>, identity: u32, dir: u8) -> [TierKeys; 2] {
    let mut admin = TierKeys::new();
    let mut baseline = TierKeys::new();
    for (key, entry) in maps.policy_of(identity).filter(|(k, _)| k.direction == dir) {
        if !entry.admin.is_none() {
            admin.push((*key, entry.admin));
        }
        if !entry.baseline.is_none() {
            baseline.push((*key, entry.baseline));
        }
    }
    for keys in [&mut admin, &mut baseline] {
        keys.sort_by_key(|(k, slot)| (slot.rank(), *k));
    }
    [admin, baseline]
}

/// A tier chain's name in the policy-chain namespace (a NetworkPolicy's
/// is `namespace/name`, which always holds a slash: no clash).
pub(super) fn chain_label(tier: usize) -> &'static str {
    if tier == 0 {
        "ClusterNetworkPolicy Admin tier"
    } else {
        "ClusterNetworkPolicy Baseline tier"
    }
}

/// The rules of one tier chain. `keys`: merged into port ranges (see
/// `coalesce`), best rank first. `matches(span)` is its peer and port
/// match (None: its peer's set cannot be named). A key whose peer cannot
/// be matched fails closed: an Accept is left out, a Deny or a Pass drops
/// whatever its ports match (more than written, never less).
///
/// `record(slot)` is the record chain of an Accept or Deny (None: records
/// are off): it marks or drops itself, and logs.
pub(super) fn tier_rules(
    keys: &[(Span, TierSlot)],
    mut matches: impl FnMut(&Span) -> Option<String>,
    port_only: impl Fn(&Span) -> String,
    record: &mut dyn FnMut(TierSlot) -> Option<String>,
    mark: &str,
    dir: u8,
) -> Vec<String> {
    let mut rules = Vec::new();
    for (key, slot) in keys {
        let comment = format!(
            "-m comment --comment \"{} rank {}\" ",
            direction::name(dir),
            slot.rank()
        );
        let Some(m) = matches(key) else {
            if slot.action() != action::ACCEPT {
                rules.push(format!("{}{comment}-j DROP", port_only(key)));
            }
            continue;
        };
        match slot.action() {
            action::ACCEPT => {
                let target =
                    record(*slot).unwrap_or_else(|| format!("MARK --set-xmark {mark}/{mark}"));
                rules.push(format!("{m}{comment}-j {target}"));
                rules.push(format!("{m}{comment}-j RETURN"));
            }
            action::DENY => {
                let target = record(*slot).unwrap_or_else(|| "DROP".into());
                rules.push(format!("{m}{comment}-j {target}"));
            }
            _ => rules.push(format!("{m}{comment}-j RETURN")),
        }
    }
    rules
}

/// The chain judging what pod `p` (its egress judged by tiers) sends the
/// node: `jumps` are its Admin and Baseline chains.
pub(super) fn to_node_chain(
    p: &PodEntry<'_>,
    jumps: &[Option<String>; 2],
    failed: bool,
    isolated: bool,
    mark: &str,
) -> Chain {
    let name = ChainKind::ToNode.name(p.chain_hash);
    let mut rules = vec![format!("-j MARK --set-xmark 0x0/{mark}")];
    if failed {
        rules.push("-j DROP".into());
    }
    if let Some(admin) = &jumps[0] {
        rules.push(format!("-j {admin}"));
        rules.push(format!("-m mark --mark {mark}/{mark} -j RETURN"));
    }
    if let (false, Some(baseline)) = (isolated, &jumps[1]) {
        rules.push(format!("-j {baseline}"));
    }
    rules.push("-j RETURN".into());
    Chain { name, rules }
}

/// The INPUT rules sending what the pod at `ifname` sends the node to
/// `chain`: a flow tracked and not revoked (the node's own, answered by
/// the pod, or one allowed before) passes first, and in IPv6 what cannot
/// leave the link (neighbour discovery to a multicast or link-local
/// address, as the classifier lets it pass).
pub(super) fn to_node_rules(ifname: &str, chain: &str, mark: &str, v6: bool) -> Vec<String> {
    let mut rules = vec![format!(
        "-i {ifname} -m connmark ! --mark {mark}/{mark} -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN"
    )];
    if v6 {
        for on_link in ["ff00::/8", "fe80::/10"] {
            rules.push(format!("-i {ifname} -d {on_link} -j RETURN"));
        }
    }
    rules.push(format!("-i {ifname} -j {chain}"));
    rules
}
