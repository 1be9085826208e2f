//! Control-plane latency and memory of `policy-agent run`: 10,000 pods,
//! 1,000 policies, 100 namespaces (seeded), 50 of the pods local to a
//! simulated node. Needs root.
//!
//! - Start → ready: first install (netlink filters, the median of three;
//!   and TCX), and a restart over the pinned state (the median of three).
//! - Change → enforced, with manifests: 1,000 samples each of a policy
//!   added and a pod relabelled (and 200 of a ClusterNetworkPolicy added,
//!   each a full compile), p50, p99 and the maximum. Two ends for each:
//!   its endpoint entry changed (read from the pins; the change's later
//!   writes, such as old allows removed and revision bumps, may still be
//!   landing), and its last write (the end of the sync that carried it,
//!   read from the agent's log, which says when each sync began and
//!   ended).
//! - Churn: 100 policies added within one second (rollout-like), each
//!   timed to the end of the sync that carried it; five such bursts.
//! - Change → enforced in cluster mode: the same cluster served by the
//!   fake API server; 1,000 policies applied one at a time, each timed
//!   from the API write to its endpoint entry and to its last write.
//! - Memory: the agent's peak RSS (VmHWM), and what its own memory cgroup
//!   was charged (BPF maps included); the RSS and cgroup growth from a
//!   cluster of 1,000 pods to one of 10,000 gives the bytes per remote pod.
//!
//! `cargo bench -p policy-testbed --bench control_plane` (figures printed and
//! written to target/bench-results/control_plane.json).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "control_plane/measure.rs"]
mod measure;
#[path = "control_plane/workload.rs"]
mod workload;

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant, SystemTime},
};

use measure::{
    AGENT_LOG, Carried, Daemon, MemoryCgroup, SyncLog, agent_log_path, percentile, proc_status_kib,
    wait_until,
};
use policy_agent::datapath::bpf::{maps::BpfMaps, pins::PinLayout};
use policy_common::endpoint::{
    ENDPOINT_INGRESS_ISOLATED, ENDPOINT_INGRESS_TIERED, ENDPOINT_INGRESS_UPDATING,
};
use policy_testbed::{
    SimNode, SimPod, cleanup_prefix,
    fixtures::fake_apiserver::{self, FakeApi, StreamingLists},
};
use rand::{SeedableRng, rngs::StdRng};
use workload::{
    LOCAL, NAMESPACES, PODS_PER_NS, POLICIES_PER_NS, namespace_file, pod_ip, policy_file,
};

const PREFIX: &str = "bcp";
/// Samples of a policy added and of a pod relabelled: 1,000 put ten above
/// the p99, so it is not the third largest.
const SAMPLES: usize = 1000;
/// Samples of a ClusterNetworkPolicy added (each a full compile).
const CLUSTER_POLICY_SAMPLES: usize = 200;
/// Changes of a churn burst, spread over one second.
const CHURN: usize = 100;
/// Churn bursts: five put five samples above the p99.
const CHURN_BURSTS: usize = 5;
/// Namespaces of the small cluster the per-pod memory is measured against.
const SMALL_NAMESPACES: usize = 10;
const PORT: u16 = 19490;

/// Where the agent reads the cluster.
enum Source<'a> {
    Manifests(&'a Path),
    /// The fake API server, through this kubeconfig.
    Cluster(&'a Path),
}

/// A NetworkPolicy over p000 (app0, version v0) opening `port`: isolates
/// p000 for ingress.
fn extra_policy(name: &str, port: u32) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: ns000}}\nspec:\n  podSelector: {{matchLabels: {{version: v0, app: app0}}}}\n  ingress: [{{ports: [{{port: {port}}}]}}]\n"
    )
}

/// Writes the cluster's manifests (its first `namespaces` namespaces).
fn write_cluster(dir: &Path, namespaces: usize) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = StdRng::seed_from_u64(42);
    for ns in 0..namespaces {
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
}

