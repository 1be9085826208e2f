//! The demo's cluster: created, enforced, probed, and removed again (also
//! when a step fails) unless `--keep` is given.
use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::Duration,
};

use anyhow::{Context as _, bail};
use policy_agent::{cluster::ClusterState, source};
use policy_testbed::{
    KubeProxies, Matrix, NetNs, SERVICE_CIDR_V4, SERVICE_CIDR_V6, Servers, SimCluster,
    cleanup_prefix, kube_proxy::ProxyMode, pods_from_manifests,
};

use super::services;

const PREFIX: &str = "pademo";
/// Each node's agent pins under `<PIN_ROOT>-<node>`.
const PIN_ROOT: &str = "/sys/fs/bpf/policy-agent-demo";
/// The node names [`SimCluster`] gives its two nodes.
const NODES: [&str; 2] = ["node-1", "node-2"];

fn pin_dir(node: &str) -> String {
    format!("{PIN_ROOT}-{node}")
}

/// The node namespace [`SimCluster`] creates for `node` ("node-1" →
/// "pademo-node1").
fn node_netns(node: &str) -> String {
    format!("{PREFIX}-{}", node.replace('-', ""))
}

/// The agent each node runs: `--agent`, else `policy-agent` beside this
/// binary (set once, by [`run`]).
static AGENT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn exe() -> anyhow::Result<PathBuf> {
    AGENT
        .get()
        .cloned()
        .context("the agent binary is not chosen yet")
}

fn choose_agent(explicit: Option<PathBuf>) -> anyhow::Result<()> {
    let agent = match explicit {
        Some(path) => path,
        None => std::env::current_exe()
            .context("locating policy-demo")?
            .with_file_name("policy-agent"),
    };
    if !agent.is_file() {
        bail!(
            "{} is missing: build it with `cargo build --release -p policy-agent` (`cargo xtask demo` does), or pass --agent",
            agent.display()
        );
    }
    let _ = AGENT.set(agent);
    Ok(())
}

/// `policy-agent <args> --pin-dir <node's>` in `node`'s namespace.
fn agent(netns: &NetNs, node: &str, args: &[&str]) -> anyhow::Result<bool> {
    let pins = pin_dir(node);
    let mut cmd: Command = netns.command(exe()?);
    cmd.args(args).args(["--pin-dir", &pins]);
    println!(
        "$ nsenter --net=/run/netns/{} policy-agent {} --pin-dir {pins}",
        netns.name,
        args.join(" ")
    );
    let status = cmd.status().context("running policy-agent")?;
    Ok(status.success())
}

/// Removes what a demo left: each node's enforcement (reset inside the
/// node's namespace while it exists, so attachments and iptables state go
/// too; the pins in any case), the namespaces (kube-proxy's rules live in
/// them), and the pins of the single-node demo of earlier versions.
fn cleanup() {
    let Ok(exe) = exe() else {
        cleanup_prefix(PREFIX);
        return;
    };
    for node in NODES {
        let pins = pin_dir(node);
        let netns = format!("/run/netns/{}", node_netns(node));
        if Path::new(&netns).exists() {
            let _ = Command::new("nsenter")
                .arg(format!("--net={netns}"))
                .arg(&exe)
                .args(["reset", "--pin-dir", &pins])
                .output();
        }
        let _ = Command::new(&exe)
            .args(["reset", "--pin-dir", &pins])
            .output();
    }
    let _ = Command::new(&exe)
        .args(["reset", "--pin-dir", PIN_ROOT])
        .output();
    cleanup_prefix(PREFIX);
}

/// Everything the demo runs; dropped in order (servers, agents' state,
/// kube-proxy, namespaces) unless kept.
struct Demo {
    servers: Vec<Servers>,
    proxies: Option<KubeProxies>,
    cluster: Option<SimCluster>,
    keep: bool,
}

impl Drop for Demo {
    fn drop(&mut self) {
        self.servers.clear();
        if self.keep {
            // Left running in the kernel: rules, namespaces, pins.
            std::mem::forget(self.proxies.take());
            std::mem::forget(self.cluster.take());
            return;
        }
        if let Some(cluster) = &self.cluster {
            for node in &cluster.nodes {
                let _ = agent(&node.sim.node, &node.name, &["reset"]);
            }
        }
        if let Some(p) = self.proxies.take() {
            let _ = p.remove();
        }
        self.cluster = None;
        cleanup();
    }
}

impl Demo {
    fn cluster(&self) -> &SimCluster {
        // Set right after creation; only Drop takes it.
        self.cluster
            .as_ref()
            .unwrap_or_else(|| unreachable!("the demo's cluster is gone"))
    }
}

