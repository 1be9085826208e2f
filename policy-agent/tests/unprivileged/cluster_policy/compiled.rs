//! The compiled maps, judged by the classifier's model, against the
//! reference evaluator: every pod pair of the conformance world, both
//! directions, ports and protocols the upstream tests poke.
use policy_agent::cluster::{ClusterState, ObjectRef};
use policy_agent::policy::cluster_policy::{
    ClusterNetworkPolicy, Connection, ParsedClusterPolicy, PodView, Remote, decide,
};
use policy_common::{
    direction,
    proto::{SCTP, TCP, UDP},
};

use super::upstream::{BASELINE_DEFAULT, INGRESS_TCP, PASS_EXAMPLE};
use crate::support::world::{World, named_port, obj};

const HOUSES: [&str; 4] = ["gryffindor", "slytherin", "hufflepuff", "ravenclaw"];

/// Two pods per house, each serving web (TCP 80) and dns (UDP 53).
fn world() -> World {
    let mut w = World::new();
    for (h, house) in HOUSES.iter().enumerate() {
        let ns = format!("network-policy-conformance-{house}");
        w.ns(&ns, &[("conformance-house", house)]);
        for i in 0..2 {
            let pod = w.pod(
                &format!("{ns}/{house}-{i}"),
                &[("conformance-house", house)],
                &[
                    &format!("10.0.{h}.{}", 10 + i),
                    &format!("fd00::{h}:{}", 10 + i),
                ],
            );
            pod.ports = vec![named_port("web", TCP, 80), named_port("dns", UDP, 53)].into();
        }
    }
    w
}

