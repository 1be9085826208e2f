//! The datapaths side by side on a simulated node: TCP throughput (iperf3)
//! and first-packet latency of new connections between two pods, with no
//! program, through the BPF classifiers, and through the iptables
//! fallback, at 10, 100 and 1,000 policies over 10,000 pods; and the time
//! each takes to apply. Also at 1,000 policies through the server's
//! ClusterIP: the node runs the kube-proxy stand-in (iptables mode, its
//! rules in place for every configuration, as on a real node) and the
//! client's egress is judged after its DNAT. Needs root and iperf3.
//! `cargo bench -p policy-testbed --bench system`.
//!
//! Measured in rounds: in every round, each configuration is measured
//! right after a baseline with nothing installed (the same warm-up before
//! both), so every ratio is taken within a round and the figures are
//! medians over rounds; a shared machine drifts by more between minutes
//! than between neighbouring measurements. The policy is checked in force
//! (a third pod's connection is refused by it, the client's passes) before
//! and after each measurement.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    fmt::Write as _,
    io::Read as _,
    net::{IpAddr, SocketAddr, TcpStream},
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use policy_agent::{
    cluster::ClusterState,
    source::manifests::{LoadedManifests, load_text},
};
use policy_testbed::{
    NODE_V4, NetNs, Servers, SimNode, SimPod, cleanup_prefix,
    kube_proxy::{KubeProxy, ProxyConfig, ProxyMode},
};

const PREFIX: &str = "bsys";
const PINS: &str = "/sys/fs/bpf/policy-agent-bench-sys";
const REMOTE_PODS: usize = 10_000;
const CONNECTS: usize = 1500;
/// Connections made (and not measured) before every measurement.
const WARM_CONNECTS: usize = 200;
const IPERF_SECONDS: &str = "2";
const ROUNDS: usize = 5;

fn client_ip() -> IpAddr {
    "10.244.0.10".parse().unwrap()
}
fn server_ip() -> IpAddr {
    "10.244.0.11".parse().unwrap()
}
/// A pod the server's policy does not allow.
fn intruder_ip() -> IpAddr {
    "10.244.0.12".parse().unwrap()
}
/// The server's Service.
fn cluster_ip() -> IpAddr {
    "10.96.0.80".parse().unwrap()
}

/// The server's Service (HTTP and iperf3) and its EndpointSlice.
fn service() -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: server, namespace: ns000}}\nspec:\n  clusterIP: {vip}\n  clusterIPs: [{vip}]\n  selector: {{app: server}}\n  ports: [{{name: http, port: 80, protocol: TCP}}, {{name: iperf, port: 5201, protocol: TCP}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: server-1, namespace: ns000, labels: {{kubernetes.io/service-name: server}}}}\naddressType: IPv4\nendpoints: [{{addresses: [{ip}], conditions: {{ready: true}}, nodeName: node-1}}]\nports: [{{name: http, port: 80, protocol: TCP}}, {{name: iperf, port: 5201, protocol: TCP}}]\n",
        vip = cluster_ip(),
        ip = server_ip()
    )
}

