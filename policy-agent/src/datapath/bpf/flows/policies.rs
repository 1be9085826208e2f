//! Which policies a flow record names, from its reason and rule
//! reference: the NetworkPolicy rule of `rule.network_policy` for a
//! NetworkPolicy allow, the deciding tier's slot for a tier verdict, the
//! NetworkPolicies isolating the pod for a policy drop (no rule decided
//! it: none allowed it), and for an established flow a change denied, the
//! Deny slot that did (Admin first) or else those isolating policies.
//! A name never seen reads "unknown ...": the record is still shown.
use std::collections::{BTreeMap, BTreeSet};

use policy_common::{
    event::RuleRef,
    policy::{TierSlot, action},
    rule_name::{RuleKey, RuleName, kind},
    verdict::Reason,
};

use super::{
    record::{CLUSTER_NETWORK_POLICY, NETWORK_POLICY, PolicyRef},
    stats::RuleLabels,
};
use crate::{datapath::bpf::name_tables::NameTables, mapstate::rule_name_text};

/// The keys naming a record of `reason` starts from.
pub(super) fn rule_keys(reason: Reason, rule: &RuleRef, dir: u8, endpoint: u32) -> Vec<RuleKey> {
    match decider(reason, rule) {
        Decider::NetworkPolicy(id) => vec![RuleKey::new(kind::NETWORK_POLICY, dir, id)],
        Decider::Tier(k, slot) => vec![RuleKey::new(k, dir, slot.rank())],
        Decider::Isolating => vec![RuleKey::isolating(dir, endpoint, 0)],
        Decider::Nothing => Vec::new(),
    }
}

/// Which rule (or policies) decided a record.
enum Decider {
    NetworkPolicy(u32),
    Tier(u8, TierSlot),
    Isolating,
    Nothing,
}

fn decider(reason: Reason, rule: &RuleRef) -> Decider {
    match reason {
        Reason::AllowPolicy => Decider::NetworkPolicy(rule.network_policy),
        Reason::AllowAdminTier | Reason::DropAdminTier => Decider::Tier(kind::ADMIN, rule.admin),
        Reason::AllowBaselineTier | Reason::DropBaselineTier => {
            Decider::Tier(kind::BASELINE, rule.baseline)
        }
        Reason::DropPolicy => Decider::Isolating,
        Reason::DropPolicyChanged => {
            if rule.admin.action() == action::DENY && !rule.admin.is_none() {
                Decider::Tier(kind::ADMIN, rule.admin)
            } else if rule.baseline.action() == action::DENY && !rule.baseline.is_none() {
                Decider::Tier(kind::BASELINE, rule.baseline)
            } else {
                Decider::Isolating
            }
        }
        _ => Decider::Nothing,
    }
}

/// The metric labels of every rule `rules` names.
pub fn live_labels(rules: &BTreeMap<RuleKey, RuleName>) -> BTreeSet<RuleLabels> {
    rules
        .iter()
        .map(|(k, n)| {
            let text = rule_name_text(n);
            let (kind, namespace, rule) = match k.kind {
                kind::NETWORK_POLICY => (NETWORK_POLICY, text.namespace, n.rule_index.to_string()),
                kind::ADMIN | kind::BASELINE => (
                    CLUSTER_NETWORK_POLICY,
                    String::new(),
                    n.rule_index.to_string(),
                ),
                _ => (NETWORK_POLICY, text.namespace, String::new()),
            };
            RuleLabels {
                kind: kind.to_owned(),
                namespace,
                name: text.policy,
                rule,
                direction: policy_common::direction::name(k.direction),
            }
        })
        .collect()
}

/// The policies that decided a record of `reason` (see the module doc).
pub fn policies(
    t: &NameTables,
    reason: Reason,
    rule: &RuleRef,
    dir: u8,
    endpoint: u32,
) -> Vec<PolicyRef> {
    match decider(reason, rule) {
        Decider::NetworkPolicy(id) => vec![network_policy(t, dir, id)],
        Decider::Tier(k, slot) => vec![tier(t, k, dir, slot)],
        Decider::Isolating => isolating(t, dir, endpoint),
        Decider::Nothing => Vec::new(),
    }
}

fn unknown(id: u32) -> String {
    format!("unknown rule 0x{id:08x}")
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn network_policy(t: &NameTables, dir: u8, rule_ref: u32) -> PolicyRef {
    match t.rule(&RuleKey::new(kind::NETWORK_POLICY, dir, rule_ref)) {
        Some((text, name)) => PolicyRef {
            kind: NETWORK_POLICY.into(),
            namespace: Some(text.namespace),
            name: text.policy,
            rule: Some(u32::from(name.rule_index)),
            rule_name: non_empty(text.rule),
            tier: None,
            priority: None,
        },
        None => PolicyRef {
            kind: NETWORK_POLICY.into(),
            namespace: None,
            name: unknown(rule_ref),
            rule: None,
            rule_name: None,
            tier: None,
            priority: None,
        },
    }
}

fn tier(t: &NameTables, k: u8, dir: u8, slot: TierSlot) -> PolicyRef {
    let tier = Some(
        if k == kind::ADMIN {
            "Admin"
        } else {
            "Baseline"
        }
        .to_owned(),
    );
    match t.rule(&RuleKey::new(k, dir, slot.rank())) {
        Some((text, name)) => PolicyRef {
            kind: CLUSTER_NETWORK_POLICY.into(),
            namespace: None,
            name: text.policy,
            rule: Some(u32::from(name.rule_index)),
            rule_name: non_empty(text.rule),
            tier,
            priority: Some(name.priority),
        },
        None => PolicyRef {
            kind: CLUSTER_NETWORK_POLICY.into(),
            namespace: None,
            name: unknown(slot.rank()),
            rule: Some(slot.rule_index()),
            rule_name: None,
            tier,
            priority: Some(slot.priority()),
        },
    }
}

fn isolating_one(t: &NameTables, key: RuleKey) -> Option<PolicyRef> {
    let (text, _) = t.rule(&key)?;
    Some(PolicyRef {
        kind: NETWORK_POLICY.into(),
        namespace: Some(text.namespace),
        name: text.policy,
        rule: None,
        rule_name: non_empty(text.rule),
        tier: None,
        priority: None,
    })
}

/// The NetworkPolicies isolating `endpoint` in `dir`, from index 0 until
/// a miss; one unknown entry when none is named.
fn isolating(t: &NameTables, dir: u8, endpoint: u32) -> Vec<PolicyRef> {
    let out: Vec<PolicyRef> = (0..=u16::MAX)
        .map_while(|i| isolating_one(t, RuleKey::isolating(dir, endpoint, i)))
        .collect();
    if out.is_empty() {
        return vec![PolicyRef {
            kind: NETWORK_POLICY.into(),
            namespace: None,
            name: format!("unknown policy isolating identity {endpoint}"),
            rule: None,
            rule_name: None,
            tier: None,
            priority: None,
        }];
    }
    out
}

/// Whether a record of `reason` is a new flow judged by policy (the rest
/// are dropped packets of other kinds).
pub const fn is_new_flow(reason: Reason) -> bool {
    matches!(
        reason,
        Reason::AllowPolicy
            | Reason::AllowNotIsolated
            | Reason::AllowAdminTier
            | Reason::AllowBaselineTier
            | Reason::DropPolicy
            | Reason::DropAdminTier
            | Reason::DropBaselineTier
            | Reason::DropUpdating
    )
}
