//! Staged policies outside the kernel: a record judged against the staged
//! view and named from it, the per-policy tallies (report, /metrics),
//! the `flows --staged` filter, and `explain --staged`.
use std::{path::Path, time::SystemTime};

use policy_agent::{
    cluster::{ClusterState, staged::StagedPolicy},
    datapath::bpf::flows::{
        FlowLog,
        filter::FlowFilter,
        pipeline::FlowObserver,
        record::{Flow, Peer, Verdict},
        staged::StagedJudge,
        stats::FlowStats,
    },
    identity::IdentityAllocator,
    mapstate::StagedView,
    policy::{CompileOptions, Compiler},
    source::manifests::{LoadedManifests, load_text},
};
use policy_common::{
    direction::{EGRESS, INGRESS},
    event::{FlowRecord, RECORD_NEW_FLOW},
    family, proto,
    verdict::Reason,
};

const CLUSTER: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {podIPs: [{ip: 10.1.0.10}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {podIPs: [{ip: 10.1.0.12}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: db-web-only
  namespace: shop
  annotations: {policy-agent/staged: "true"}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}], ports: [{port: 5432}]}]
"#;

fn state() -> ClusterState {
    let mut loaded = LoadedManifests::default();
    load_text(Path::new("c.yaml"), CLUSTER, &mut loaded);
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    loaded.cluster_state("n1", vec!["192.168.0.1".parse().unwrap()])
}

fn staged_policy() -> StagedPolicy {
    StagedPolicy::NetworkPolicy {
        namespace: "shop".into(),
        name: "db-web-only".into(),
    }
}

/// The staged view of `state()`: every policy enforced.
fn view() -> StagedView {
    let compiler = Compiler::build(
        &state(),
        &mut IdentityAllocator::new(),
        CompileOptions::default(),
    );
    StagedView::new(
        compiler.maps(),
        [(staged_policy(), SystemTime::UNIX_EPOCH)].into(),
    )
}

fn v4(a: &str) -> [u8; 16] {
    let ip: std::net::Ipv4Addr = a.parse().unwrap();
    let mut out = [0; 16];
    out[..4].copy_from_slice(&ip.octets());
    out
}

/// A new flow to shop/db from `peer` on TCP `port`, judged `reason` by
/// the enforced maps, with its flow as the namer gives it.
fn flow_to_db(peer: &str, peer_pod: Option<&str>, port: u16, reason: Reason) -> (FlowRecord, Flow) {
    let record = FlowRecord {
        ifindex: 12,
        src: v4(peer),
        dst: v4("10.1.0.12"),
        sport: 40000,
        dport: port,
        protocol: proto::TCP,
        family: family::IPV4,
        direction: INGRESS,
        reason: reason as u8,
        flags: RECORD_NEW_FLOW,
        ..FlowRecord::default()
    };
    let flow = Flow {
        time: String::new(),
        direction: "ingress".into(),
        pod: "shop/db".into(),
        peer: match peer_pod {
            Some(p) => Peer::pod(p, peer),
            None => Peer::ip(peer),
        },
        peer_identity: None,
        protocol: "TCP".into(),
        port: Some(port),
        verdict: if reason.is_drop() {
            Verdict::Drop
        } else {
            Verdict::Allow
        },
        reason: reason.name().into(),
        policies: Vec::new(),
        staged: None,
    };
    (record, flow)
}

fn judged(judge: &StagedJudge, peer: &str, pod: Option<&str>, port: u16) -> Flow {
    let (record, mut flow) = flow_to_db(peer, pod, port, Reason::AllowNotIsolated);
    judge.judge(&record, &mut flow);
    flow
}

#[test]
fn a_record_is_judged_against_the_staged_view_and_named_from_it() {
    let mut judge = StagedJudge::default();
    judge.update(Some(view().into()), 0);
    // Would be dropped: not web, or not 5432.
    for (peer, pod, port) in [
        ("10.1.0.99", None, 5432),
        ("10.1.0.10", Some("shop/web"), 80),
    ] {
        let flow = judged(&judge, peer, pod, port);
        let staged = flow.staged.as_ref().unwrap_or_else(|| panic!("{flow}"));
        assert_eq!(
            (staged.verdict, staged.reason.as_str()),
            (Verdict::Drop, "drop_policy")
        );
        let names: Vec<String> = staged.policies.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["shop/db-web-only"]);
        let json = serde_json::to_value(&flow).unwrap();
        assert_eq!(json["staged"]["verdict"], "drop");
        assert_eq!(json["staged"]["policies"][0]["name"], "db-web-only");
    }
    // Admitted by the staged policy too: no staged verdict.
    assert_eq!(
        judged(&judge, "10.1.0.10", Some("shop/web"), 5432).staged,
        None
    );
    // Another pod's flow, and the pod's egress, nothing staged judges.
    let (mut record, mut flow) = flow_to_db("10.1.0.99", None, 5432, Reason::AllowNotIsolated);
    record.direction = EGRESS;
    flow.direction = "egress".into();
    judge.judge(&record, &mut flow);
    assert_eq!(flow.staged, None);
    flow.pod = "shop/web".into();
    judge.judge(&record, &mut flow);
    assert_eq!(flow.staged, None);
    // A drop the staged policy would turn into an allow is reported.
    let (record, mut flow) = flow_to_db("10.1.0.10", Some("shop/web"), 5432, Reason::DropPolicy);
    judge.judge(&record, &mut flow);
    let staged = flow.staged.unwrap();
    assert_eq!(
        (staged.verdict, staged.reason.as_str()),
        (Verdict::Allow, "allow_policy")
    );
    assert_eq!(staged.policies[0].to_string(), "shop/db-web-only[0]");
    // A refusal while tier entries land, and a dropped packet of another
    // kind, are not policy verdicts: not judged again.
    for reason in [Reason::DropUpdating, Reason::DropSpoofed] {
        let (record, mut flow) = flow_to_db("10.1.0.99", None, 5432, reason);
        judge.judge(&record, &mut flow);
        assert_eq!(flow.staged, None, "{reason:?}");
    }
    // Un-staged at 1 ms: a record stamped before is judged against the
    // view it was made under, one stamped after against none.
    judge.update(None, 1_000_000);
    let (mut record, mut flow) = flow_to_db("10.1.0.99", None, 5432, Reason::AllowNotIsolated);
    record.timestamp_ns = 999_999;
    judge.judge(&record, &mut flow);
    assert!(flow.staged.is_some(), "made under the staged view");
    record.timestamp_ns = 1_000_000;
    flow.staged = None;
    judge.judge(&record, &mut flow);
    assert_eq!(flow.staged, None, "made after it was un-staged");
}

