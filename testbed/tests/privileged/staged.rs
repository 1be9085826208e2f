//! Staged policies on a simulated node, on both datapaths: a staged
//! deny-all (and a staged Admin Deny) changes no verdict (judged at the receiver), every flow it
//! would drop is reported (flow records, the staged report, /metrics),
//! and removing the annotation enforces it. Needs root.
use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use policy_testbed::{
    connectivity::Transport,
    fixtures::conformance::{Backend, Conformance, is_node},
};
use serde_json::Value;

/// A staged policy at beta/db's ingress, and what it would do.
struct Case {
    /// The manifest, staged or not.
    yaml: fn(bool) -> String,
    /// Whether a flow from this pod to beta/db would be dropped.
    drops_from: fn(&str) -> bool,
    /// The staged verdict's reason and policies.
    reason: &'static str,
    policies: fn() -> Value,
    /// kind and name in the report.
    report: (&'static str, &'static str),
    series: &'static str,
}

fn annotation(staged: bool) -> &'static str {
    if staged {
        "\n  annotations: {policy-agent/staged: \"true\"}"
    } else {
        ""
    }
}

/// beta/db isolated for ingress, nothing admitted.
fn deny_db(staged: bool) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: deny-db\n  namespace: beta{}\nspec:\n  podSelector: {{matchLabels: {{app: db}}}}\n  policyTypes: [Ingress]\n",
        annotation(staged)
    )
}

const DENY_ALL: Case = Case {
    yaml: deny_db,
    drops_from: |_| true,
    reason: "drop_policy",
    policies: || {
        serde_json::json!([{
            "kind": "NetworkPolicy", "namespace": "beta", "name": "deny-db",
            "rule": null, "rule_name": null, "tier": null, "priority": null
        }])
    },
    report: ("NetworkPolicy", "deny-db"),
    series: "policy_agent_staged_flows_total{kind=\"NetworkPolicy\",namespace=\"beta\",name=\"deny-db\",direction=\"ingress\",verdict=\"drop\"}",
};

/// An Admin Deny of gamma's pods at beta/db.
fn guard(staged: bool) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata:\n  name: guard{}\nspec:\n  tier: Admin\n  priority: 5\n  subject:\n    pods:\n      namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: beta}}}}\n      podSelector: {{matchLabels: {{app: db}}}}\n  ingress:\n  - {{name: no-gamma, action: Deny, from: [{{namespaces: {{matchLabels: {{team: c}}}}}}]}}\n",
        annotation(staged)
    )
}

const ADMIN_DENY: Case = Case {
    yaml: guard,
    drops_from: |from| from.starts_with("gamma/"),
    reason: "drop_admin_tier",
    policies: || {
        serde_json::json!([{
            "kind": "ClusterNetworkPolicy", "namespace": null, "name": "guard",
            "rule": 0, "rule_name": "no-gamma", "tier": "Admin", "priority": 5
        }])
    },
    report: ("ClusterNetworkPolicy", "guard"),
    series: "policy_agent_staged_flows_total{kind=\"ClusterNetworkPolicy\",namespace=\"\",name=\"guard\",direction=\"ingress\",verdict=\"drop\"}",
};
/// (peer pod, protocol, port) of a flow at beta/db, as a record names it.
type Probe = (String, String, Option<u64>);

fn transport_name(t: Transport, port: u16) -> (String, Option<u64>) {
    match t {
        Transport::Tcp => ("TCP".into(), Some(u64::from(port))),
        Transport::Udp => ("UDP".into(), Some(u64::from(port))),
        Transport::Ping => ("ICMP".into(), None),
    }
}