/// Whether the maps' verdicts equal the evaluator's for every ordered pod
/// pair and probe; `np` is the NetworkPolicy tier's word per (pod, dir).
fn check(
    w: &mut World,
    policies: &[ParsedClusterPolicy],
    np: impl Fn(&str, u8, &str) -> Option<bool>,
) {
    let run = w.compile_all_local();
    assert!(run.compiled.errors.is_empty(), "{:?}", run.compiled.errors);
    let state = &run.state;
    let pods: Vec<_> = state.pods.iter().collect();
    fn view<'a>(state: &'a ClusterState, k: &'a ObjectRef) -> PodView<'a> {
        let info = &state.pods[k];
        PodView {
            namespace: &k.namespace,
            namespace_labels: &state.namespaces[&*k.namespace].labels,
            labels: &info.labels,
            ports: &info.ports,
        }
    }
    let view = |k| view(state, k);
    let mut checked = 0;
    for (a, ai) in &pods {
        for (b, bi) in &pods {
            if a == b {
                continue;
            }
            for (protocol, port) in [(TCP, 80), (TCP, 8080), (UDP, 53), (UDP, 5353), (SCTP, 9003)] {
                for (s, d) in ai.ips.iter().zip(&bi.ips) {
                    let want_egress = decide(
                        policies,
                        &Connection {
                            direction: direction::EGRESS,
                            subject: view(a),
                            remote: Remote::Pod {
                                pod: view(b),
                                ip: *d,
                            },
                            protocol,
                            port,
                        },
                        np(&a.to_string(), direction::EGRESS, &b.to_string()),
                    )
                    .0;
                    let want_ingress = decide(
                        policies,
                        &Connection {
                            direction: direction::INGRESS,
                            subject: view(b),
                            remote: Remote::Pod {
                                pod: view(a),
                                ip: *s,
                            },
                            protocol,
                            port,
                        },
                        np(&b.to_string(), direction::INGRESS, &a.to_string()),
                    )
                    .0;
                    let want = want_egress.allows() && want_ingress.allows();
                    let got =
                        run.allows_ips(&a.to_string(), *s, &b.to_string(), *d, protocol, port);
                    assert_eq!(
                        got, want,
                        "{a} ({s}) -> {b} ({d}) {protocol}/{port}: maps {got}, evaluator egress {want_egress:?} ingress {want_ingress:?}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 500, "{checked}");
}

fn parsed(yaml: &str) -> ParsedClusterPolicy {
    let wire: ClusterNetworkPolicy = serde_yaml::from_str(yaml).unwrap();
    ParsedClusterPolicy::parse(&wire)
}

#[test]
fn admin_rules_in_order_compile_to_what_the_evaluator_says() {
    let mut w = world();
    w.cluster_policy(INGRESS_TCP);
    check(&mut w, &[parsed(INGRESS_TCP)], |_, _, _| None);
}

/// The integration scenario: Admin Pass to a NetworkPolicy that isolates
/// gryffindor both ways, Baseline Deny behind it; then without the
/// NetworkPolicy.
#[test]
fn pass_reaches_network_policy_then_baseline() {
    let pass = PASS_EXAMPLE.replace("action: \"Deny\"", "action: \"Pass\"");
    let np = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-gress-from-to-slytherin-to-gryffindor
  namespace: network-policy-conformance-gryffindor
spec:
  podSelector: {}
  policyTypes: [Ingress, Egress]
  ingress:
  - from:
    - namespaceSelector:
        matchLabels:
          conformance-house: slytherin
  egress:
  - to:
    - namespaceSelector:
        matchLabels:
          conformance-house: slytherin
"#;
    let policies = [parsed(&pass), parsed(BASELINE_DEFAULT)];
    let mut w = world();
    w.cluster_policy(&pass)
        .cluster_policy(BASELINE_DEFAULT)
        .policy(np);
    // The NetworkPolicy isolates gryffindor's pods and allows slytherin.
    let np_word = |pod: &str, _dir: u8, peer: &str| {
        pod.starts_with("network-policy-conformance-gryffindor/")
            .then(|| peer.starts_with("network-policy-conformance-slytherin/"))
    };
    check(&mut w, &policies, np_word);
    // Without it the Baseline Deny decides.
    w.remove_policy(
        "network-policy-conformance-gryffindor/allow-gress-from-to-slytherin-to-gryffindor",
    );
    check(&mut w, &policies, |_, _, _| None);
    // And with the Admin tier denying, nothing of slytherin passes.
    let mut w2 = world();
    w2.cluster_policy(PASS_EXAMPLE)
        .cluster_policy(BASELINE_DEFAULT)
        .policy(np);
    check(
        &mut w2,
        &[parsed(PASS_EXAMPLE), parsed(BASELINE_DEFAULT)],
        np_word,
    );
}

/// `explain` agrees with the maps under tiers and names the rule that
/// decided: its tier, policy, priority, index and name, and where a Pass
/// handed the flow on.
#[test]
fn explain_names_the_tier_rule() {
    use policy_agent::policy::{ExplainQuery, FlowEnd, explain};
    let mut w = world();
    let pass = PASS_EXAMPLE.replace("action: \"Deny\"", "action: \"Pass\"");
    w.cluster_policy(&pass).cluster_policy(BASELINE_DEFAULT);
    let run = w.compile_all_local();
    let pod = |s: &str| FlowEnd::Pod(obj(s));
    let q = ExplainQuery {
        src: pod("network-policy-conformance-slytherin/slytherin-0"),
        dst: pod("network-policy-conformance-gryffindor/gryffindor-0"),
        protocol: TCP,
        port: 80,
    };
    let ex = explain(&run.state, &run.compiled, &q).unwrap();
    assert!(ex.consistent(), "{ex}");
    assert!(!ex.allowed, "{ex}");
    let ingress = ex.ingress.as_ref().unwrap();
    assert_eq!(ingress.map_reason, "drop_baseline_tier", "{ex}");
    let tier = ingress.tier.as_ref().unwrap();
    assert_eq!(
        (
            tier.tier.as_str(),
            tier.policy.as_str(),
            tier.priority,
            tier.rule_index
        ),
        ("Baseline", "default", 10, 0),
        "{ex}"
    );
    assert_eq!(tier.rule_name, "deny-all-ingress-from-slytherin");
    let text = ex.to_string();
    assert!(
        text.contains("Baseline tier: clusternetworkpolicy default (priority 10)"),
        "{text}"
    );
    // With the Admin rule a Deny, it decides and is named.
    w.cluster_policy(PASS_EXAMPLE);
    let run = w.compile_all_local();
    let ex = explain(&run.state, &run.compiled, &q).unwrap();
    assert!(ex.consistent(), "{ex}");
    let tier = ex.ingress.as_ref().unwrap().tier.clone().unwrap();
    assert_eq!(
        (tier.tier.as_str(), tier.action.as_str()),
        ("Admin", "Deny"),
        "{ex}"
    );
}

/// A policy whose entries pass the per-policy budget fails closed: its
/// Accept rules match nothing, its Deny and Pass rules deny everything to
/// the pods it selects; it is reported, and its status says so.
#[test]
fn a_policy_past_the_budget_fails_closed_and_says_so() {
    use policy_agent::policy::{Budget, CompileOptions, Compiler};
    use policy_common::{identity::ANY, policy::action};
    let mut w = world();
    w.cluster_policy(INGRESS_TCP);
    let options = CompileOptions {
        all_pods_local: true,
        budget: Budget {
            per_policy: 3,
            total: u64::MAX,
        },
    };
    let c = Compiler::build(&w.state, &mut w.ids, options);
    let maps = c.maps();
    let subjects: Vec<u32> = maps
        .endpoints
        .iter()
        .filter(|(p, _)| p.namespace.ends_with("gryffindor"))
        .map(|(_, e)| e.identity)
        .collect();
    assert!(!subjects.is_empty());
    for id in &subjects {
        let any: Vec<_> = maps
            .policy_of(*id)
            .filter(|(k, _)| k.peer_identity == ANY && k.port_prefix_len == 0)
            .collect();
        assert!(
            any.iter()
                .any(|(_, e)| !e.admin.is_none() && e.admin.action() == action::DENY),
            "identity {id}: {any:?}"
        );
    }
    assert!(
        maps.policy
            .values()
            .all(|e| e.admin.is_none() || e.admin.action() != action::ACCEPT),
        "no Accept survives"
    );
    let problems = c.problems();
    assert!(
        problems
            .iter()
            .any(|p| p.to_string().contains("over the budget of 3 per policy")),
        "{problems:?}"
    );
    let standing = &c.cluster_policy_standings()["ingress-tcp"];
    assert!(standing.problems.iter().any(|p| p.contains("fails closed")));
    // Within the budget: as written.
    let c = Compiler::build(&w.state, &mut w.ids, CompileOptions::default());
    assert!(
        c.cluster_policy_standings()["ingress-tcp"]
            .problems
            .is_empty()
    );
}
