//! `cargo xtask test`: formatting and lints, every test on the host, then
//! the kernel suites again in a guest on Debian 12's 6.1 kernel (no TCX),
//! one guest per suite, after the host run (never beside it: the guest
//! would take the CPUs the host's kernel tests time against). A summary
//! names the kernel each suite ran on.
pub mod binaries;
pub mod guest;

use std::{path::Path, time::Instant};

use anyhow::{Context as _, bail};

#[derive(clap::Args)]
pub struct Options {
    /// Skip `cargo fmt --check` and clippy.
    #[arg(long)]
    pub no_lint: bool,
    /// Leave out the 6.1 guest (fast local runs; CI runs it).
    #[arg(long, conflicts_with = "vm_only")]
    pub no_vm: bool,
    /// Only the kernel suites in the 6.1 guest (no lints, no host run).
    #[arg(long)]
    pub vm_only: bool,
    /// Run only this suite in the guest (repeatable; default: all).
    #[arg(long = "vm-suite", value_name = "NAME")]
    pub vm_suites: Vec<String>,
    /// Guests run side by side (each has two vCPUs; a guest waits much
    /// of its time, so two fill this 2-core machine).
    #[arg(long, default_value_t = 2)]
    pub vm_jobs: usize,
    /// Extra arguments for the host's `cargo test` (after `--`).
    #[arg(last = true)]
    pub args: Vec<String>,
}

pub fn run(root: &Path, opts: &Options) -> anyhow::Result<()> {
    if !opts.no_lint && !opts.vm_only {
        crate::run(crate::cargo().args(["fmt", "--all", "--", "--check"]))?;
        crate::run(crate::cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))?;
    }
    // A machine without the guest kernel fails here, before the long run.
    let suites = guest::select(&opts.vm_suites)?;
    if !opts.no_vm {
        guest::prepare()?;
    }
    let binaries = binaries::build()?;
    let privileged = binaries
        .get(guest::PRIVILEGED)
        .with_context(|| format!("cargo built no test target named {}", guest::PRIVILEGED))?
        .clone();
    // The privileged tests run the agent and the plugin as a user does:
    // built here (the guest, with no toolchain, cannot build them), found
    // beside the test binary (see `testbed/src/workspace_bins.rs`).
    crate::run(crate::cargo().args(["build", "-p", "policy-agent", "-p", "policy-cni"]))?;
    let mut rows = Vec::new();
    if !opts.vm_only {
        rows.push(host(&opts.args)?);
    }
    if opts.no_vm {
        eprintln!("\n{}", guest::render(&rows));
        eprintln!("the 6.1 guest was left out (--no-vm)");
        return Ok(());
    }
    rows.extend(guest::run_all(root, &privileged, &suites, opts.vm_jobs)?);
    eprintln!("\n{}", guest::render(&rows));
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.suite.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("failed in the 6.1 guest: {}", failed.join(", "));
    }
    Ok(())
}

/// Every test of the workspace on the host's kernel.
fn host(args: &[String]) -> anyhow::Result<guest::Row> {
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    eprintln!("host kernel: {host_kernel}");
    let start = Instant::now();
    crate::run(
        crate::cargo()
            .args(["test", "--workspace", "--"])
            .args(args),
    )?;
    Ok(guest::Row {
        suite: "every test (host)".into(),
        kernel: host_kernel,
        accel: "host".into(),
        boot_seconds: None,
        run_seconds: start.elapsed().as_secs_f64(),
        result: "ok".into(),
        ok: true,
    })
}
