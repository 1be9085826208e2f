//! `policy-agent flows` on a simulated node: the flows a policy allows and
//! drops, named by that policy, read from the ring after `apply` and from
//! the daemon's socket while `run` consumes it (with its per-policy
//! series on /metrics). Needs root.
use std::{
    process::{Child, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use policy_testbed::fixtures::{
    self,
    conformance::{Backend, Conformance},
};
use serde_json::Value;

/// beta/db admits beta/web only.
const DB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: beta}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n";

/// `policy-agent flows --json` about beta/db in the node namespace.
fn follow(c: &Conformance) -> (Child, mpsc::Receiver<Value>) {
    c.follow_flows(&["--count", "1000", "--pod", "beta/db"])
}

/// Waits for an allowed flow from beta/web and a dropped one from
/// another pod, both at beta/db and named by beta's `db`; returns them.
fn allowed_and_dropped(rx: &mpsc::Receiver<Value>) -> (Value, Value) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut allowed, mut dropped) = (None, None);
    let mut seen = Vec::new();
    while allowed.is_none() || dropped.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(v) = rx.recv_timeout(left) else {
            panic!("no allowed and dropped flow in 30 s; saw {seen:#?}");
        };
        let at_db = v["pod"] == "beta/db" && v["direction"] == "ingress";
        if at_db && v["verdict"] == "allow" && v["peer"]["pod"] == "beta/web" {
            allowed = Some(v);
        } else if at_db && v["verdict"] == "drop" && v["reason"] == "drop_policy" {
            dropped = Some(v);
        } else {
            seen.push(v);
        }
    }
    (allowed.unwrap(), dropped.unwrap())
}

fn check(allowed: &Value, dropped: &Value) {
    assert_eq!(allowed["reason"], "allow_policy", "{allowed:#}");
    assert_eq!(
        allowed["policies"],
        serde_json::json!([{
            "kind": "NetworkPolicy", "namespace": "beta", "name": "db", "rule": 0,
            "rule_name": null, "tier": null, "priority": null
        }]),
        "{allowed:#}"
    );
    assert_eq!(
        dropped["policies"],
        serde_json::json!([{
            "kind": "NetworkPolicy", "namespace": "beta", "name": "db", "rule": null,
            "rule_name": null, "tier": null, "priority": null
        }]),
        "{dropped:#}"
    );
    assert_ne!(dropped["peer"]["pod"], "beta/web", "{dropped:#}");
}

#[test]
fn flows_after_apply_name_the_policy_that_allowed_and_dropped_them() {
    let c = Conformance::new("flowsapp", Backend::Bpf);
    c.write_policies(DB);
    // No budget: the matrix makes more records than its burst, and the
    // two this test waits for must not be the ones held back.
    let run = c.apply_with(&["--flow-records-per-second", "0"]);
    assert!(run.ok, "{}", run.stderr);
    let (mut child, rx) = follow(&c);
    std::thread::sleep(Duration::from_millis(300));
    let _ = c.matrix();
    let (allowed, dropped) = allowed_and_dropped(&rx);
    let _ = child.kill();
    let _ = child.wait();
    check(&allowed, &dropped);
    c.reset();
}

#[test]
fn flows_from_the_daemon_and_their_series() {
    const PORT: u16 = 19450;
    let mut c = Conformance::new("flowsrun", Backend::Bpf);
    c.write_policies(DB);
    let dir = c.dir.to_str().unwrap().to_owned();
    c.start_daemon_with(
        PORT,
        &["--manifests", &dir, "--flow-records-per-second", "0"],
        &[],
    );
    // The daemon serves its flows (so `flows` does not read the ring).
    c.wait_for_flow_socket();
    let (mut child, rx) = follow(&c);
    std::thread::sleep(Duration::from_millis(300));
    let _ = c.matrix();
    let (allowed, dropped) = allowed_and_dropped(&rx);
    let _ = child.kill();
    let _ = child.wait();
    check(&allowed, &dropped);
    let metrics = c.http_get(PORT, "/metrics");
    for series in [
        "policy_agent_policy_flows_total{kind=\"NetworkPolicy\",namespace=\"beta\",name=\"db\",rule=\"0\",direction=\"ingress\",verdict=\"allow\"}",
        "policy_agent_policy_flows_total{kind=\"NetworkPolicy\",namespace=\"beta\",name=\"db\",rule=\"\",direction=\"ingress\",verdict=\"drop\"}",
        "policy_agent_flow_records_lost_total{cause=\"budget\"}",
    ] {
        assert!(metrics.contains(series), "no {series} in\n{metrics}");
    }
    // `events` reads the same flows from the daemon: drops, in its format.
    let events = c
        .node()
        .node
        .command(fixtures::agent())
        .args(["events", "--json", "--count", "1"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let _ = c.matrix();
    let out = events.wait_with_output().unwrap();
    let line: Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "pod",
        "direction",
        "reason",
        "protocol",
        "src",
        "dst",
        "peer",
        "peer_class",
    ] {
        assert!(line.get(field).is_some(), "no {field} in {line}");
    }
    assert!(
        line["reason"].as_str().unwrap().starts_with("drop_"),
        "{line}"
    );
    c.stop_daemon();
    c.reset();
}
