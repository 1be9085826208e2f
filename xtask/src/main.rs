//! Project tasks: `cargo xtask <task>`.
//!
//! Every task that needs tools runs `setup` first, so each works on a fresh
//! machine with one command.
mod bench;
mod kind;
mod test;
mod vm;

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
    /// Build the agent (with the embedded eBPF object) and the CNI plugin,
    /// release profile.
    Build,
    /// Set up, check formatting and lints, run every test (the root
    /// kernel tests included), then the kernel suites again in a guest on
    /// Debian 12's 6.1 kernel, and print on which kernel each ran.
    Test(test::Options),
    /// Set up, build, and enforce the example manifests on a simulated
    /// two-node cluster (an agent per node, kube-proxy's rules for the
    /// Services), printing the connectivity before and after: the
    /// testbed's `policy-demo`.
    Demo {
        #[arg(long, default_value = "examples")]
        manifests: PathBuf,
    },
    /// Run every benchmark (root) and write docs/BENCHMARKS.md and
    /// docs/benchmarks.json.
    Bench {
        /// Run only these benchmarks (the others' last results in
        /// target/bench-results are rendered as they are).
        /// `datapath-guest` (only when named: minutes in the emulated
        /// guest) runs the datapath bench on the host and in the 6.1 guest.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Render the blocks from the results already in
        /// target/bench-results, without running anything.
        #[arg(long)]
        no_run: bool,
    },
    /// Create a kind cluster (docker, kind and kubectl needed), deploy the
    /// agent as a DaemonSet and run a smoke check.
    Run {
        /// Print every command instead of running it.
        #[arg(long)]
        dry_run: bool,
    },
    /// Run a command in a QEMU guest booted from Debian 12's 6.1 kernel
    /// (no TCX), with the host's root read-only as its root: e.g.
    /// `cargo xtask vm -- uname -r`. Exits with the command's status.
    Vm {
        /// Kill the VM after this many seconds (boot included).
        #[arg(long, default_value_t = 1800)]
        timeout: u64,
        /// NAME=VALUE added to the guest command's clean environment.
        #[arg(long = "env", value_name = "NAME=VALUE")]
        env: Vec<String>,
        /// A host directory the guest may write to (repeatable).
        #[arg(long, value_name = "DIR")]
        writable: Vec<PathBuf>,
        /// Working directory in the guest (default: the current one).
        #[arg(long)]
        cwd: Option<PathBuf>,
        /// Guest vCPUs.
        #[arg(long, default_value_t = 2)]
        cpus: u32,
        /// Guest memory, MiB.
        #[arg(long, default_value_t = 2048)]
        memory: u32,
        #[arg(last = true, required = true)]
        command: Vec<String>,
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

/// Variables `cargo run` sets for the program it runs (this xtask), which
/// a cargo we spawn must not inherit: build scripts track some of them
/// (ring's tracks `CARGO_MANIFEST_DIR`), so inheriting them made every
/// `cargo xtask build` and plain `cargo build` rebuild ring and all above
/// it from scratch, each undoing the other's cache.
fn set_by_cargo_run(name: &str) -> bool {
    const PREFIXES: [&str; 5] = [
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_BIN_",
        "CARGO_PRIMARY_PACKAGE",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_run) {
            c.env_remove(&name);
        }
    }
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
            run(cargo().args([
                "build",
                "--release",
                "-p",
                "policy-agent",
                "-p",
                "policy-cni",
            ]))
        }
        Task::Test(opts) => {
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
            test::run(&root(), &opts)
        }
        Task::Run { dry_run } => kind::run(&root(), dry_run),
        Task::Vm {
            timeout,
            env,
            writable,
            cwd,
            cpus,
            memory,
            command,
        } => {
            setup()?;
            require_root("the test VM (it shares the host's root)")?;
            let mut spec = vm::VmSpec::new(command);
            spec.timeout = std::time::Duration::from_secs(timeout);
            spec.writable = writable;
            spec.cwd = cwd;
            spec.cpus = cpus;
            spec.memory_mib = memory;
            spec.stream = true;
            for e in env {
                let (k, v) = e
                    .split_once('=')
                    .with_context(|| format!("--env {e}: expected NAME=VALUE"))?;
                spec.env.push((k.to_owned(), v.to_owned()));
            }
            let out = vm::run(&spec)?;
            eprintln!(
                "vm: kernel {} ({:?}), boot {:.1} s, command {:.1} s, exit {}{}",
                out.kernel_release,
                out.accel,
                out.boot_seconds,
                out.run_seconds,
                out.status,
                if out.missing_modules.is_empty() {
                    String::new()
                } else {
                    format!("; modules missing: {}", out.missing_modules.join(" "))
                }
            );
            for l in out.kernel_trouble() {
                eprintln!("vm: guest kernel: {l}");
            }
            std::process::exit(out.status)
        }
        Task::Bench { only, no_run } => {
            if !no_run {
                setup()?;
                require_root("the benchmarks")?;
            }
            bench::run(&root(), &only, !no_run)
        }
        Task::Demo { manifests } => {
            setup()?;
            require_root("the demo")?;
            // The demo (the testbed's binary) runs the agent beside it, as
            // built for a cluster.
            let bins = "--bin policy-agent --bin policy-demo";
            run(cargo()
                .args([
                    "build",
                    "--release",
                    "-p",
                    "policy-agent",
                    "-p",
                    "policy-testbed",
                ])
                .args(bins.split(' ')))?;
            let demo = root().join("target/release/policy-demo");
            run(Command::new(demo)
                .current_dir(root())
                .arg("--manifests")
                .arg(manifests))
        }
    }
}
