//! Control-plane latency of `policy-agent run`: 10,000 pods, 1,000
//! policies, 100 namespaces (seeded), 50 of the pods local to a simulated
//! node. Measures the initial sync, then, 200 times each, the time from a
//! changed manifest (a policy added, a pod relabelled) to the pinned maps
//! holding the change (p50, p99 and the maximum; 200 samples leave two
//! above the p99), and the agent's peak RSS. Needs root.
//!
//! Two ends for each change: its endpoint entry changed (read from the
//! pins; the change's later writes, such as old allows removed and
//! revision bumps, may still be landing), and its last write (the end of
//! the sync that carried it, read from the agent's log, which says when
//! each sync ended).
//!
//! `cargo bench -p policy-testbed --bench control_plane` (figures printed and
//! written to target/bench-results/control_plane.json).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    fmt::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant, SystemTime},
};

use policy_agent::datapath::bpf::{maps::BpfMaps, pins::PinLayout};
use policy_common::endpoint::{
    ENDPOINT_INGRESS_ISOLATED, ENDPOINT_INGRESS_TIERED, ENDPOINT_INGRESS_UPDATING,
};
use policy_testbed::{SimNode, SimPod, cleanup_prefix, fixtures::flow_reader::parse_rfc3339};
use rand::{Rng, SeedableRng, rngs::StdRng};

const PREFIX: &str = "bcp";
const NAMESPACES: usize = 100;
const PODS_PER_NS: usize = 100;
const POLICIES_PER_NS: usize = 10;
const LOCAL: usize = 50;
/// Samples of each change. A p99 needs at least two samples above it to
/// be more than the maximum: 200 samples put two there.
const ROUNDS: usize = 200;
const PORT: u16 = 19490;

fn pod_ip(ns: usize, i: usize) -> IpAddr {
    let n = (ns * PODS_PER_NS + i) as u32;
    if n < LOCAL as u32 {
        IpAddr::from([10, 244, 0, 10 + n as u8])
    } else {
        IpAddr::V4(std::net::Ipv4Addr::from(0x0a64_0000u32 + n))
    }
}

fn namespace_file(ns: usize, relabel: Option<usize>) -> String {
    let mut out = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: ns{ns:03}, labels: {{team: t{}, env: {}}}}}\n",
        ns % 10,
        if ns.is_multiple_of(3) { "prod" } else { "dev" }
    );
    for i in 0..PODS_PER_NS {
        let node = if ns * PODS_PER_NS + i < LOCAL {
            "node-1".to_owned()
        } else {
            format!("node-{}", 2 + (ns * PODS_PER_NS + i) % 19)
        };
        let app = if relabel == Some(i) {
            "relabelled".to_owned()
        } else {
            format!("app{}", i % 10)
        };
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p{i:03}, namespace: ns{ns:03}, labels: {{app: {app}, tier: {}, version: v{}}}}}\nspec: {{nodeName: {node}, containers: [{{name: c, image: x, ports: [{{name: http, containerPort: {}}}, {{name: metrics, containerPort: 9100}}]}}]}}\nstatus: {{phase: Running, podIPs: [{{ip: {}}}]}}\n",
            if i.is_multiple_of(3) { "front" } else { "back" },
            i % 2,
            if i.is_multiple_of(2) { 80 } else { 8080 },
            pod_ip(ns, i)
        );
    }
    out
}

fn policy_file(ns: usize, rng: &mut StdRng) -> String {
    let mut out = String::new();
    for k in 0..POLICIES_PER_NS {
        let target = rng.random_range(0..10);
        let peer = rng.random_range(0..10);
        let spec = match k % 5 {
            0 => format!(
                "podSelector: {{matchLabels: {{app: app{target}}}}}\n  ingress:\n    - from: [{{podSelector: {{matchLabels: {{app: app{peer}}}}}}}]\n      ports: [{{port: http}}]"
            ),
            1 => format!(
                "podSelector: {{matchLabels: {{app: app{target}}}}}\n  ingress:\n    - from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}, podSelector: {{matchLabels: {{tier: front}}}}}}]\n      ports: [{{port: 8000, endPort: 8100}}]",
                peer
            ),
            2 => format!(
                "podSelector: {{matchExpressions: [{{key: app, operator: In, values: [app{target}, app{peer}]}}]}}\n  ingress:\n    - from: [{{ipBlock: {{cidr: 10.100.0.0/16, except: [10.100.{}.0/24]}}}}]",
                rng.random_range(0..40)
            ),
            3 => format!(
                "podSelector: {{matchLabels: {{app: app{target}}}}}\n  policyTypes: [Egress]\n  egress:\n    - to: [{{namespaceSelector: {{matchLabels: {{env: prod}}}}}}]\n      ports: [{{port: metrics}}, {{protocol: UDP, port: 53}}]"
            ),
            _ => format!(
                "podSelector: {{matchLabels: {{tier: back}}}}\n  ingress:\n    - from: [{{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: app{peer}}}}}}}]"
            ),
        };
        let _ = write!(
            out,
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: pol{k:02}, namespace: ns{ns:03}}}\nspec:\n  {spec}\n"
        );
    }
    out
}