/// Samples sorted, as p50 / p99 / max in ms; for changes timed to the
/// sync that carried them, the medians of the source's read and of the
/// reconcile too.
struct Figures {
    p50: f64,
    p99: f64,
    max: f64,
    parts: Option<(f64, f64)>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Figures {
    fn of(mut v: Vec<Duration>) -> Self {
        v.sort();
        Self {
            p50: ms(percentile(&v, 0.5)),
            p99: ms(percentile(&v, 0.99)),
            max: ms(*v.last().unwrap()),
            parts: None,
        }
    }

    fn of_carried(v: &[Carried]) -> Self {
        let median = |mut d: Vec<Duration>| {
            d.sort();
            ms(d[d.len() / 2])
        };
        Self {
            parts: Some((
                median(v.iter().map(|c| c.read).collect()),
                median(v.iter().map(|c| c.reconcile).collect()),
            )),
            ..Self::of(v.iter().map(|c| c.total).collect())
        }
    }

    fn json(&self, key: &str, out: &mut serde_json::Map<String, serde_json::Value>) {
        out.insert(format!("{key}_p50_ms"), self.p50.into());
        out.insert(format!("{key}_p99_ms"), self.p99.into());
        out.insert(format!("{key}_max_ms"), self.max.into());
        if let Some((read, reconcile)) = self.parts {
            out.insert(format!("{key}_read_p50_ms"), read.into());
            out.insert(format!("{key}_reconcile_p50_ms"), reconcile.into());
        }
    }

    fn line(&self, what: &str) {
        let parts = self.parts.map_or(String::new(), |(read, reconcile)| {
            format!(" (medians: source read {read:.1} ms, reconcile {reconcile:.1} ms)")
        });
        println!(
            "  {what}: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms{parts}",
            self.p50, self.p99, self.max
        );
    }
}

fn main() {
    let dir = std::env::temp_dir().join("policy-agent-bench-control-plane");
    let small_dir = std::env::temp_dir().join("policy-agent-bench-control-plane-small");
    write_cluster(&dir, NAMESPACES);
    write_cluster(&small_dir, SMALL_NAMESPACES);
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

    let start = |phase: &str,
                 source: Source,
                 extra: &[&str],
                 poll: Poll,
                 cgroup: Option<&MemoryCgroup>|
     -> (Daemon, u32, Duration) {
        let t = Instant::now();
        let mut command = node.node.command(policy_testbed::fixtures::agent());
        command.args(["run", "--node", "node-1", "--pin-dir", &pins]);
        match source {
            Source::Manifests(dir) => {
                command.args(["--manifests", dir.to_str().unwrap()]);
            }
            Source::Cluster(kubeconfig) => {
                command.env("KUBECONFIG", kubeconfig);
            }
        }
        command
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
            .stderr(std::fs::File::create(agent_log_path(&dir, phase)).unwrap());
        if let Some(cgroup) = cgroup {
            // Joined before exec, so every map the agent makes is charged
            // to the group.
            let procs = cgroup.procs();
            // SAFETY: only a write(2) to a path made before the fork.
            unsafe {
                command.pre_exec(move || std::fs::write(&procs, "0"));
            }
        }
        let child = command.spawn().unwrap();
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
    let reset = || {
        let _ = node
            .node
            .command(policy_testbed::fixtures::agent())
            .args(["reset", "--pin-dir", &pins])
            .output();
    };
    // Pins a run that crashed left would make the first start a restart.
    reset();
    // TCX first, for its start-up only (each attach waits for an RCU grace
    // period); the rest runs on the default, netlink filters.
    // BENCH_SKIP_TCX=1 leaves it out (while iterating: it can take minutes).
    let initial_tcx = if std::env::var_os("BENCH_SKIP_TCX").is_some() {
        None
    } else {
        let (tcx_daemon, _, initial_tcx) = start(
            "tcx",
            Source::Manifests(&dir),
            &["--attach", "tcx"],
            Poll::Thread,
            None,
        );
        drop(tcx_daemon);
        reset();
        Some(initial_tcx)
    };
    // The start as this bench measured it before: polled by a process
    // spawned every 0.5 ms, which took CPU from the start it timed.
    let (old_daemon, _, initial_spawned_poll) = start(
        "spawned-poll",
        Source::Manifests(&dir),
        &[],
        Poll::Spawned,
        None,
    );
    drop(old_daemon);
    reset();
    // Two more first installs: a start is one sample, and the machine's
    // noise is of its order; the figure is the median of three.
    let mut fresh_starts = Vec::new();
    for i in 0..2 {
        let (d, _, took) = start(
            &format!("fresh{i}"),
            Source::Manifests(&dir),
            &[],
            Poll::Thread,
            None,
        );
        drop(d);
        reset();
        fresh_starts.push(took);
    }
    // The small cluster, for the memory a remote pod costs.
    let small_cgroup = MemoryCgroup::create("policy-agent-bench-cp-small");
    let (small_daemon, small_pid, _) = start(
        "small",
        Source::Manifests(&small_dir),
        &[],
        Poll::Thread,
        small_cgroup.as_ref(),
    );
    let small_rss = proc_status_kib(small_pid, "VmRSS:");
    let small_charged = small_cgroup.as_ref().and_then(MemoryCgroup::current);
    drop(small_daemon);
    reset();
    drop(small_cgroup);

    let cgroup = MemoryCgroup::create("policy-agent-bench-cp");
    let (daemon, pid, initial) = start(
        "changes",
        Source::Manifests(&dir),
        &[],
        Poll::Thread,
        cgroup.as_ref(),
    );
    fresh_starts.push(initial);
    let verified = measure::verified_instructions(&layout.progs_dir());
    fresh_starts.sort();
    let ready_rss = proc_status_kib(pid, "VmRSS:");
    let ready_charged = cgroup.as_ref().and_then(MemoryCgroup::current);

    let p0 = ifindex(&node, &node.pods[0].host_if);
    let p1 = ifindex(&node, &node.pods[1].host_if);
    // Opened once: each poll is one map lookup (opening every pin per
    // poll took CPU from the agent being timed).
    let maps = BpfMaps::from_pins(&layout).unwrap();
    // BENCH_PROFILE=<file>: `perf record -g` of the agent through the
    // changes (its figures then include perf's overhead).
    let profile = std::env::var_os("BENCH_PROFILE").map(|out| {
        let child = std::process::Command::new("perf")
            .args(["record", "-g", "-F", "999", "-p", &pid.to_string(), "-o"])
            .arg(out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("perf");
        std::thread::sleep(Duration::from_millis(500));
        child
    });
    let endpoint = |ifindex: u32| maps.endpoint(ifindex).ok().flatten();

    // p000 runs app0; an extra policy on app "relabelled" isolates p001
    // once it carries that label. Policy add/remove: isolate p000.
    let mut add = Vec::new();
    let mut relabel = Vec::new();
    // The same changes to their last write.
    let mut log = SyncLog::new(agent_log_path(&dir, "changes"));
    let (mut add_last, mut relabel_last) = (Vec::new(), Vec::new());
    let extra = dir.join("zz-extra.yaml");
    for round in 0..SAMPLES {
        let text = extra_policy(&format!("extra{round}"), 20000 + round as u32);
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
            &namespace_file(0, round.is_multiple_of(2).then_some(1)),
        );
        wait_until("relabel", || {
            endpoint(p1).is_some_and(|e| e.identity != before)
        });
        relabel.push(t.elapsed());
        relabel_last.push(log.wait_end(t0));
    }
    // The churn: bursts of CHURN new policies, one every 10 ms, each timed
    // to the end of the sync that carried it; removed between bursts.
    let mut churn = Vec::new();
    for burst in 0..CHURN_BURSTS {
        let file = |i: usize| dir.join(format!("zz-churn{burst}-{i:03}.yaml"));
        let mut written = Vec::new();
        let t = Instant::now();
        for i in 0..CHURN {
            let due = Duration::from_secs(1) * i as u32 / CHURN as u32;
            std::thread::sleep(due.saturating_sub(t.elapsed()));
            let t0 = SystemTime::now();
            write_atomically(
                &file(i),
                &extra_policy(&format!("churn{burst}-{i}"), 21000 + i as u32),
            );
            written.push(t0);
        }
        for t0 in written {
            churn.push(log.wait_end(t0));
        }
        for i in 0..CHURN {
            std::fs::remove_file(file(i)).unwrap();
        }
        wait_until("churn removed", || {
            endpoint(p0).is_some_and(|e| e.flags & ENDPOINT_INGRESS_ISOLATED == 0)
        });
    }

    // A ClusterNetworkPolicy over p000 (compiled in full, with every
    // other): enforced once its endpoint is tiered and no longer held
    // closed (the change's last endpoint write).
    let mut cluster_policy = Vec::new();
    let mut cluster_policy_last = Vec::new();
    for round in 0..CLUSTER_POLICY_SAMPLES {
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
    if let Some(mut perf) = profile {
        // SAFETY: a signal to the child this bench spawned.
        unsafe { libc::kill(perf.id() as i32, libc::SIGINT) };
        let _ = perf.wait();
    }
    let rss = proc_status_kib(pid, "VmHWM:");
    let charged_peak = cgroup.as_ref().and_then(MemoryCgroup::peak);
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
    // A restart adopts the pinned maps, programs and links (and checks
    // every attachment); the median of three.
    let mut restarts = Vec::new();
    for i in 0..3 {
        let (daemon, _, took) = start(
            &format!("restart{i}"),
            Source::Manifests(&dir),
            &[],
            Poll::Thread,
            None,
        );
        drop(daemon);
        restarts.push(took);
    }
    restarts.sort();
    let restart = restarts[1];
    // The maps go with the reset: the next agent makes its own.
    drop(maps);
    reset();
    drop(cgroup);

    // Cluster mode: the same objects from the fake API server.
    let mut objects = vec![fake_apiserver::node("node-1", &["10.244.0.0/24"])];
    for ns in 0..NAMESPACES {
        for file in [format!("ns{ns:03}.yaml"), format!("pol{ns:03}.yaml")] {
            objects.extend(workload::objects(
                &std::fs::read_to_string(dir.join(file)).unwrap(),
            ));
        }
    }
    // What one pod event carries on the wire (our simulated pods; a real
    // workload's pods are larger).
    let pod_events: Vec<usize> = objects
        .iter()
        .filter(|o| o["kind"] == "Pod")
        .map(|o| {
            serde_json::json!({"type": "MODIFIED", "object": o})
                .to_string()
                .len()
                + 1
        })
        .collect();
    let pod_event_bytes = pod_events.iter().sum::<usize>() as f64 / pod_events.len().max(1) as f64;
    let api = FakeApi::start(&node.node, objects);
    let kubeconfig = dir.with_extension("kubeconfig");
    api.kubeconfig(&kubeconfig);
    // First from a server without streamed lists (the agent lists in
    // pages), then from one with them: the start and its peak memory.
    api.set_streaming_lists(StreamingLists::Refused);
    let (paged_daemon, paged_pid, cluster_paged_initial) = start(
        "cluster-paged",
        Source::Cluster(&kubeconfig),
        &[],
        Poll::Thread,
        None,
    );
    let cluster_paged_peak = proc_status_kib(paged_pid, "VmHWM:");
    drop(paged_daemon);
    reset();
    api.set_streaming_lists(StreamingLists::Served);
    let (daemon, cluster_pid, cluster_initial) = start(
        "cluster",
        Source::Cluster(&kubeconfig),
        &[],
        Poll::Thread,
        None,
    );
    let cluster_streamed_peak = proc_status_kib(cluster_pid, "VmHWM:");
    let maps = BpfMaps::from_pins(&layout).unwrap();
    let endpoint = |ifindex: u32| maps.endpoint(ifindex).ok().flatten();
    let mut log = SyncLog::new(agent_log_path(&dir, "cluster"));
    let (mut api_add, mut api_add_last) = (Vec::new(), Vec::new());
    for round in 0..SAMPLES {
        let name = format!("api{round}");
        let policy = workload::objects(&extra_policy(&name, 22000 + round as u32)).remove(0);
        let before = endpoint(p0).unwrap();
        let (t0, t) = (SystemTime::now(), Instant::now());
        api.apply(policy);
        wait_until("policy add (cluster)", || {
            endpoint(p0).is_some_and(|e| e.flags & ENDPOINT_INGRESS_ISOLATED != 0 && e != before)
        });
        api_add.push(t.elapsed());
        api_add_last.push(log.wait_end(t0));
        let t0 = SystemTime::now();
        api.delete("networkpolicies", "ns000", &name);
        wait_until("policy removal (cluster)", || {
            endpoint(p0).is_some_and(|e| e.flags & ENDPOINT_INGRESS_ISOLATED == 0)
        });
        log.wait_end(t0);
    }
    drop(daemon);
    drop(api);
    drop(maps);
    reset();
    drop(node);
    cleanup_prefix(PREFIX);
    if std::env::var_os("BENCH_AGENT_LOG_DIR").is_none() {
        for phase in [
            "tcx",
            "spawned-poll",
            "small",
            "changes",
            "restart",
            "cluster-paged",
            "cluster",
        ] {
            let _ = std::fs::remove_file(agent_log_path(&dir, phase));
        }
    }
    let _ = std::fs::remove_file(&kubeconfig);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&small_dir);

    let pods = NAMESPACES * PODS_PER_NS;
    let remote_pods_added = ((NAMESPACES - SMALL_NAMESPACES) * PODS_PER_NS) as f64;
    let per_remote_pod_rss = (ready_rss as f64 - small_rss as f64) * 1024.0 / remote_pods_added;
    let per_remote_pod_charged = ready_charged
        .zip(small_charged)
        .map(|(big, small)| (big as f64 - small as f64) / remote_pods_added);
    println!(
        "control plane: {pods} pods, {} policies, {NAMESPACES} namespaces, {LOCAL} local",
        NAMESPACES * POLICIES_PER_NS,
    );
    println!(
        "  start to ready (load + initial sync): netlink clsact (default) {:.0} ms (polled as before, by a process spawned every 0.5 ms: {:.0} ms), TCX {:.0} ms; restart over pinned state {:.0} ms; cluster mode (fake API server) {:.0} ms",
        ms(fresh_starts[1]),
        ms(initial_spawned_poll),
        initial_tcx.map_or(f64::NAN, ms),
        ms(restart),
        ms(cluster_initial)
    );
    println!(
        "  cluster mode, start to ready and the agent's peak RSS at ready: streamed lists {:.0} ms, {:.1} MiB; paged lists {:.0} ms, {:.1} MiB; a pod event {pod_event_bytes:.0} B on the wire",
        ms(cluster_initial),
        cluster_streamed_peak as f64 / 1024.0,
        ms(cluster_paged_initial),
        cluster_paged_peak as f64 / 1024.0,
    );
    let figures = [
        (
            "policy_add",
            "policy added -> its endpoint entry",
            Figures::of(add),
        ),
        (
            "policy_add_last_write",
            "policy added -> its last write",
            Figures::of_carried(&add_last),
        ),
        (
            "relabel",
            "pod relabelled -> its endpoint entry",
            Figures::of(relabel),
        ),
        (
            "relabel_last_write",
            "pod relabelled -> its last write",
            Figures::of_carried(&relabel_last),
        ),
        (
            "churn_last_write",
            "churn (100 policies within 1 s) -> each one's last write",
            Figures::of_carried(&churn),
        ),
        (
            "cluster_policy",
            "ClusterNetworkPolicy added -> its endpoint entry (a full compile)",
            Figures::of(cluster_policy),
        ),
        (
            "cluster_policy_last_write",
            "ClusterNetworkPolicy added -> its last write",
            Figures::of_carried(&cluster_policy_last),
        ),
        (
            "api_policy_add",
            "cluster mode: policy written to the API -> its endpoint entry",
            Figures::of(api_add),
        ),
        (
            "api_policy_add_last_write",
            "cluster mode: policy written to the API -> its last write",
            Figures::of_carried(&api_add_last),
        ),
    ];
    for (_, what, f) in &figures {
        f.line(what);
    }
    println!(
        "  verifier, instructions processed per program: {}",
        verified
            .iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  order check between full passes ({checks} during the changes): mean {check_mean_ms:.2} ms, max {check_max_ms:.2} ms"
    );
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "  agent peak RSS: {:.1} MiB; its cgroup's peak charge (BPF maps included): {}",
        rss as f64 / 1024.0,
        charged_peak.map_or("not measurable here".into(), |b| format!(
            "{:.1} MiB",
            mib(b)
        ))
    );
    println!(
        "  per remote pod ({} -> {pods} pods, at ready): RSS {per_remote_pod_rss:.0} B, cgroup charge {}",
        SMALL_NAMESPACES * PODS_PER_NS,
        per_remote_pod_charged.map_or("not measurable here".into(), |b| format!("{b:.0} B"))
    );
    let mut json = serde_json::json!({
        "pods": pods, "policies": NAMESPACES * POLICIES_PER_NS, "namespaces": NAMESPACES, "local_pods": LOCAL,
        "initial_ready_ms": ms(fresh_starts[1]),
        "initial_ready_all_ms": fresh_starts.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        "restart_ready_all_ms": restarts.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        "verified_instructions": verified.iter().map(|(name, n)| serde_json::json!({"program": name, "instructions": n})).collect::<Vec<_>>(),
        "initial_ready_spawned_poll_ms": ms(initial_spawned_poll),
        "initial_ready_tcx_ms": initial_tcx.map(ms),
        "restart_ready_ms": ms(restart),
        "cluster_initial_ready_ms": ms(cluster_initial),
        "cluster_paged_initial_ready_ms": ms(cluster_paged_initial),
        "cluster_peak_at_ready_mib": cluster_streamed_peak as f64 / 1024.0,
        "cluster_paged_peak_at_ready_mib": cluster_paged_peak as f64 / 1024.0,
        "pod_event_bytes": pod_event_bytes,
        "samples": SAMPLES,
        "cluster_policy_samples": CLUSTER_POLICY_SAMPLES,
        "churn": CHURN,
        "churn_bursts": CHURN_BURSTS,
        "peak_rss_mib": rss as f64 / 1024.0,
        "cgroup_peak_mib": charged_peak.map(mib),
        "small_cluster_pods": SMALL_NAMESPACES * PODS_PER_NS,
        "per_remote_pod_rss_bytes": per_remote_pod_rss,
        "per_remote_pod_cgroup_bytes": per_remote_pod_charged,
        "order_checks": checks as u64, "order_check_mean_ms": check_mean_ms, "order_check_max_ms": check_max_ms,
    });
    let out = json.as_object_mut().unwrap();
    for (key, _, f) in &figures {
        f.json(key, out);
    }
    write_result("control_plane", &json);
}

fn ifindex(node: &SimNode, host_if: &str) -> u32 {
    let out = node.node.ip(&["-o", "link", "show", host_if]).unwrap();
    out.split(':').next().unwrap().trim().parse().unwrap()
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
