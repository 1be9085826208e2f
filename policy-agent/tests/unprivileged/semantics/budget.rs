//! Budgets of compiled state: a policy past its budget, or past what the
//! others leave of the total, fails closed like an invalid one (it keeps
//! isolating what it selects, allows nothing, is reported) and the other
//! policies keep working; the count comes before the keys are built.
use crate::support::world::*;
use policy_agent::{
    cluster::{ClusterState, Problem, Subject, changes_between},
    identity::IdentityAllocator,
    mapstate::diff,
    policy::{Budget, CompileOptions, Compiler},
};
use policy_common::direction::INGRESS;

fn budget(per_policy: u64, total: u64) -> CompileOptions {
    CompileOptions {
        budget: Budget { per_policy, total },
        ..CompileOptions::default()
    }
}

/// `ports: [{port: 1}, …, {port: n}]`.
fn ports(n: u16) -> String {
    let list: Vec<String> = (1..=n).map(|p| format!("{{port: {p}}}")).collect();
    format!("[{}]", list.join(", "))
}

/// web, db and client in default; db open to every pod of the cluster on
/// `n` ports (3 + 3n entries: 3 identities reached, 3 × n keys for db's
/// identity); web open to client on 80 (2 entries).
fn world(n: u16) -> World {
    let mut w = World::new();
    w.pod("default/web", &[("app", "web")], &["10.0.0.10"]);
    w.pod("default/db", &[("app", "db")], &["10.0.0.20"]);
    w.pod("default/client", &[("app", "client")], &["10.0.0.30"]);
    w.policy(&format!("metadata: {{name: db}}\nspec:\n  podSelector: {{matchLabels: {{app: db}}}}\n  ingress:\n  - from: [{{namespaceSelector: {{}}}}]\n    ports: {}", ports(n)));
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: client}}}]\n    ports: [{port: 80}]");
    w
}

fn refusals(run: &Run) -> Vec<String> {
    run.compiled
        .errors
        .iter()
        .filter(|e| matches!(e.kind, policy_agent::policy::PolicyErrorKind::Refused(_)))
        .map(ToString::to_string)
        .collect()
}

#[test]
fn the_default_budgets_follow_the_policy_map_formula() {
    assert_eq!(
        Budget::for_node(110),
        Budget {
            per_policy: 56_320,
            total: 225_280
        }
    );
    assert_eq!(Budget::for_node(1).total, 16_384);
    assert_eq!(
        Budget::default().per_policy,
        u64::MAX,
        "the library's: none"
    );
}

#[test]
fn a_policy_past_its_budget_allows_nothing_and_keeps_its_pods_isolated() {
    let mut w = world(10);
    let unlimited = w.compile();
    assert!(unlimited.allows("default/client", "default/db", TCP, 7));
    assert!(refusals(&unlimited).is_empty());

    // 33 entries for db against a budget of 32; web's 2 fit.
    let run = w.compile_with(budget(32, 1000));
    assert_eq!(
        refusals(&run),
        [
            "networkpolicy default/db: spec: compiles to more than 32 entries, the per-policy budget (--policy-entries-max): it allows nothing, the pods it selects stay isolated"
        ]
    );
    assert!(run.isolated("default/db", INGRESS));
    for port in [1, 7, 10] {
        assert!(!run.allows("default/client", "default/db", TCP, port));
        assert!(!run.allows("default/web", "default/db", TCP, port));
    }
    run.check(&[
        (
            "web's policy works",
            "default/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "and still isolates",
            "default/db",
            "default/web",
            TCP,
            80,
            DENY,
        ),
    ]);
    // Reported on the policy, for a log line, the metric and an Event.
    let problem: Problem = run.compiled.errors[0].problem();
    assert!(matches!(problem.subject, Subject::Field { ref field, .. } if field == "spec"));
    assert_eq!(problem.policy(), Some(&obj("default/db")));

    // At exactly its budget it is enforced.
    let run = w.compile_with(budget(33, 1000));
    assert!(refusals(&run).is_empty());
    assert!(run.allows("default/client", "default/db", TCP, 7));
}

#[test]
fn the_budget_is_counted_before_the_keys_are_built() {
    // 300 peer identities × 60,000 ports for each of 3 endpoint
    // identities: 54 million keys if built.
    let mut w = World::new();
    for i in 0..3 {
        w.pod(
            &format!("shop/db{i}"),
            &[("app", &*format!("db{i}"))],
            &[&*format!("10.0.1.{i}")],
        );
    }
    for i in 0..300 {
        let mut p = w
            .pod(
                &format!("other/p{i}"),
                &[("n", &*format!("{i}"))],
                &[&*format!("10.1.{}.{}", i / 200, i % 200 + 1)],
            )
            .clone();
        p.node_name = Some("elsewhere".into());
        *w.pod_mut(&format!("other/p{i}")) = p;
    }
    let all: Vec<String> = ["TCP", "UDP", "SCTP"]
        .iter()
        .flat_map(|proto| (1..=20_000).map(move |p| format!("{{port: {p}, protocol: {proto}}}")))
        .collect();
    w.policy(&format!("metadata: {{name: huge, namespace: shop}}\nspec:\n  podSelector: {{}}\n  ingress:\n  - from: [{{namespaceSelector: {{}}}}]\n    ports: [{}]", all.join(", ")));
    let mut ids = IdentityAllocator::new();
    let c = Compiler::build(&w.state, &mut ids, budget(56_320, 225_280));
    assert_eq!(c.budget_use(), (0, 1), "nothing admitted, one refused");
    assert!(c.maps().policy.is_empty());
    assert!(
        c.approx_bytes() < 1 << 20,
        "{} bytes compiled",
        c.approx_bytes()
    );
}