#[test]
fn tallies_count_per_staged_policy_while_it_is_staged() {
    let stats = FlowStats::default();
    let view = view();
    stats.staged.follow(Some(&view));
    let mut judge = StagedJudge::default();
    judge.update(Some(view.clone().into()), 0);
    for port in [80, 81, 82] {
        stats
            .staged
            .count(&judged(&judge, "10.1.0.10", Some("shop/web"), port));
    }
    // Not changed by the staged view: not counted.
    stats
        .staged
        .count(&judged(&judge, "10.1.0.10", Some("shop/web"), 5432));
    let report = stats.staged.report();
    assert_eq!(report.policies.len(), 1);
    let t = &report.policies[0];
    assert_eq!(
        (t.kind.as_str(), t.namespace.as_deref(), t.name.as_str()),
        ("NetworkPolicy", Some("shop"), "db-web-only")
    );
    assert_eq!((t.would_drop_ingress, t.would_allow()), (3, 0));
    assert_eq!(t.since, "1970-01-01T00:00:00.000000Z");
    assert_eq!(t.last.as_ref().map(|f| f.port), Some(Some(82)));
    let text = report.to_string();
    assert!(
        text.contains("NetworkPolicy shop/db-web-only: staged since 1970-01-01T00:00:00.000000Z; would drop 3 new flows (3 ingress, 0 egress)"),
        "{text}"
    );
    let mut metrics = String::new();
    stats.render(&mut metrics, 0, 0);
    assert!(
        metrics.contains("policy_agent_staged_flows_total{kind=\"NetworkPolicy\",namespace=\"shop\",name=\"db-web-only\",direction=\"ingress\",verdict=\"drop\"} 3"),
        "{metrics}"
    );
    // The report reads back from its wire form.
    let wire = serde_json::to_string(&report).unwrap();
    assert_eq!(
        serde_json::from_str::<policy_agent::datapath::bpf::flows::staged_report::StagedReport>(
            &wire
        )
        .unwrap(),
        report
    );
    // Un-staged (or deleted): its tally and series go.
    stats.staged.follow(None);
    assert!(stats.staged.report().policies.is_empty());
    let mut metrics = String::new();
    stats.render(&mut metrics, 0, 0);
    assert!(!metrics.contains("db-web-only"), "{metrics}");
}

#[test]
fn the_staged_filter_keeps_flows_with_a_staged_verdict() {
    let mut judge = StagedJudge::default();
    judge.update(Some(view().into()), 0);
    let changed = judged(&judge, "10.1.0.99", None, 5432);
    let same = judged(&judge, "10.1.0.10", Some("shop/web"), 5432);
    let filter = FlowFilter {
        staged: true,
        ..FlowFilter::default()
    };
    assert!(filter.matches(&changed));
    assert!(!filter.matches(&same));
    let by_policy = FlowFilter {
        policy: Some("shop/db-web-only".into()),
        ..FlowFilter::default()
    };
    assert!(by_policy.matches(&changed), "the staged policy names it");
}

#[test]
fn explain_staged_shows_both_verdicts() {
    let dir = std::env::temp_dir().join(format!("pa-explain-staged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.yaml"), CLUSTER).unwrap();
    let explain = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_policy-agent"))
            .args(["explain", "--manifests", dir.to_str().unwrap()])
            .args([
                "--from",
                "10.1.0.99",
                "--to",
                "shop/db",
                "--port",
                "5432",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Without --staged: the enforced verdict, and a note.
    let (enforced, note) = explain(&[]);
    assert_eq!(enforced["allowed"], true, "{enforced:#}");
    assert!(note.contains("1 staged policy is not enforced"), "{note}");
    let (both, _) = explain(&["--staged"]);
    assert_eq!(both["enforced"]["allowed"], true, "{both:#}");
    assert_eq!(both["staged"]["allowed"], false, "{both:#}");
    assert_eq!(
        both["staged_policies"],
        serde_json::json!(["NetworkPolicy shop/db-web-only"])
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The report follows the view a sync sets at once, not when the flow
/// thread next wakes (none runs here): a policy un-staged has left the
/// report by the time the sync that un-staged it returns.
#[test]
fn the_report_follows_the_view_a_sync_sets_without_the_flow_thread() {
    let observer = FlowObserver::new(FlowLog::Off);
    let staged = std::sync::Arc::new(view());
    observer.set_staged(Some(&staged));
    let report = observer.stats().staged.report();
    assert_eq!(report.policies.len(), 1, "{report}");
    assert_eq!(report.policies[0].name, "db-web-only");
    observer.set_staged(None);
    let report = observer.stats().staged.report();
    assert!(report.policies.is_empty(), "{report}");
}