/// The nearest-rank percentile of sorted samples; refuses a percentile
/// the samples cannot tell apart from the maximum (fewer than two samples
/// above it).
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let above = (sorted.len() as f64 * (1.0 - p)).floor();
    assert!(
        above >= 2.0,
        "{} samples cannot give a p{}: it would be the maximum",
        sorted.len(),
        p * 100.0
    );
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn ifindex(node: &SimNode, host_if: &str) -> u32 {
    let out = node.node.ip(&["-o", "link", "show", host_if]).unwrap();
    out.split(':').next().unwrap().trim().parse().unwrap()
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what} never happened"
        );
        std::thread::sleep(Duration::from_micros(500));
    }
    start.elapsed()
}

/// Where the agent's log goes: BENCH_AGENT_LOG_FILE when set, else a
/// file beside the manifests. Its sync lines say when each change's last
/// write landed.
fn agent_log_path(dir: &Path) -> PathBuf {
    std::env::var_os("BENCH_AGENT_LOG_FILE")
        .map_or_else(|| dir.with_extension("agent.log"), PathBuf::from)
}

/// The agent's log level: the lines the sync log reads, warnings else.
const AGENT_LOG: &str =
    "warn,policy_agent::worker::reconcile=info,policy_agent::source::manifests::watch=info";

/// The agent's log, read as it grows: the end of the sync that carried
/// a manifest change.
struct SyncLog {
    path: PathBuf,
    offset: usize,
    /// When the manifest watcher read the change being waited for.
    changed: Option<SystemTime>,
}