/// The cluster state kube-proxy syncs (the Service and its slice).
fn proxy_state() -> ClusterState {
    let mut loaded = LoadedManifests::default();
    load_text(Path::new("service.yaml"), &service(), &mut loaded);
    let state = loaded.cluster_state("node-1", vec![IpAddr::V4(NODE_V4)]);
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    assert_eq!(state.services.len(), 1, "the Service was not read");
    state
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
    for (name, ip) in [
        ("client", client_ip()),
        ("server", server_ip()),
        ("intruder", intruder_ip()),
    ] {
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
        .command(policy_testbed::fixtures::agent())
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
/// first-packet path of every connection, both directions. The first
/// `WARM_CONNECTS` are not measured. (mean, p50, p99) in µs.
fn connect_latency(client: &NetNs, to: SocketAddr) -> (f64, f64, f64) {
    let handle = client
        .spawn(move || {
            let mut samples = Vec::with_capacity(CONNECTS);
            let mut buf = [0u8; 3];
            for i in 0..WARM_CONNECTS + CONNECTS {
                let t = Instant::now();
                let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2)).unwrap();
                s.read_exact(&mut buf).unwrap();
                if i >= WARM_CONNECTS {
                    samples.push(t.elapsed());
                }
                // Closed with a reset: tens of thousands of connections to
                // one server port would otherwise fill the ephemeral ports
                // with TIME_WAIT, and connect() would slow down searching
                // for a free one (then fail).
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
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

/// Whether a TCP connection from `from` to the server's port 80 is
/// answered within 300 ms.
fn connects(from: &NetNs, to: SocketAddr) -> bool {
    from.spawn(move || {
        TcpStream::connect_timeout(&to, Duration::from_millis(300))
            .and_then(|mut s| {
                let mut buf = [0u8; 3];
                s.set_read_timeout(Some(Duration::from_millis(300)))?;
                s.read_exact(&mut buf)
            })
            .is_ok()
    })
    .unwrap()
    .join()
    .unwrap()
    .unwrap()
}

/// The server's policy is in force: the client gets through, the
/// intruder does not (no policy: both do).
fn assert_enforced(node: &SimNode, to: SocketAddr, enforced: bool, when: &str) {
    assert!(
        connects(&node.pods[0].netns, to),
        "{when}: the client is refused"
    );
    assert_eq!(
        connects(&node.pods[2].netns, to),
        !enforced,
        "{when}: the intruder is {}",
        if enforced { "let in" } else { "refused" }
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn iperf(node: &SimNode, to: IpAddr) -> f64 {
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
            &to.to_string(),
            "-p",
            "5201",
            "-t",
            IPERF_SECONDS,
            "-J",
        ])
        .output()
        .unwrap();
    let _ = srv.wait();
    assert!(
        out.status.success(),
        "iperf3: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("iperf3 JSON");
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap()
        / 1e9
}

/// One measurement: connection latency (mean, p50, p99 in µs) and, if
/// asked, iperf3 throughput (Gbit/s). Warmed the same way every time.
#[derive(Clone, Copy)]
struct Sample {
    mean: f64,
    p50: f64,
    p99: f64,
    gbps: Option<f64>,
}

fn measure(node: &SimNode, to: SocketAddr, with_iperf: bool) -> Sample {
    let (mean, p50, p99) = connect_latency(&node.pods[0].netns, to);
    Sample {
        mean,
        p50,
        p99,
        gbps: with_iperf.then(|| iperf(node, to.ip())),
    }
}

fn main() {
    cleanup_prefix(PREFIX);
    let pod = |name: &str, ip: IpAddr, tcp: Vec<u16>| SimPod {
        namespace: "ns000".into(),
        name: name.into(),
        ips: vec![ip],
        tcp_ports: tcp,
        udp_ports: vec![],
    };
    let pods = vec![
        pod("client", client_ip(), vec![]),
        pod("server", server_ip(), vec![80]),
        pod("intruder", intruder_ip(), vec![]),
    ];
    let node = SimNode::create(PREFIX, &pods).unwrap();
    let _servers = Servers::start(&node).unwrap();
    let dir = std::env::temp_dir().join("policy-agent-bench-system");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir_s = dir.to_str().unwrap().to_owned();
    let proxy = KubeProxy::install(
        &node.node,
        ProxyMode::Iptables,
        ProxyConfig {
            node_name: "node-1".into(),
            node_ips: vec![IpAddr::V4(NODE_V4)],
            cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
            service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
        },
        &proxy_state(),
    )
    .unwrap();
    // (datapath, policies, through the ClusterIP)
    let mut configs: Vec<(&str, usize, bool)> = ["bpf", "iptables"]
        .into_iter()
        .flat_map(|d| [10usize, 100, 1000].map(|p| (d, p, false)))
        .collect();
    configs.extend([("bpf", 1000, true), ("iptables", 1000, true)]);
    // Per configuration: (apply ms, baseline sample, measured sample) per round.
    let mut samples: Vec<Vec<(f64, Sample, Sample)>> = vec![Vec::new(); configs.len()];
    for round in 0..ROUNDS {
        for (i, (datapath, policies, via_service)) in configs.iter().enumerate() {
            let with_iperf = *policies == 1000;
            let to = SocketAddr::new(
                if *via_service {
                    cluster_ip()
                } else {
                    server_ip()
                },
                80,
            );
            assert_enforced(&node, to, false, "baseline");
            let none = measure(&node, to, with_iperf);
            std::fs::write(dir.join("cluster.yaml"), manifests(*policies) + &service()).unwrap();
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
            assert_enforced(&node, to, true, "before the measurement");
            let measured = measure(&node, to, with_iperf);
            assert_enforced(&node, to, true, "after the measurement");
            agent(&node, &["reset"]);
            eprintln!(
                "round {round}: {datapath} @ {policies}{}: connect {:.0} us vs {:.0} us with nothing installed{}",
                if *via_service { " via ClusterIP" } else { "" },
                measured.mean,
                none.mean,
                match (measured.gbps, none.gbps) {
                    (Some(a), Some(b)) => format!("; iperf3 {a:.2} vs {b:.2} Gbit/s"),
                    _ => String::new(),
                }
            );
            samples[i].push((took.as_secs_f64() * 1000.0, none, measured));
        }
    }

    proxy.remove().unwrap();
    let mut results = serde_json::Map::new();
    let mut report = String::new();
    for (key, via_service) in [("none", false), ("none_clusterip", true)] {
        let all_none: Vec<Sample> = configs
            .iter()
            .zip(&samples)
            .filter(|((_, _, v), _)| *v == via_service)
            .flat_map(|(_, rounds)| rounds.iter().map(|(_, n, _)| *n))
            .collect();
        let none_gbps: Vec<f64> = all_none.iter().filter_map(|s| s.gbps).collect();
        let none = serde_json::json!({
            "connect_mean_us": median(all_none.iter().map(|s| s.mean).collect()),
            "connect_p50_us": median(all_none.iter().map(|s| s.p50).collect()),
            "connect_p99_us": median(all_none.iter().map(|s| s.p99).collect()),
            "iperf_gbps": median(none_gbps.clone()),
            "measurements": all_none.len(), "iperf_runs": none_gbps.len(),
        });
        let _ = writeln!(
            report,
            "nothing installed{} ({} measurements): new connection mean {:.0} us, p99 {:.0} us; iperf3 {:.2} Gbit/s ({} runs)",
            if via_service {
                ", via the ClusterIP"
            } else {
                ""
            },
            all_none.len(),
            none["connect_mean_us"].as_f64().unwrap(),
            none["connect_p99_us"].as_f64().unwrap(),
            none["iperf_gbps"].as_f64().unwrap(),
            none_gbps.len()
        );
        results.insert(key.into(), none);
    }
    for ((datapath, policies, via_service), rounds) in configs.iter().zip(&samples) {
        let m = |f: fn(&Sample) -> f64| median(rounds.iter().map(|(_, _, s)| f(s)).collect());
        let ratio = median(rounds.iter().map(|(_, n, s)| s.mean / n.mean).collect());
        let mut entry = serde_json::json!({
            "apply_ms": median(rounds.iter().map(|(a, _, _)| *a).collect()),
            "connect_mean_us": m(|s| s.mean), "connect_p50_us": m(|s| s.p50), "connect_p99_us": m(|s| s.p99),
            "connect_ratio_to_none": ratio, "rounds": rounds.len(),
        });
        let mut line = format!(
            "{datapath} @ {policies} policies{}: apply {:.0} ms; new connection mean {:.0} us ({ratio:.2}x nothing installed, median of per-round ratios), p99 {:.0} us",
            if *via_service {
                " via the ClusterIP"
            } else {
                ""
            },
            entry["apply_ms"].as_f64().unwrap(),
            entry["connect_mean_us"].as_f64().unwrap(),
            entry["connect_p99_us"].as_f64().unwrap(),
        );
        let pairs: Vec<(f64, f64)> = rounds
            .iter()
            .filter_map(|(_, n, s)| Some((s.gbps?, n.gbps?)))
            .collect();
        if !pairs.is_empty() {
            let gbps = median(pairs.iter().map(|(s, _)| *s).collect());
            let r = median(pairs.iter().map(|(s, n)| s / n).collect());
            entry["iperf_gbps"] = serde_json::json!(gbps);
            entry["iperf_ratio_to_none"] = serde_json::json!(r);
            entry["iperf_runs"] = serde_json::json!(pairs.len());
            let _ = write!(
                line,
                "; iperf3 {gbps:.2} Gbit/s ({:.1}% of nothing installed, median of {} per-round ratios)",
                100.0 * r,
                pairs.len()
            );
        }
        let _ = writeln!(report, "{line}");
        let suffix = if *via_service { "_clusterip" } else { "" };
        results.insert(format!("{datapath}_{policies}{suffix}"), entry);
    }
    print!("{report}");
    let mut json = serde_json::Value::Object(results);
    json["rounds"] = serde_json::json!(ROUNDS);
    json["connects"] = serde_json::json!(CONNECTS);
    json["warm_connects"] = serde_json::json!(WARM_CONNECTS);
    json["iperf_seconds"] = serde_json::json!(IPERF_SECONDS.parse::<f64>().unwrap());
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::write(
        out_dir.join("system.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
