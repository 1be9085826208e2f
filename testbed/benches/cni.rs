//! The CNI hand-off on a simulated node with 10,000 pods and 1,000
//! policies in the cluster (manifests mode, seeded): pods created as a
//! runtime creates them (`sim::cni`: Debian's ptp + host-local, then
//! `policy-cni`), each under a policy of its own namespace.
//!
//! * With the plugin, 200 pod creations: the latency our plugin adds to
//!   CNI ADD (its own invocation, process start to exit, which is the
//!   agent compiling and enforcing the pod), p50/p99/max, next to ptp's,
//!   and the whole chain's (ptp + policy-cni) against ptp alone.
//! * First, before the agent starts, 50 creations with ptp alone: what
//!   the node's own plugin takes when nothing contends with it (the
//!   agent's attaches share RTNL with ptp's work).
//! * Without it, 50 pod creations: the window during which a new pod's
//!   traffic is unjudged — from ptp's ADD returning (the veth is up and
//!   routed) until the pod's endpoint is in the map with our programs
//!   attached, with the pod's address published the moment ADD returns
//!   (the kubelet's status update, in reality a second or more later,
//!   comes on top).
//!
//! Needs root and containernetworking-plugins. `cargo bench -p
//! policy-agent --bench cni` (printed and written to
//! target/bench-results/cni.json).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    fmt::Write as _,
    path::Path,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use policy_agent::datapath::bpf::{maps::BpfMaps, pins::PinLayout};
use policy_common::endpoint::ATTACH_POD;
use policy_testbed::{
    SimNode, cleanup_prefix,
    cni_runtime::{CniRuntime, test_cni_path},
};
use serde_json::{Value, json};

const PREFIX: &str = "bcni";
const NAMESPACES: usize = 100;
const PODS_PER_NS: usize = 100;
const POLICIES_PER_NS: usize = 10;
/// Pod creations with the plugin (200 put two samples above the p99).
const WITH: usize = 200;
// (BENCH_CNI_WITH=<n> for a quick look; the report's p99 needs 200.)
/// Pod creations without it.
const WITHOUT: usize = 50;
/// Pod creations with ptp alone, before the agent starts.
const BASELINE: usize = 50;

/// The cluster: 100 namespaces of 100 remote pods and 10 policies each.
fn cluster_file(ns: usize) -> String {
    let mut out = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: ns{ns:03}, labels: {{team: t{}}}}}\n",
        ns % 10
    );
    for i in 0..PODS_PER_NS {
        let n = (ns * PODS_PER_NS + i) as u32;
        let ip = std::net::Ipv4Addr::from(0x0a64_0000u32 + n);
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p{i:03}, namespace: ns{ns:03}, labels: {{app: app{}, tier: {}}}}}\nspec: {{nodeName: node-{}, containers: [{{name: c, image: x}}]}}\nstatus: {{phase: Running, podIPs: [{{ip: {ip}}}]}}\n",
            i % 10,
            if i.is_multiple_of(3) { "front" } else { "back" },
            2 + n % 19
        );
    }
    for k in 0..POLICIES_PER_NS {
        let _ = write!(
            out,
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: pol{k:02}, namespace: ns{ns:03}}}\nspec:\n  podSelector: {{matchLabels: {{app: app{}}}}}\n  ingress:\n    - from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}, podSelector: {{matchLabels: {{tier: front}}}}}}]\n      ports: [{{port: 80}}]\n",
            k,
            (ns + k) % 10
        );
    }
    out
}

/// The new pods' namespace: its pods allow ingress from `tier: front`.
fn new_namespace() -> String {
    "apiVersion: v1\nkind: Namespace\nmetadata: {name: new, labels: {team: t0}}\n---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: fronts-only, namespace: new}\nspec:\n  podSelector: {}\n  ingress:\n    - from: [{namespaceSelector: {}, podSelector: {matchLabels: {tier: front}}}]\n".to_owned()
}

