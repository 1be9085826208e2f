//! `RULE_NAMES` in the compiled maps: a name for exactly the rules the
//! policy entries reference (a NetworkPolicy's, and the ClusterNetworkPolicy
//! rules of both tiers) and for the policies isolating each endpoint
//! identity, kept so by incremental changes, and written around the
//! entries in the order `dump` can rely on.
use std::collections::BTreeSet;

use policy_agent::{
    cluster::{ClusterState, changes_between},
    mapstate::{MapOp, MapState, RuleText, rule_name_text},
    policy::{CompileOptions, Compiler},
};
use policy_common::{
    direction,
    rule_name::{NO_RULE, RuleKey, RuleName, kind},
};

use super::upstream::{BASELINE_DEFAULT, PASS_EXAMPLE};
use crate::support::world::World;

const NP: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-from-slytherin
  namespace: gryffindor
spec:
  podSelector: {}
  ingress:
  - from:
    - namespaceSelector:
        matchLabels:
          conformance-house: slytherin
"#;

/// Selects no pod: its rule produces no entry, so it is not named.
const NP_SELECTING_NOTHING: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: nobody
  namespace: gryffindor
spec:
  podSelector:
    matchLabels:
      app: none
  ingress:
  - {}
"#;

fn world() -> World {
    let mut w = World::new();
    for (h, house) in ["gryffindor", "slytherin"].iter().enumerate() {
        w.ns(house, &[("conformance-house", house)]);
        w.pod(
            &format!("{house}/{house}-0"),
            &[("conformance-house", house)],
            &[&format!("10.0.{h}.10")],
        );
    }
    // The shared examples select houses by the `conformance-house` label.
    w.policy(NP)
        .policy(NP_SELECTING_NOTHING)
        .cluster_policy(PASS_EXAMPLE)
        .cluster_policy(BASELINE_DEFAULT);
    w
}

const OPTIONS: CompileOptions = CompileOptions {
    all_pods_local: true,
    budget: policy_agent::policy::Budget {
        per_policy: u64::MAX,
        total: u64::MAX,
    },
};

fn names(maps: &MapState<policy_agent::cluster::PodRef>) -> Vec<(RuleKey, RuleText, RuleName)> {
    maps.rule_names
        .iter()
        .map(|(k, n)| (*k, rule_name_text(n), *n))
        .collect()
}

/// The table's keys of rules (not of isolating policies).
fn rule_keys(maps: &MapState<policy_agent::cluster::PodRef>) -> BTreeSet<RuleKey> {
    maps.rule_names
        .keys()
        .filter(|k| k.kind != kind::ISOLATING)
        .copied()
        .collect()
}

/// The isolating policies named for `identity` in `dir`, in index order.
fn isolating(
    maps: &MapState<policy_agent::cluster::PodRef>,
    identity: u32,
    dir: u8,
) -> Vec<String> {
    (0..)
        .map_while(|i| maps.rule_names.get(&RuleKey::isolating(dir, identity, i)))
        .map(|n| {
            assert_eq!(n.rule_index, NO_RULE);
            rule_name_text(n).qualified()
        })
        .collect()
}

#[test]
fn the_policies_isolating_an_identity_are_named_per_direction() {
    let mut w = world();
    let c = Compiler::build(&w.state, &mut w.ids, OPTIONS);
    let maps = c.maps();
    let id = |pod: &str| maps.endpoints[&crate::support::world::obj(pod)].identity;
    let (g, s) = (id("gryffindor/gryffindor-0"), id("slytherin/slytherin-0"));
    assert_eq!(
        isolating(maps, g, direction::INGRESS),
        ["gryffindor/allow-from-slytherin"]
    );
    assert!(isolating(maps, g, direction::EGRESS).is_empty());
    assert!(isolating(maps, s, direction::INGRESS).is_empty());

    // A second policy isolating both ways: both named, by name; and
    // incrementally as a full compile would.
    let before_state = w.state.clone();
    let mut inc = c.clone();
    w.policy(
        r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: a-deny-all
  namespace: gryffindor
spec:
  podSelector: {}
  policyTypes: [Ingress, Egress]
"#,
    );
    inc.apply(changes_between(&before_state, &w.state), &mut w.ids);
    let maps = inc.maps();
    assert_eq!(
        isolating(maps, g, direction::INGRESS),
        ["gryffindor/a-deny-all", "gryffindor/allow-from-slytherin"]
    );
    assert_eq!(
        isolating(maps, g, direction::EGRESS),
        ["gryffindor/a-deny-all"]
    );
    let full = Compiler::build(&w.state, &mut w.ids.clone(), OPTIONS);
    assert_eq!(maps.rule_names, full.maps().rule_names);

    // Removed again: its names go, nothing is left past the list.
    let added_state = w.state.clone();
    w.remove_policy("gryffindor/a-deny-all");
    inc.apply(changes_between(&added_state, &w.state), &mut w.ids);
    let maps = inc.maps();
    assert_eq!(
        isolating(maps, g, direction::INGRESS),
        ["gryffindor/allow-from-slytherin"]
    );
    assert!(isolating(maps, g, direction::EGRESS).is_empty());
    assert!(
        !maps
            .rule_names
            .contains_key(&RuleKey::isolating(direction::INGRESS, g, 1))
    );
    assert_eq!(maps.rule_names, c.maps().rule_names);
}

