//! Project tasks: `cargo xtask <task>`.
//!
//! Every task that needs tools runs `setup` first, so each works on a fresh
//! machine with one command.
mod bench;
mod kind;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "policy-agent project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what this machine lacks (apt packages, nightly rust-src,
    /// bpf-linker with LLVM 22). Idempotent; a second run takes seconds.
    Setup,
    /// Build the agent (with the embedded eBPF object), release profile.
    Build,
    /// Set up, check formatting and lints, and run every test, the root
    /// kernel tests included.
    Test {
        /// Skip `cargo fmt --check` and clippy.
        #[arg(long)]
        no_lint: bool,
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up, build, and enforce the example manifests on a simulated node,
    /// printing the connectivity matrix before and after.
    Demo {
        #[arg(long, default_value = "examples")]
        manifests: PathBuf,
        #[arg(long, default_value = "node-1")]
        node: String,
    },
    /// Run every benchmark (root) and write docs/BENCHMARKS.md and
    /// docs/benchmarks.json.
    Bench,
    /// Create a kind cluster (docker, kind and kubectl needed), deploy the
    /// agent as a DaemonSet and run a smoke check.
    Run {
        /// Print every command instead of running it.
        #[arg(long)]
        dry_run: bool,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn setup() -> anyhow::Result<()> {
    run(Command::new("bash").arg(root().join("scripts/setup.sh")))
}

fn require_root(what: &str) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} needs root (BPF, network namespaces): run it with sudo");
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup(),
        Task::Build => {
            setup()?;
            run(cargo().args(["build", "--release", "-p", "policy-agent"]))
        }
        Task::Test { no_lint, args } => {
            // The suite CI runs is always the whole suite: switches that
            // rewrite golden files or replay one seed are for `cargo test`.
            for switch in ["UPDATE_GOLDEN", "DIFF_SEED"] {
                if std::env::var_os(switch).is_some() {
                    bail!(
                        "{switch} is set: it rewrites or narrows what the tests check; unset it (use plain `cargo test` for that)"
                    );
                }
            }
            setup()?;
            require_root("the kernel tests")?;
            if !no_lint {
                run(cargo().args(["fmt", "--all", "--", "--check"]))?;
                run(cargo().args([
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ]))?;
            }
            run(cargo().args(["test", "--workspace", "--"]).args(&args))
        }
        Task::Run { dry_run } => kind::run(&root(), dry_run),
        Task::Bench => {
            setup()?;
            require_root("the benchmarks")?;
            bench::run(&root())
        }
        Task::Demo { manifests, node } => {
            setup()?;
            require_root("the demo")?;
            run(cargo().args([
                "build",
                "--release",
                "-p",
                "policy-agent",
                "--features",
                "sim",
            ]))?;
            let agent = root().join("target/release/policy-agent");
            run(Command::new(agent)
                .current_dir(root())
                .arg("demo")
                .arg("--manifests")
                .arg(manifests)
                .arg("--node")
                .arg(node))
        }
    }
}