/// Applies `w.state` to `c` as changes from `before`, checking the ops
/// against a full diff.
fn step(c: &mut Compiler, ids: &mut IdentityAllocator, before: &ClusterState, w: &World) {
    let old = c.maps().clone();
    let ops = c.apply(changes_between(before, &w.state), ids);
    assert_eq!(ops, diff(&old, c.maps()), "incremental ops are the diff");
}

#[test]
fn growth_past_the_budget_refuses_at_once_and_a_resync_takes_the_policy_back() {
    let mut w = world(10);
    let options = budget(40, 1000);
    let mut ids = IdentityAllocator::new();
    let mut c = Compiler::new(options);
    step(&mut c, &mut ids, &ClusterState::default(), &w);
    assert_eq!(c.budget_use(), (33 + 2, 0));

    // Two more pods with identities of their own: db's policy reaches 5
    // identities (5 + 50 entries), past 40.
    let before = w.state.clone();
    w.pod("default/a", &[("app", "a")], &["10.0.0.40"]);
    w.pod("default/b", &[("app", "b")], &["10.0.0.50"]);
    step(&mut c, &mut ids, &before, &w);
    assert_eq!(c.budget_use(), (2, 1), "db's policy dropped at once");
    assert!(c.maps().policy.values().count() == 1, "web's key only");
    let problems: Vec<String> = c.problems().iter().map(ToString::to_string).collect();
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("networkpolicy default/db: spec: compiles to more than 40")),
        "{problems:?}"
    );

    // They go: the policy would fit again, and comes back at the next
    // full compile (the periodic resync asks for one).
    let before = w.state.clone();
    w.state.pods.remove(&obj("default/a"));
    w.state.pods.remove(&obj("default/b"));
    step(&mut c, &mut ids, &before, &w);
    assert_eq!(c.budget_use().1, 1, "still refused until a full compile");
    c.recompile_if_refused();
    step(&mut c, &mut ids, &w.state.clone(), &w);
    assert_eq!(c.budget_use(), (33 + 2, 0));
    let full = Compiler::build(&w.state, &mut IdentityAllocator::new(), options);
    assert_eq!(c.maps().policy.len(), full.maps().policy.len());
}

#[test]
fn a_new_local_endpoint_past_the_budget_refuses_the_policy() {
    let mut w = world(10);
    let mut ids = IdentityAllocator::new();
    let mut c = Compiler::new(budget(40, 1000));
    step(&mut c, &mut ids, &ClusterState::default(), &w);
    // A second db identity on this node: 3 + 2 × 30 entries.
    let before = w.state.clone();
    w.pod("default/db2", &[("app", "db"), ("v", "2")], &["10.0.0.21"]);
    step(&mut c, &mut ids, &before, &w);
    assert_eq!(c.budget_use(), (2, 1));
    let run = Run {
        state: w.state.clone(),
        compiled: c.clone().into_compiled(),
    };
    assert!(!run.allows("default/client", "default/db", TCP, 7));
    assert!(!run.allows("default/client", "default/db2", TCP, 7));
    assert!(run.isolated("default/db2", INGRESS));
}

#[test]
fn the_total_budget_admits_the_smallest_policies_first() {
    // a-big: 3 + 3 × 10 = 33; b-mid: 3 + 3 × 5 = 18; c-small: 3 + 3 = 6.
    let mut w = world(1);
    w.remove_policy("default/db").remove_policy("default/web");
    for (name, app, n) in [
        ("a-big", "db", 10),
        ("b-mid", "web", 5),
        ("c-small", "client", 1),
    ] {
        w.policy(&format!("metadata: {{name: {name}}}\nspec:\n  podSelector: {{matchLabels: {{app: {app}}}}}\n  ingress:\n  - from: [{{namespaceSelector: {{}}}}]\n    ports: {}", ports(n)));
    }
    let run = w.compile_with(budget(1000, 40));
    assert_eq!(
        refusals(&run),
        [
            "networkpolicy default/a-big: spec: its 33 entries do not fit in what the other policies leave of the total budget of 40 (--compiled-entries-max): it allows nothing, the pods it selects stay isolated"
        ]
    );
    run.check(&[
        ("b-mid", "default/db", "default/web", TCP, 5, ALLOW),
        ("c-small", "default/db", "default/client", TCP, 1, ALLOW),
        ("a-big refused", "default/web", "default/db", TCP, 1, DENY),
    ]);
}