#[test]
fn the_table_names_exactly_the_referenced_rules() {
    let mut w = world();
    let c = Compiler::build(&w.state, &mut w.ids, OPTIONS);
    let maps = c.maps();
    assert_eq!(rule_keys(maps), maps.referenced_rules());

    let named = names(maps);
    let find = |kind: u8, dir: u8| {
        named
            .iter()
            .find(|(k, ..)| k.kind == kind && k.direction == dir)
            .unwrap_or_else(|| panic!("no rule of kind {kind} {dir}: {named:?}"))
    };
    // The NetworkPolicy's ingress rule 0, by its rule_ref.
    let (k, t, n) = find(kind::NETWORK_POLICY, direction::INGRESS);
    assert_eq!(t.qualified(), "gryffindor/allow-from-slytherin");
    assert_eq!((n.rule_index, n.priority, t.rule.as_str()), (0, 0, ""));
    assert!(maps.policy.values().any(|e| e.rule_ref == k.id));
    // The Admin tier's rules: ingress and egress rule 0 share a rank,
    // told apart by direction.
    let (ki, ti, ni) = find(kind::ADMIN, direction::INGRESS);
    let (ke, te, _) = find(kind::ADMIN, direction::EGRESS);
    assert_eq!(ki.id, ke.id);
    assert_eq!(
        (ti.namespace.as_str(), ti.policy.as_str(), ni.priority),
        ("", "pass-example", 10)
    );
    assert_eq!(ti.rule, "deny-all-ingress-from-slytherin");
    assert_eq!(te.rule, "deny-all-egress-to-slytherin");
    let (_, tb, nb) = find(kind::BASELINE, direction::INGRESS);
    assert_eq!((tb.policy.as_str(), nb.priority), ("default", 10));
    assert_eq!(tb.rule, "deny-all-ingress-from-slytherin");
    // Nothing for a rule no entry references.
    assert!(
        named.iter().all(|(_, t, _)| t.policy != "nobody"),
        "{named:?}"
    );
}

#[test]
fn incremental_changes_keep_the_table_exact_and_ordered() {
    let mut w = world();
    let mut c = Compiler::new(OPTIONS);
    c.apply(
        changes_between(&ClusterState::default(), &w.state),
        &mut w.ids,
    );
    let before_state = w.state.clone();
    let before = c.maps().clone();
    assert!(
        names(&before)
            .iter()
            .any(|(_, t, _)| t.policy == "allow-from-slytherin")
    );

    // The NetworkPolicy goes: its entries first, then its name.
    w.remove_policy("gryffindor/allow-from-slytherin");
    let ops = c.apply(changes_between(&before_state, &w.state), &mut w.ids);
    let maps = c.maps();
    assert_eq!(rule_keys(maps), maps.referenced_rules());
    assert!(
        names(maps)
            .iter()
            .all(|(_, t, _)| t.policy != "allow-from-slytherin")
    );
    let gone = ops
        .iter()
        .position(|o| matches!(o, MapOp::DeleteRuleName(k) if k.kind == kind::NETWORK_POLICY))
        .unwrap_or_else(|| panic!("no name removal: {ops:?}"));
    let last_policy_write = ops
        .iter()
        .rposition(|o| matches!(o, MapOp::DeletePolicy(_) | MapOp::UpsertPolicy(..)))
        .unwrap();
    assert!(gone > last_policy_write, "{ops:?}");
    // As a full compile of the same state.
    let full = Compiler::build(&w.state, &mut w.ids.clone(), OPTIONS);
    assert_eq!(maps.rule_names, full.maps().rule_names);

    // And back: the name lands before the first entry naming it.
    let removed_state = w.state.clone();
    w.policy(NP);
    let ops = c.apply(changes_between(&removed_state, &w.state), &mut w.ids);
    let named_at = ops
        .iter()
        .position(|o| matches!(o, MapOp::UpsertRuleName(k, _) if k.kind == kind::NETWORK_POLICY))
        .unwrap_or_else(|| panic!("no name upsert: {ops:?}"));
    let first_policy_write = ops
        .iter()
        .position(|o| matches!(o, MapOp::UpsertPolicy(..)))
        .unwrap();
    assert!(named_at < first_policy_write, "{ops:?}");
    assert_eq!(c.maps().rule_names, before.rule_names);
}