fn staged_case(prefix: &'static str, backend: Backend, port: u16, case: &Case) {
    let mut c = Conformance::new(prefix, backend);
    c.write_policies(&(case.yaml)(true));
    let dir = c.dir.to_str().unwrap().to_owned();
    c.start_daemon_with(
        port,
        &["--manifests", &dir, "--flow-records-per-second", "0"],
        &[],
    );
    c.wait_for_flow_socket();
    let (mut child, rx) = c.follow_flows(&["--staged", "--count", "100000"]);
    std::thread::sleep(Duration::from_millis(300));

    // Staged: no verdict changes. Every cell is open, judged at the
    // receiver (the request reached the pod, its answer came back).
    let m = c.check("a staged policy", |_, _, _, _| true);

    // Every flow to beta/db the matrix made (but the node's, which policy
    // never judges, and the pod's own) is reported as one it would drop.
    let mut wanted: BTreeSet<Probe> = BTreeSet::new();
    for (from, target, v6) in m.cells.keys() {
        if target.pod != "beta/db" || is_node(from) || from == "beta/db" || !(case.drops_from)(from)
        {
            continue;
        }
        // ICMPv6 echo is reported as such; the matrix pings both families.
        let (mut protocol, port) = transport_name(target.transport, target.port);
        if *v6 && protocol == "ICMP" {
            protocol = "ICMPv6".into();
        }
        wanted.insert((from.clone(), protocol, port));
    }
    assert!(!wanted.is_empty(), "the matrix probed nothing at beta/db");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut reported: BTreeSet<Probe> = BTreeSet::new();
    let mut seen = Vec::new();
    while !wanted.is_subset(&reported) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(v) = rx.recv_timeout(left) else {
            let missing: Vec<_> = wanted.difference(&reported).collect();
            panic!("flows to beta/db never reported as staged drops: {missing:?}\nsaw {seen:#?}");
        };
        let staged = &v["staged"];
        if v["pod"] == "beta/db" && v["direction"] == "ingress" {
            assert_eq!(v["verdict"], "allow", "{v:#}");
            assert_eq!(staged["verdict"], "drop", "{v:#}");
            assert_eq!(staged["reason"], case.reason, "{v:#}");
            assert_eq!(staged["policies"], (case.policies)(), "{v:#}");
            if let Some(peer) = v["peer"]["pod"].as_str() {
                reported.insert((
                    peer.to_owned(),
                    v["protocol"].as_str().unwrap_or("").to_owned(),
                    v["port"].as_u64(),
                ));
            }
        } else {
            seen.push(v);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        seen.iter().all(|v| v["staged"].is_object()),
        "flows --staged printed flows without a staged verdict: {seen:#?}"
    );

    // The report and the series count them.
    let report = c.staged_report();
    let policies = report["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 1, "{report:#}");
    let deny = &policies[0];
    let (kind, name) = &case.report;
    assert_eq!(
        (&deny["kind"], &deny["name"]),
        (&Value::from(*kind), &Value::from(*name)),
        "{report:#}"
    );
    let would_drop = deny["would_drop_ingress"].as_u64().unwrap();
    assert!(
        would_drop >= wanted.len() as u64,
        "{would_drop} would-drop flows counted, {} reported: {report:#}",
        wanted.len()
    );
    assert_eq!(deny["would_allow_ingress"], 0, "{report:#}");
    let metrics = c.http_get(port, "/metrics");
    assert!(
        metrics.contains(case.series),
        "no {} in\n{metrics}",
        case.series
    );

    // Un-staged: enforced as written.
    c.write_policies(&(case.yaml)(false));
    let drops_from = case.drops_from;
    c.eventually("un-staged", Duration::from_secs(10), move |f, t, _, _| {
        is_node(f) || f == t || t != "beta/db" || !drops_from(f)
    });
    let report = c.staged_report();
    assert_eq!(report["policies"], serde_json::json!([]), "{report:#}");
    c.stop_daemon();
    c.reset();
}

#[test]
fn a_staged_deny_all_reports_every_flow_it_would_drop_bpf() {
    staged_case("stgbpf", Backend::Bpf, 19460, &DENY_ALL);
}

#[test]
fn a_staged_deny_all_reports_every_flow_it_would_drop_iptables() {
    staged_case("stgipt", Backend::Iptables, 19461, &DENY_ALL);
}

#[test]
fn a_staged_admin_deny_reports_every_flow_it_would_drop_bpf() {
    staged_case("stgcnpb", Backend::Bpf, 19462, &ADMIN_DENY);
}

#[test]
fn a_staged_admin_deny_reports_every_flow_it_would_drop_iptables() {
    staged_case("stgcnpi", Backend::Iptables, 19463, &ADMIN_DENY);
}