pub fn run(args: super::Args) -> anyhow::Result<ExitCode> {
    choose_agent(args.agent.clone())?;
    if args.cleanup {
        cleanup();
        println!("Cleaned up: the simulated cluster and every pin are gone.");
        return Ok(ExitCode::SUCCESS);
    }
    let mut loaded = source::manifests::load_dir(&args.manifests);
    let state: ClusterState = loaded.cluster_state("", Vec::new());
    let [pods1, pods2] = NODES.map(|n| pods_from_manifests(&state.pods, n));
    if pods1.is_empty() && pods2.is_empty() {
        bail!(
            "no pods with IPs on {} or {} in {}",
            NODES[0],
            NODES[1],
            args.manifests.display()
        );
    }
    cleanup();
    println!(
        "Creating a simulated cluster: {} pod(s) on node-1, {} on node-2, in network namespaces {PREFIX}-*",
        pods1.len(),
        pods2.len()
    );
    let mut demo = Demo {
        servers: Vec::new(),
        proxies: None,
        cluster: Some(
            SimCluster::create(PREFIX, &pods1, &pods2).context("creating the simulated cluster")?,
        ),
        keep: false,
    };
    println!(
        "Starting kube-proxy (iptables mode, a stand-in) on both nodes for {} Service(s)",
        state.services.len()
    );
    demo.proxies = Some(
        demo.cluster()
            .kube_proxies(ProxyMode::Iptables, &state)
            .context("installing kube-proxy's rules")?,
    );
    let servers = demo
        .cluster()
        .nodes
        .iter()
        .map(|node| Servers::start(&node.sim).context("starting the pods' servers"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    demo.servers = servers;
    let timeout = Duration::from_millis(400);
    let cluster = demo.cluster();
    let servers: Vec<&Servers> = demo.servers.iter().collect();

    let before = cluster.probe_matrix(timeout, true).context("probing")?;
    println!(
        "\nBefore: no policy enforced (each cell: IPv4 IPv6; ✓ round trip, ✗ dropped, R refused)\n{before}"
    );
    let through_before =
        services::probe(cluster, &state, &servers, timeout).context("probing the Services")?;
    services::print(cluster, "Through the Services, before", &through_before);

    let manifests = args
        .manifests
        .canonicalize()
        .unwrap_or(args.manifests.clone());
    let manifests = manifests.to_string_lossy().into_owned();
    println!();
    let mut applied = true;
    for node in &cluster.nodes {
        applied &= agent(
            &node.sim.node,
            &node.name,
            &[
                "apply",
                "--manifests",
                &manifests,
                "--node",
                &node.name,
                "--service-cidr",
                SERVICE_CIDR_V4,
                "--service-cidr",
                SERVICE_CIDR_V6,
            ],
        )?;
    }

    let after = cluster.probe_matrix(timeout, true).context("probing")?;
    println!(
        "\nAfter: the policies in {} enforced, each node's agent judging its own pods\n{after}",
        args.manifests.display()
    );
    let changes = before.changes(&after);
    println!(
        "{} of {} probes changed (IPv4 shown; the node of each pod in brackets):",
        changes.len(),
        before.cells.len()
    );
    // A node row is "(node-1)".
    let node_of = |pod: &str| {
        cluster.pod(pod).map_or_else(
            || pod.trim_matches(|c| c == '(' || c == ')').to_owned(),
            |(n, _)| n.name.clone(),
        )
    };
    for (from, target, _, was, now) in changes.iter().filter(|c| !c.2) {
        let cross = if node_of(from) != node_of(&target.pod) {
            "  cross-node"
        } else {
            ""
        };
        println!(
            "  {from:>16} [{}] -> {target:<28} [{}] {was:?} -> {now:?}{cross}",
            node_of(from),
            node_of(&target.pod)
        );
    }
    report_family_mismatches(&after);
    let through_after =
        services::probe(cluster, &state, &servers, timeout).context("probing the Services")?;
    services::print(cluster, "Through the Services, after", &through_after);

    drop(servers);
    if args.keep {
        demo.keep = true;
        println!(
            "\nKept: namespaces {PREFIX}-*, kube-proxy's rules in them, pins under {PIN_ROOT}-node-1 and -node-2. Try `nsenter --net=/run/netns/{PREFIX}-node1 policy-agent dump --pin-dir {PIN_ROOT}-node-1`; remove with `policy-demo --cleanup`."
        );
    } else {
        drop(demo);
        println!("\nCleaned up: the simulated cluster, kube-proxy's rules and every pin are gone.");
    }
    Ok(if applied {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn report_family_mismatches(m: &Matrix) {
    let mismatches = m.family_mismatches();
    if mismatches.is_empty() {
        println!("IPv4 and IPv6 agree on every probe.");
    } else {
        for (from, target) in mismatches {
            println!("IPv4 and IPv6 differ: {from} -> {target}");
        }
    }
}
