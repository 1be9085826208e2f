//! The datapaths side by side on a simulated node: TCP throughput (iperf3)
//! and first-packet latency of new connections between two pods, with no
//! program, through the BPF classifiers, and through the iptables
//! fallback, at 10, 100 and 1,000 policies over 10,000 pods; and the time
//! the iptables fallback takes to render and apply 1,000 policies. Needs
//! root and iperf3. `cargo bench -p policy-agent --bench system`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use policy_agent::sim::{NetNs, Servers, SimNode, SimPod, cleanup_prefix};

const AGENT: &str = env!("CARGO_BIN_EXE_policy-agent");
const PREFIX: &str = "bsys";
const PINS: &str = "/sys/fs/bpf/policy-agent-bench-sys";
const REMOTE_PODS: usize = 10_000;
const CONNECTS: usize = 1500;
const IPERF_SECONDS: &str = "4";

fn client_ip() -> IpAddr {
    "10.244.0.10".parse().unwrap()
}
fn server_ip() -> IpAddr {
    "10.244.0.11".parse().unwrap()
}

/// Namespaces, the two local pods, 10,000 remote pods, and `policies`
/// policies; the last one isolates the server and allows the client.
fn manifests(policies: usize) -> String {
    let mut out = String::new();
    for ns in 0..100 {
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: ns{ns:03}, labels: {{team: t{}}}}}\n",
            ns % 10
        );
    }
    for (name, ip) in [("client", client_ip()), ("server", server_ip())] {
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: ns000, labels: {{app: {name}}}}}\nspec: {{nodeName: node-1, containers: [{{name: c, image: x}}]}}\nstatus: {{podIPs: [{{ip: {ip}}}]}}\n"
        );
    }
    for i in 0..REMOTE_PODS {
        let ip = IpAddr::V4(std::net::Ipv4Addr::from(0x0a64_0000u32 + i as u32));
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: r{i:05}, namespace: ns{:03}, labels: {{app: app{}}}}}\nspec: {{nodeName: node-{}, containers: [{{name: c, image: x}}]}}\nstatus: {{podIPs: [{{ip: {ip}}}]}}\n",
            i % 100,
            i % 20,
            2 + i % 20
        );
    }
    for p in 0..policies.saturating_sub(1) {
        let _ = write!(
            out,
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{p:04}, namespace: ns{:03}}}\nspec:\n  podSelector: {{matchLabels: {{app: app{}}}}}\n  ingress: [{{from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}}}], ports: [{{port: {}}}]}}]\n",
            p % 100,
            p % 20,
            p % 10,
            1000 + p % 500
        );
    }
    let _ = write!(
        out,
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: server, namespace: ns000}}\nspec:\n  podSelector: {{matchLabels: {{app: server}}}}\n  ingress: [{{from: [{{podSelector: {{matchLabels: {{app: client}}}}}}], ports: [{{port: 80}}, {{port: 5201}}]}}]\n"
    );
    out
}

fn agent(node: &SimNode, args: &[&str]) -> Duration {
    let t = Instant::now();
    let out = node
        .node
        .command(AGENT)
        .args(args)
        .args(["--pin-dir", PINS])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "policy-agent {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t.elapsed()
}

/// Sequential new connections (connect and read the greeting): the
/// first-packet path of every connection, both directions.
fn connect_latency(client: &NetNs, to: SocketAddr) -> (f64, f64, f64) {
    let handle = client
        .spawn(move || {
            let mut samples = Vec::with_capacity(CONNECTS);
            let mut buf = [0u8; 3];
            for _ in 0..CONNECTS {
                let t = Instant::now();
                let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2)).unwrap();
                s.read_exact(&mut buf).unwrap();
                samples.push(t.elapsed());
                let _ = s.write_all(b"");
            }
            samples
        })
        .unwrap();
    let mut samples = handle.join().unwrap().unwrap();
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = samples.iter().map(|d| us(*d)).sum::<f64>() / samples.len() as f64;
    (
        mean,
        us(samples[samples.len() / 2]),
        us(samples[samples.len() * 99 / 100]),
    )
}