impl SyncLog {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            changed: None,
        }
    }

    /// The end of the first sync after the first manifest change read at
    /// or after `t0` (None: not in the log yet).
    fn end_after(&mut self, t0: SystemTime) -> Option<SystemTime> {
        let text = std::fs::read(&self.path).ok()?;
        let new = text.get(self.offset..)?;
        // Whole lines only; a partial last line is read next time.
        let upto = new.iter().rposition(|b| *b == b'\n')? + 1;
        let lines = String::from_utf8_lossy(&new[..upto]).into_owned();
        for line in lines.lines() {
            self.offset += line.len() + 1;
            let Some(t) = line.split_whitespace().next().and_then(parse_rfc3339) else {
                continue;
            };
            if t < t0 {
                continue;
            }
            if line.contains("manifests changed") && self.changed.is_none() {
                self.changed = Some(t);
            } else if line.contains(" synced ") && self.changed.is_some_and(|c| t >= c) {
                self.changed = None;
                return Some(t);
            }
        }
        None
    }

    /// Waits (30 s at most) for [`Self::end_after`]; the time from `t0`.
    fn wait_end(&mut self, t0: SystemTime) -> Duration {
        let start = Instant::now();
        loop {
            if let Some(end) = self.end_after(t0) {
                return end.duration_since(t0).unwrap_or_default();
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no sync ended after the change in {}",
                self.path.display()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let dir = std::env::temp_dir().join("policy-agent-bench-control-plane");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = StdRng::seed_from_u64(42);
    for ns in 0..NAMESPACES {
        std::fs::write(
            dir.join(format!("ns{ns:03}.yaml")),
            namespace_file(ns, None),
        )
        .unwrap();
        std::fs::write(
            dir.join(format!("pol{ns:03}.yaml")),
            policy_file(ns, &mut rng),
        )
        .unwrap();
    }
    cleanup_prefix(PREFIX);
    let local: Vec<SimPod> = (0..LOCAL)
        .map(|i| SimPod {
            namespace: "ns000".into(),
            name: format!("p{i:03}"),
            ips: vec![pod_ip(0, i)],
            tcp_ports: vec![],
            udp_ports: vec![],
        })
        .collect();
    let node = SimNode::create(PREFIX, &local).unwrap();
    let layout = PinLayout::new("/sys/fs/bpf/policy-agent-bench-cp");
    let pins = layout.root().to_str().unwrap().to_owned();

    let log_path = agent_log_path(&dir);
    let start = |extra: &[&str], poll: Poll| -> (Daemon, u32, Duration) {
        let t = Instant::now();
        let child = node
            .node
            .command(policy_testbed::fixtures::agent())
            .args([
                "run",
                "--manifests",
                dir.to_str().unwrap(),
                "--node",
                "node-1",
                "--pin-dir",
                &pins,
            ])
            .args([
                "--listen",
                &format!("127.0.0.1:{PORT}"),
                "--datapath",
                "bpf",
            ])
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("BENCH_AGENT_LOG").unwrap_or_else(|_| AGENT_LOG.into()),
            )
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap();
        let pid = child.id();
        let daemon = Daemon(child);
        match poll {
            Poll::Thread => wait_ready(&node),
            Poll::Spawned => {
                wait_until("ready", || {
                    http_get(&node, "/readyz").starts_with("HTTP/1.1 200")
                });
            }
        }
        (daemon, pid, t.elapsed())
    };
    // TCX first, for its start-up only (each attach waits for an RCU grace
    // period); the rest runs on the default, netlink filters.
    let reset = || {
        let _ = node
            .node
            .command(policy_testbed::fixtures::agent())
            .args(["reset", "--pin-dir", &pins])
            .output();
    };
    let (tcx_daemon, _, initial_tcx) = start(&["--attach", "tcx"], Poll::Thread);
    drop(tcx_daemon);
    reset();
    // The start as this bench measured it before: polled by a process
    // spawned every 0.5 ms, which took CPU from the start it timed.
    let (old_daemon, _, initial_spawned_poll) = start(&[], Poll::Spawned);
    drop(old_daemon);
    reset();
    let (daemon, pid, initial) = start(&[], Poll::Thread);

    let p0 = ifindex(&node, &node.pods[0].host_if);
    let p1 = ifindex(&node, &node.pods[1].host_if);
    // Opened once: each poll is one map lookup (opening every pin per
    // poll took CPU from the agent being timed).
    let maps = BpfMaps::from_pins(&layout).unwrap();
    let endpoint = |ifindex: u32| maps.endpoint(ifindex).ok().flatten();

    // p000 runs app0; an extra policy on app "relabelled" isolates p001
    // once it carries that label. Policy add/remove: isolate p000.
    let mut add = Vec::new();
    let mut relabel = Vec::new();
    let mut cluster_policy = Vec::new();
    // The same changes to their last write.
    let mut log = SyncLog::new(log_path.clone());
    let (mut add_last, mut relabel_last, mut cluster_policy_last) =
        (Vec::new(), Vec::new(), Vec::new());
    let extra = dir.join("zz-extra.yaml");
    for round in 0..ROUNDS {
        let marker = format!("extra{round}");
        let text = format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {marker}, namespace: ns000}}\nspec:\n  podSelector: {{matchLabels: {{version: v0, app: app0}}}}\n  ingress: [{{ports: [{{port: {}}}]}}]\n",
            20000 + round
        );
        let before = endpoint(p0).unwrap();
        let (t0, t) = (SystemTime::now(), Instant::now());
        write_atomically(&extra, &text);
        wait_until("policy add", || {
            endpoint(p0).is_some_and(|e| e.flags & ENDPOINT_INGRESS_ISOLATED != 0 && e != before)
        });
        add.push(t.elapsed());
        add_last.push(log.wait_end(t0));
        let t0 = SystemTime::now();
        std::fs::remove_file(&extra).unwrap();
        wait_until("policy removal", || {
            endpoint(p0).is_some_and(|e| e.flags & ENDPOINT_INGRESS_ISOLATED == 0)
        });
        log.wait_end(t0);

        let before = endpoint(p1).unwrap().identity;
        let (t0, t) = (SystemTime::now(), Instant::now());
        write_atomically(
            &dir.join("ns000.yaml"),
            &namespace_file(
                0,
                if round.is_multiple_of(2) {
                    Some(1)
                } else {
                    None
                },
            ),
        );
        wait_until("relabel", || {
            endpoint(p1).is_some_and(|e| e.identity != before)
        });
        relabel.push(t.elapsed());
        relabel_last.push(log.wait_end(t0));

        // A ClusterNetworkPolicy over p000 (compiled in full, with every
        // other): enforced once its endpoint is tiered and no longer held
        // closed (the change's last endpoint write).
        let before = endpoint(p0).unwrap();
        let (t0, t) = (SystemTime::now(), Instant::now());
        write_atomically(
            &extra,
            &format!(
                "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: guard{round}}}\nspec:\n  tier: Admin\n  priority: 10\n  subject: {{pods: {{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: ns000}}}}, podSelector: {{matchLabels: {{app: app0}}}}}}}}\n  ingress:\n  - {{action: Deny, from: [{{namespaces: {{}}}}], protocols: [{{tcp: {{destinationPort: {{number: {}}}}}}}]}}\n",
                30000 + round
            ),
        );
        wait_until("cluster policy add", || {
            endpoint(p0).is_some_and(|e| {
                e.flags & ENDPOINT_INGRESS_TIERED != 0
                    && e.flags & ENDPOINT_INGRESS_UPDATING == 0
                    && e != before
            })
        });
        cluster_policy.push(t.elapsed());
        cluster_policy_last.push(log.wait_end(t0));
        let t0 = SystemTime::now();
        std::fs::remove_file(&extra).unwrap();
        wait_until("cluster policy removal", || {
            endpoint(p0).is_some_and(|e| e.flags & ENDPOINT_INGRESS_TIERED == 0)
        });
        log.wait_end(t0);
    }
    let rss = rss_peak_kib(pid);
    // The order checks that ran meanwhile (every 5 s, over the local
    // pods' interfaces and the uplink).
    let metrics = http_get(&node, "/metrics");
    let metric = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
    };
    let checks = metric("policy_agent_order_check_seconds_count");
    let check_mean_ms = if checks > 0.0 {
        metric("policy_agent_order_check_seconds_sum") * 1000.0 / checks
    } else {
        0.0
    };
    let check_max_ms = metric("policy_agent_order_check_max_seconds") * 1000.0;
    drop(daemon);
    // A restart adopts the pinned maps, programs and links.
    let (daemon, _, restart) = start(&[], Poll::Thread);
    drop(daemon);
    drop(maps);
    reset();
    drop(node);
    cleanup_prefix(PREFIX);
    if std::env::var_os("BENCH_AGENT_LOG_FILE").is_none() {
        let _ = std::fs::remove_file(&log_path);
    }
    let _ = std::fs::remove_dir_all(&dir);

    for v in [
        &mut add,
        &mut relabel,
        &mut cluster_policy,
        &mut add_last,
        &mut relabel_last,
        &mut cluster_policy_last,
    ] {
        v.sort();
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "control plane: {} pods, {} policies, {} namespaces, {LOCAL} local",
        NAMESPACES * PODS_PER_NS,
        NAMESPACES * POLICIES_PER_NS,
        NAMESPACES
    );
    println!(
        "  start to ready (load + initial sync): netlink clsact (default) {:.0} ms (polled as before, by a process spawned every 0.5 ms: {:.0} ms), TCX {:.0} ms; restart over pinned state {:.0} ms",
        ms(initial),
        ms(initial_spawned_poll),
        ms(initial_tcx),
        ms(restart)
    );
    let max = |v: &[Duration]| ms(*v.last().unwrap());
    println!(
        "  policy added -> enforced ({ROUNDS} samples): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(percentile(&add, 0.5)),
        ms(percentile(&add, 0.99)),
        max(&add)
    );
    println!(
        "  pod relabelled -> enforced ({ROUNDS} samples): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(percentile(&relabel, 0.5)),
        ms(percentile(&relabel, 0.99)),
        max(&relabel)
    );
    println!(
        "  ClusterNetworkPolicy added -> enforced ({ROUNDS} samples, each a full compile): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(percentile(&cluster_policy, 0.5)),
        ms(percentile(&cluster_policy, 0.99)),
        max(&cluster_policy)
    );
    for (what, v) in [
        ("policy added", &add_last),
        ("pod relabelled", &relabel_last),
        ("ClusterNetworkPolicy added", &cluster_policy_last),
    ] {
        println!(
            "  {what} -> its last write (the sync's end): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99)),
            max(v)
        );
    }
    println!(
        "  order check between full passes ({checks} during the changes): mean {check_mean_ms:.2} ms, max {check_max_ms:.2} ms"
    );
    println!("  agent peak RSS: {:.1} MiB", rss as f64 / 1024.0);
    let json = serde_json::json!({
        "pods": NAMESPACES * PODS_PER_NS, "policies": NAMESPACES * POLICIES_PER_NS, "namespaces": NAMESPACES, "local_pods": LOCAL,
        "initial_ready_ms": ms(initial),
        "initial_ready_spawned_poll_ms": ms(initial_spawned_poll),
        "initial_ready_tcx_ms": ms(initial_tcx),
        "restart_ready_ms": ms(restart),
        "samples": ROUNDS,
        "policy_add_p50_ms": ms(percentile(&add, 0.5)), "policy_add_p99_ms": ms(percentile(&add, 0.99)), "policy_add_max_ms": max(&add),
        "relabel_p50_ms": ms(percentile(&relabel, 0.5)), "relabel_p99_ms": ms(percentile(&relabel, 0.99)), "relabel_max_ms": max(&relabel),
        "cluster_policy_p50_ms": ms(percentile(&cluster_policy, 0.5)), "cluster_policy_p99_ms": ms(percentile(&cluster_policy, 0.99)), "cluster_policy_max_ms": max(&cluster_policy),
        "policy_add_last_write_p50_ms": ms(percentile(&add_last, 0.5)), "policy_add_last_write_p99_ms": ms(percentile(&add_last, 0.99)), "policy_add_last_write_max_ms": max(&add_last),
        "relabel_last_write_p50_ms": ms(percentile(&relabel_last, 0.5)), "relabel_last_write_p99_ms": ms(percentile(&relabel_last, 0.99)), "relabel_last_write_max_ms": max(&relabel_last),
        "cluster_policy_last_write_p50_ms": ms(percentile(&cluster_policy_last, 0.5)), "cluster_policy_last_write_p99_ms": ms(percentile(&cluster_policy_last, 0.99)), "cluster_policy_last_write_max_ms": max(&cluster_policy_last),
        "peak_rss_mib": rss as f64 / 1024.0,
        "order_checks": checks as u64, "order_check_mean_ms": check_mean_ms, "order_check_max_ms": check_max_ms,
    });
    write_result("control_plane", &json);
}

