//! `policy-agent demo`: the example manifests enforced on a simulated node,
//! with the connectivity matrix before and after.
use std::{path::PathBuf, process::ExitCode};

#[derive(clap::Args)]
pub struct Args {
    /// Manifests: the node's pods (with spec.nodeName and status.podIPs)
    /// and the policies to enforce.
    #[arg(long, default_value = "examples")]
    pub manifests: PathBuf,
    /// The node the pods are scheduled on.
    #[arg(long, default_value = "node-1")]
    pub node: String,
    /// Keep the simulated node and the enforcement in place (remove them
    /// later with `policy-agent demo --cleanup`).
    #[arg(long)]
    pub keep: bool,
    /// Remove what an earlier `--keep` left.
    #[arg(long)]
    pub cleanup: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    #[cfg(feature = "sim")]
    return simulated::run(args);
    #[cfg(not(feature = "sim"))]
    {
        let _ = args;
        anyhow::bail!(
            "this build has no simulated node; build with `--features sim` (as `cargo xtask demo` does)"
        )
    }
}

#[cfg(feature = "sim")]
mod simulated {
    use std::{
        process::{Command, ExitCode},
        time::Duration,
    };

    use anyhow::{Context as _, bail};
    use policy_agent::{
        sim::{Matrix, Servers, SimNode, cleanup_prefix, pods_from_manifests},
        source,
    };

    const PREFIX: &str = "pademo";
    const PIN_DIR: &str = "/sys/fs/bpf/policy-agent-demo";

    fn agent(node: &SimNode, args: &[&str]) -> anyhow::Result<bool> {
        let exe = std::env::current_exe().context("locating policy-agent")?;
        let mut cmd: Command = node.node.command(&exe);
        cmd.args(args).args(["--pin-dir", PIN_DIR]);
        println!(
            "$ policy-agent {} --pin-dir {PIN_DIR}   (in the node's network namespace)",
            args.join(" ")
        );
        let status = cmd.status().context("running policy-agent")?;
        Ok(status.success())
    }

    fn cleanup() {
        if let Ok(exe) = std::env::current_exe() {
            let _ = Command::new(exe)
                .args(["reset", "--pin-dir", PIN_DIR])
                .status();
        }
        cleanup_prefix(PREFIX);
    }

    pub fn run(args: super::Args) -> anyhow::Result<ExitCode> {
        if args.cleanup {
            cleanup();
            return Ok(ExitCode::SUCCESS);
        }
        let mut loaded = source::manifests::load_dir(&args.manifests);
        let state = loaded.cluster_state(&args.node, Vec::new());
        let sim_pods = pods_from_manifests(&state.pods, &args.node);
        if sim_pods.is_empty() {
            bail!(
                "no pods with IPs on node {} in {}",
                args.node,
                args.manifests.display()
            );
        }
        cleanup();
        println!(
            "Creating a simulated node: {} pod(s) of node {} in network namespaces {PREFIX}-*",
            sim_pods.len(),
            args.node
        );
        let node = SimNode::create(PREFIX, &sim_pods).context("creating the simulated node")?;
        let servers = Servers::start(&node).context("starting the pods' servers")?;
        let timeout = Duration::from_millis(400);

        let before = node.probe_matrix(timeout, true).context("probing")?;
        println!(
            "\nBefore: no policy enforced (each cell: IPv4 IPv6; ✓ round trip, ✗ dropped, R refused)\n{before}"
        );

        let manifests = args
            .manifests
            .canonicalize()
            .unwrap_or(args.manifests.clone());
        let manifests = manifests.to_string_lossy().into_owned();
        let applied = agent(
            &node,
            &["apply", "--manifests", &manifests, "--node", &args.node],
        )?;

        let after = node.probe_matrix(timeout, true).context("probing")?;
        println!(
            "\nAfter: the policies in {} enforced\n{after}",
            args.manifests.display()
        );
        let changes = before.changes(&after);
        println!(
            "{} of {} probes changed:",
            changes.len(),
            before.cells.len()
        );
        for (from, target, v6, was, now) in changes.iter().filter(|c| !c.2) {
            println!(
                "  {from:>16} -> {target:<28} {was:?} -> {now:?}{}",
                if *v6 { " (IPv6)" } else { "" }
            );
        }
        report_family_mismatches(&after);

        drop(servers);
        if args.keep {
            println!(
                "\nKept: namespaces {PREFIX}-*, pins under {PIN_DIR}. Try `policy-agent dump --pin-dir {PIN_DIR}`; remove with `policy-agent demo --cleanup`."
            );
            std::mem::forget(node);
        } else {
            agent(&node, &["reset"])?;
            drop(node);
            cleanup_prefix(PREFIX);
            println!("\nCleaned up: the simulated node and every pin are gone.");
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
}
