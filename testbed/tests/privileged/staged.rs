//! Staged policies on a simulated node, on both datapaths: a staged
//! deny-all changes no verdict (judged at the receiver), every flow it
//! would drop is reported (flow records, the staged report, /metrics),
//! and removing the annotation enforces it. Needs root.
use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader},
    process::{Child, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use policy_testbed::{
    connectivity::Transport,
    fixtures::{
        self,
        conformance::{Backend, Conformance, is_node},
    },
};
use serde_json::Value;

/// beta/db isolated for ingress, nothing admitted.
fn deny_db(staged: bool) -> String {
    let annotation = if staged {
        "\n  annotations: {policy-agent/staged: \"true\"}"
    } else {
        ""
    };
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: deny-db\n  namespace: beta{annotation}\nspec:\n  podSelector: {{matchLabels: {{app: db}}}}\n  policyTypes: [Ingress]\n"
    )
}

/// `policy-agent flows --json --staged` in the node namespace, its lines
/// sent on as they come.
fn follow_staged(c: &Conformance) -> (Child, mpsc::Receiver<Value>) {
    let mut child = c
        .node()
        .node
        .command(fixtures::agent())
        .args(["flows", "--json", "--staged", "--count", "100000"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("flows printed {line:?}: {e}"));
            if tx.send(v).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

fn wait_for_socket(c: &Conformance) {
    let wanted = format!("@policy-agent-flows:{}", c.layout.root().display());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c
        .node()
        .node
        .exec("cat", &["/proc/net/unix"])
        .unwrap_or_default()
        .contains(&wanted)
    {
        assert!(Instant::now() < deadline, "no socket {wanted}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// (peer pod, protocol, port) of a flow at beta/db, as a record names it.
type Probe = (String, String, Option<u64>);

fn transport_name(t: Transport, port: u16) -> (String, Option<u64>) {
    match t {
        Transport::Tcp => ("TCP".into(), Some(u64::from(port))),
        Transport::Udp => ("UDP".into(), Some(u64::from(port))),
        Transport::Ping => ("ICMP".into(), None),
    }
}

fn staged_deny_all(prefix: &'static str, backend: Backend, port: u16) {
    let mut c = Conformance::new(prefix, backend);
    c.write_policies(&deny_db(true));
    let dir = c.dir.to_str().unwrap().to_owned();
    c.start_daemon_with(
        port,
        &["--manifests", &dir, "--flow-records-per-second", "0"],
        &[],
    );
    wait_for_socket(&c);
    let (mut child, rx) = follow_staged(&c);
    std::thread::sleep(Duration::from_millis(300));

    // Staged: no verdict changes. Every cell is open, judged at the
    // receiver (the request reached the pod, its answer came back).
    let m = c.check("a staged deny-all", |_, _, _, _| true);

    // Every flow to beta/db the matrix made (but the node's, which policy
    // never judges, and the pod's own) is reported as one it would drop.
    let mut wanted: BTreeSet<Probe> = BTreeSet::new();
    for (from, target, v6) in m.cells.keys() {
        if target.pod != "beta/db" || is_node(from) || from == "beta/db" {
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
            assert_eq!(staged["reason"], "drop_policy", "{v:#}");
            assert_eq!(
                staged["policies"],
                serde_json::json!([{
                    "kind": "NetworkPolicy", "namespace": "beta", "name": "deny-db",
                    "rule": null, "rule_name": null, "tier": null, "priority": null
                }]),
                "{v:#}"
            );
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
    let report = c
        .node()
        .node
        .command(fixtures::agent())
        .args(["staged-report", "--json"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        report.status.success(),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );
    let report: Value = serde_json::from_slice(&report.stdout).unwrap();
    let policies = report["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 1, "{report:#}");
    let deny = &policies[0];
    assert_eq!(
        (&deny["kind"], &deny["namespace"], &deny["name"]),
        (
            &Value::from("NetworkPolicy"),
            &Value::from("beta"),
            &Value::from("deny-db")
        ),
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
    let series = "policy_agent_staged_flows_total{kind=\"NetworkPolicy\",namespace=\"beta\",name=\"deny-db\",direction=\"ingress\",verdict=\"drop\"}";
    assert!(metrics.contains(series), "no {series} in\n{metrics}");

    // Un-staged: enforced as written.
    c.write_policies(&deny_db(false));
    c.eventually(
        "the deny-all un-staged",
        Duration::from_secs(10),
        |f, t, _, _| is_node(f) || f == t || t != "beta/db",
    );
    let report = c
        .node()
        .node
        .command(fixtures::agent())
        .args(["staged-report", "--json"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&report.stdout).unwrap();
    assert_eq!(report["policies"], serde_json::json!([]), "{report:#}");
    c.stop_daemon();
    c.reset();
}

#[test]
fn a_staged_deny_all_reports_every_flow_it_would_drop_bpf() {
    staged_deny_all("stgbpf", Backend::Bpf, 19460);
}

#[test]
fn a_staged_deny_all_reports_every_flow_it_would_drop_iptables() {
    staged_deny_all("stgipt", Backend::Iptables, 19461);
}