/// A new pod's object: scheduled here, its address once published.
fn new_pod(name: &str, ip: Option<&str>) -> String {
    let status = ip.map_or_else(
        || "{phase: Pending}".to_owned(),
        |ip| format!("{{phase: Running, podIPs: [{{ip: {ip}}}]}}"),
    );
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: new, uid: uid-{name}, labels: {{app: new}}}}\nspec: {{nodeName: node-1, containers: [{{name: c, image: x}}]}}\nstatus: {status}\n"
    )
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn list(ipam: &Path, socket: &Path, with_plugin: bool) -> Value {
    let mut plugins = vec![json!({
        "type": "ptp", "ipMasq": false, "mtu": 1500,
        "ipam": {"type": "host-local", "dataDir": ipam, "ranges": [[{"subnet": "10.98.0.0/16"}]],
                 "routes": [{"dst": "0.0.0.0/0"}]}
    })];
    if with_plugin {
        plugins.push(json!({"type": "policy-cni", "socket": socket, "timeoutSeconds": 30}));
    }
    json!({"cniVersion": "1.0.0", "name": "benchnet", "plugins": plugins})
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let dir = std::env::temp_dir().join("policy-agent-bench-cni");
    let _ = std::fs::remove_dir_all(&dir);
    let manifests = dir.join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    for ns in 0..NAMESPACES {
        std::fs::write(manifests.join(format!("ns{ns:03}.yaml")), cluster_file(ns)).unwrap();
    }
    std::fs::write(manifests.join("new.yaml"), new_namespace()).unwrap();
    for i in 0..WITH {
        let name = format!("w{i:03}");
        std::fs::write(manifests.join(format!("{name}.yaml")), new_pod(&name, None)).unwrap();
    }
    for i in 0..WITHOUT {
        let name = format!("n{i:03}");
        std::fs::write(manifests.join(format!("{name}.yaml")), new_pod(&name, None)).unwrap();
    }
    cleanup_prefix(PREFIX);
    let node = SimNode::create(PREFIX, &[]).unwrap();
    let layout = PinLayout::new("/sys/fs/bpf/policy-agent-bench-cni");
    let socket = dir.join("cni.sock");
    let cni_path = test_cni_path().unwrap();
    let ipam = dir.join("ipam");

    // Baseline, before any agent runs: ptp alone on a quiet node.
    let rt = CniRuntime::new(&node.node, list(&ipam, &socket, false), cni_path.clone()).unwrap();
    let mut alone = Vec::new();
    for i in 0..BASELINE {
        let mut sb = rt
            .sandbox(PREFIX, "new", &format!("b{i:03}"), &format!("uid-b{i:03}"))
            .unwrap();
        rt.add(&mut sb).unwrap();
        alone.extend(
            rt.take_log()
                .into_iter()
                .filter(|inv| inv.plugin == "ptp")
                .map(|inv| inv.elapsed),
        );
        rt.del(&mut sb).unwrap();
        let _ = rt.take_log();
    }
    alone.sort();
    drop(rt);
    // BENCH_CNI_LOG=<file>: the agent's debug log there (where the time goes).
    let log = std::env::var_os("BENCH_CNI_LOG").map(|p| std::fs::File::create(p).unwrap());
    let daemon = Daemon(
        node.node
            .command(policy_testbed::fixtures::agent())
            .args(["run", "--node", "node-1", "--datapath", "bpf"])
            .args(
                std::env::var("BENCH_CNI_ARGS")
                    .ok()
                    .iter()
                    .flat_map(|a| a.split_whitespace()),
            )
            .args(["--listen", "127.0.0.1:19495", "--manifests"])
            .arg(&manifests)
            .arg("--pin-dir")
            .arg(layout.root())
            .arg("--cni-socket")
            .arg(&socket)
            .env(
                "RUST_LOG",
                if log.is_some() {
                    "policy_agent=debug"
                } else {
                    "warn"
                },
            )
            .stdout(Stdio::null())
            .stderr(log.map_or_else(Stdio::null, Stdio::from))
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    while !socket.exists() || std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the agent never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // With the plugin. The first ADD also waits for the agent's first sync.
    let rt = CniRuntime::new(&node.node, list(&ipam, &socket, true), cni_path.clone()).unwrap();
    let (mut ours, mut ptp, mut chain) = (Vec::new(), Vec::new(), Vec::new());
    let with: usize = std::env::var("BENCH_CNI_WITH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(WITH);
    for i in 0..with {
        let mut sb = rt
            .sandbox(PREFIX, "new", &format!("w{i:03}"), &format!("uid-w{i:03}"))
            .unwrap();
        rt.add(&mut sb)
            .unwrap_or_else(|e| panic!("ADD w{i:03}: {e}"));
        let mut total = Duration::ZERO;
        for inv in rt.take_log() {
            match inv.plugin.as_str() {
                "policy-cni" => ours.push(inv.elapsed),
                "ptp" => ptp.push(inv.elapsed),
                _ => continue,
            }
            total += inv.elapsed;
        }
        chain.push(total);
        rt.del(&mut sb).unwrap();
        let _ = rt.take_log();
    }
    ours.remove(0);
    ptp.remove(0);
    chain.remove(0);
    ours.sort();
    ptp.sort();
    chain.sort();

    // Without it: ptp alone, the address published as ADD returns.
    let rt = CniRuntime::new(&node.node, list(&ipam, &socket, false), cni_path).unwrap();
    let maps = BpfMaps::from_pins(&layout).unwrap();
    let mut window = Vec::new();
    for i in 0..WITHOUT {
        let name = format!("n{i:03}");
        let mut sb = rt
            .sandbox(PREFIX, "new", &name, &format!("uid-{name}"))
            .unwrap();
        let result = rt
            .add(&mut sb)
            .unwrap_or_else(|e| panic!("ADD {name}: {e}"));
        let up = Instant::now();
        let ip = result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        write_atomically(
            &manifests.join(format!("{name}.yaml")),
            &new_pod(&name, Some(&ip)),
        );
        let host = result["interfaces"][0]["name"].as_str().unwrap();
        let out = node.node.ip(&["-o", "link", "show", host]).unwrap();
        let ifindex: u32 = out.split(':').next().unwrap().trim().parse().unwrap();
        loop {
            let enforced = maps.endpoint(ifindex).ok().flatten().is_some()
                && maps
                    .meta(ifindex)
                    .is_some_and(|m| m.attach & ATTACH_POD != 0);
            if enforced {
                break;
            }
            assert!(
                up.elapsed() < Duration::from_secs(30),
                "{name} never enforced"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        window.push(up.elapsed());
        rt.del(&mut sb).unwrap();
        let _ = rt.take_log();
    }
    window.sort();
    drop(daemon);
    let _ = node
        .node
        .command(policy_testbed::fixtures::agent())
        .arg("reset")
        .arg("--pin-dir")
        .arg(layout.root())
        .output();
    let _ = std::fs::remove_dir_all(layout.root());
    drop(node);
    cleanup_prefix(PREFIX);
    let _ = std::fs::remove_dir_all(&dir);

    let json = json!({
        "pods": NAMESPACES * PODS_PER_NS,
        "policies": NAMESPACES * POLICIES_PER_NS,
        "samples": ours.len(),
        "window_samples": window.len(),
        "plugin_add_p50_ms": ms(percentile(&ours, 0.5)),
        "plugin_add_p99_ms": ms(percentile(&ours, 0.99)),
        "plugin_add_max_ms": ms(*ours.last().unwrap()),
        "ptp_add_p50_ms": ms(percentile(&ptp, 0.5)),
        "ptp_add_p99_ms": ms(percentile(&ptp, 0.99)),
        "chain_add_p50_ms": ms(percentile(&chain, 0.5)),
        "chain_add_p99_ms": ms(percentile(&chain, 0.99)),
        "baseline_samples": alone.len(),
        "ptp_alone_p50_ms": ms(percentile(&alone, 0.5)),
        "ptp_alone_p99_ms": ms(percentile(&alone, 0.99)),
        "window_p50_ms": ms(percentile(&window, 0.5)),
        "window_max_ms": ms(*window.last().unwrap()),
    });
    println!("{}", serde_json::to_string_pretty(&json).unwrap());
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(
        out.join("cni.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
}