/// How readiness is polled.
#[derive(Clone, Copy)]
enum Poll {
    /// From a thread of this process in the node's namespace.
    Thread,
    /// By a process spawned in the namespace every 0.5 ms (as before).
    Spawned,
}

/// Waits (30 s at most) until the agent answers /readyz with 200. Polled
/// from a thread of this process inside the node's namespace every 2 ms:
/// a process spawned per poll would take the CPU the start-up needs.
fn wait_ready(node: &SimNode) {
    use std::io::{Read as _, Write as _};
    let ready = node
        .node
        .spawn(|| {
            let start = Instant::now();
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], PORT));
            while start.elapsed() < Duration::from_secs(30) {
                if let Ok(mut s) =
                    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100))
                {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut head = [0u8; 12];
                    if s.write_all(b"GET /readyz HTTP/1.1\r\n\r\n").is_ok()
                        && s.read_exact(&mut head).is_ok()
                        && &head == b"HTTP/1.1 200"
                    {
                        return true;
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            false
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    assert!(ready, "the agent was not ready within 30 s");
}

/// A GET of the agent's HTTP server, from inside the node's namespace.
fn http_get(node: &SimNode, path: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{PORT} && printf 'GET {path} HTTP/1.1\\r\\n\\r\\n' >&3 && cat <&3"
    );
    node.node.exec("bash", &["-c", &script]).unwrap_or_default()
}

/// Writes via a temporary file and rename, as config managers do.
fn write_atomically(path: &Path, text: &str) {
    let tmp: PathBuf = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn write_result(name: &str, json: &serde_json::Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_string_pretty(json).unwrap(),
    )
    .unwrap();
}