fn iperf(node: &SimNode) -> f64 {
    let server = &node.pods[1].netns;
    let mut srv = server
        .command("iperf3")
        .args(["-s", "-1", "-p", "5201"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let out = node.pods[0]
        .netns
        .command("iperf3")
        .args([
            "-c",
            &server_ip().to_string(),
            "-p",
            "5201",
            "-t",
            IPERF_SECONDS,
            "-J",
        ])
        .output()
        .unwrap();
    let _ = srv.wait();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("iperf3 JSON");
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap()
        / 1e9
}

fn main() {
    cleanup_prefix(PREFIX);
    let pods = vec![
        SimPod {
            namespace: "ns000".into(),
            name: "client".into(),
            ips: vec![client_ip()],
            tcp_ports: vec![],
            udp_ports: vec![],
        },
        SimPod {
            namespace: "ns000".into(),
            name: "server".into(),
            ips: vec![server_ip()],
            tcp_ports: vec![80],
            udp_ports: vec![],
        },
    ];
    let node = SimNode::create(PREFIX, &pods).unwrap();
    let _servers = Servers::start(&node).unwrap();
    let dir = std::env::temp_dir().join("policy-agent-bench-system");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir_s = dir.to_str().unwrap().to_owned();
    let to = SocketAddr::new(server_ip(), 80);
    let mut results = serde_json::Map::new();
    let mut report = String::new();

    let (mean, p50, p99) = connect_latency(&node.pods[0].netns, to);
    let base_gbps = iperf(&node);
    let _ = writeln!(
        report,
        "no program: {base_gbps:.2} Gbit/s; new connection mean {mean:.0} us, p50 {p50:.0} us, p99 {p99:.0} us"
    );
    results.insert("none".into(), serde_json::json!({"iperf_gbps": base_gbps, "connect_mean_us": mean, "connect_p50_us": p50, "connect_p99_us": p99}));

    for datapath in ["bpf", "iptables"] {
        for policies in [10usize, 100, 1000] {
            std::fs::write(dir.join("cluster.yaml"), manifests(policies)).unwrap();
            let took = agent(
                &node,
                &[
                    "apply",
                    "--manifests",
                    &dir_s,
                    "--node",
                    "node-1",
                    "--datapath",
                    datapath,
                ],
            );
            // Warm: the first connection resolves neighbours.
            let _ = connect_latency_once(&node.pods[0].netns, to);
            let (mean, p50, p99) = connect_latency(&node.pods[0].netns, to);
            let mut entry = serde_json::json!({"apply_ms": took.as_secs_f64() * 1000.0, "connect_mean_us": mean, "connect_p50_us": p50, "connect_p99_us": p99});
            let mut line = format!(
                "{datapath} @ {policies} policies: apply {:.0} ms; new connection mean {mean:.0} us ({:.2}x), p50 {p50:.0} us, p99 {p99:.0} us",
                took.as_secs_f64() * 1000.0,
                mean / results["none"]["connect_mean_us"].as_f64().unwrap()
            );
            if policies == 1000 {
                let gbps = iperf(&node);
                entry["iperf_gbps"] = serde_json::json!(gbps);
                entry["iperf_ratio_to_none"] = serde_json::json!(gbps / base_gbps);
                let _ = write!(
                    line,
                    "; iperf3 {gbps:.2} Gbit/s ({:.1}% of no program)",
                    100.0 * gbps / base_gbps
                );
            }
            let _ = writeln!(report, "{line}");
            results.insert(format!("{datapath}_{policies}"), entry);
            agent(&node, &["reset"]);
        }
    }
    print!("{report}");
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::write(
        out_dir.join("system.json"),
        serde_json::to_string_pretty(&serde_json::Value::Object(results)).unwrap(),
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

fn connect_latency_once(client: &NetNs, to: SocketAddr) -> bool {
    client
        .spawn(move || TcpStream::connect_timeout(&to, Duration::from_secs(2)).is_ok())
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}
