//! `cargo xtask vm`: runs a command in a QEMU guest booted from Debian 12's
//! generic 6.1 kernel, to test on a kernel without TCX (the agent attaches
//! with netlink clsact filters there).
//!
//! The guest has no disk and no network device. Its root is the host's own
//! root filesystem, shared read-only over 9p (as virtme-ng does), so every
//! host tool and every test binary is there at the same absolute path;
//! /tmp, /run and /var/tmp are fresh tmpfs (host files under them are not
//! visible). The kernel's modules and /boot (from the package
//! `scripts/setup.sh` unpacks into the cache, never into the host's /boot)
//! are bound over /lib/modules and /boot. A per-run I/O directory on the
//! host is a second, writable share at the same path in the guest: the host
//! writes the command into it, the guest writes the command's stdout,
//! stderr, exit status and `uname -r` back. [`VmSpec::writable`] adds more
//! writable shares.
//!
//! Boot: a small initramfs (busybox and the modules 9p needs, built here and
//! cached next to the kernel) runs `scripts/vm/init`, which mounts the
//! shares and switches to the host's root, where `scripts/vm/stage2` mounts
//! bpffs, cgroup2, devpts and tracefs, loads [`MODULES`], runs the command
//! and powers off.
//!
//! Acceleration: KVM when the host CPU offers VT-x or AMD-V, otherwise TCG
//! (`POLICY_AGENT_VM_ACCEL=kvm|tcg` forces one). A /dev/kvm without either
//! flag is a paravirtual KVM (e.g. PVM inside a microVM) that runs an
//! unmodified kernel by instruction emulation, far slower than TCG.
mod initramfs;
mod io;
mod kernel;
mod qemu;
mod spec;

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
pub use initramfs::initramfs;

/// The directories the guest covers with a fresh tmpfs (`scripts/vm/init`).
const GUEST_TMPFS: [&str; 3] = ["/tmp", "/run", "/var/tmp"];

/// Whether `dir` lies under a directory the guest covers with its own
/// tmpfs, so the host's files there are not visible in the guest.
pub fn hidden_in_guest(dir: &std::path::Path) -> bool {
    let dir = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    GUEST_TMPFS.iter().any(|t| dir.starts_with(t))
}
use io::{Tail, read_lossy, tail_lines};
pub use kernel::Kernel;
pub use spec::{Accel, VmOutput, VmSpec, accel};

/// Run as PID 1 on the host's root.
const STAGE2: &str = include_str!("../../../scripts/vm/stage2");
/// Loaded in the guest before the command (the kernel would load most on
/// demand through /sbin/modprobe; loading them first keeps the first test
/// from paying for it and lists what the kernel lacks).
pub const MODULES: &[&str] = &[
    "veth",
    "dummy",
    "tun",
    "sch_ingress",
    "cls_bpf",
    "act_bpf",
    "nf_conntrack",
    "nf_conntrack_netlink",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "ip_tables",
    "ip6_tables",
    "iptable_filter",
    "ip6table_filter",
    "iptable_nat",
    "ip6table_nat",
    "iptable_mangle",
    "ip6table_mangle",
    "iptable_raw",
    "ip6table_raw",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_net",
    "ip_set_hash_ipport",
    "ip_set_hash_netport",
    "xt_set",
    "xt_mark",
    "xt_conntrack",
    "xt_comment",
    "xt_statistic",
    "xt_multiport",
    "xt_addrtype",
    "ip_vs",
    "ip_vs_rr",
    "sctp",
    "ip_gre",
    "ipip",
    "vxlan",
];

/// How long a guest may take to start the command (it boots in 10-20 s
/// under TCG here). One that has not started by then is stuck in its boot.
const BOOT_LIMIT: Duration = Duration::from_secs(120);

/// The guest never started the command: its boot hung (seen rarely under
/// TCG, qemu idle with nothing on the console). No test ran, so one more
/// boot is tried; a test's own failure or timeout is never tried again.
#[derive(Debug)]
struct BootHung(Duration);

impl std::fmt::Display for BootHung {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the guest did not start the command within {:?} (its boot hung; the VM was killed)",
            self.0
        )
    }
}

impl std::error::Error for BootHung {}

/// Boots the guest, runs `spec.command` in it and returns what it did.
/// Errors if the guest could not run the command or the timeout passed
/// (the VM is killed); a failing command is an `Ok` with its status. A
/// boot that hangs before the command starts is tried once more.
pub fn run(spec: &VmSpec) -> anyhow::Result<VmOutput> {
    match run_once(spec) {
        Err(e) if e.is::<BootHung>() => {
            let label = spec.label.as_deref().unwrap_or("vm");
            eprintln!("[{label}] {e}: booting once more");
            run_once(spec)
        }
        other => other,
    }
}

fn run_once(spec: &VmSpec) -> anyhow::Result<VmOutput> {
    if spec.command.is_empty() {
        bail!("no command to run in the VM");
    }
    let kernel = Kernel::cached()?;
    let initramfs = initramfs(&kernel)?;
    let accel = accel();
    let mut guard = io::create_io_dir()?;
    let io = guard.io.clone();
    for p in [&io, &kernel.dir] {
        if p.to_str().is_none_or(|s| s.contains(char::is_whitespace)) {
            bail!(
                "{}: the path must be plain (it goes on the kernel command line)",
                p.display()
            );
        }
    }
    let cwd = match &spec.cwd {
        Some(c) => c.clone(),
        None => std::env::current_dir().context("current directory")?,
    };
    fs::write(io.join("command"), spec::guest_script(spec, &cwd))?;
    fs::write(io.join("stage2"), STAGE2)?;
    fs::set_permissions(io.join("stage2"), fs::Permissions::from_mode(0o755))?;
    fs::write(io.join("modules"), MODULES.join("\n") + "\n")?;
    let mut qemu = qemu::command(spec, &kernel, &initramfs, accel, &io)?;

    let start = Instant::now();
    guard.child = Some(
        qemu.spawn()
            .context("spawning qemu-system-x86_64 (run `cargo xtask setup`)")?,
    );
    let mut tails = [
        Tail {
            path: io.join("stdout"),
            pos: 0,
            stderr: false,
            label: spec.label.clone(),
            partial: Vec::new(),
        },
        Tail {
            path: io.join("stderr"),
            pos: 0,
            stderr: true,
            label: spec.label.clone(),
            partial: Vec::new(),
        },
    ];
    let mut boot: Option<Duration> = None;
    let exit = loop {
        let status = match guard.child.as_mut() {
            Some(c) => c.try_wait().context("waiting for qemu")?,
            None => bail!("qemu vanished"),
        };
        if boot.is_none() && io.join("started").exists() {
            boot = Some(start.elapsed());
        }
        if spec.stream {
            tails.iter_mut().for_each(Tail::pump);
        }
        if let Some(s) = status {
            if spec.stream {
                for t in &mut tails {
                    t.pump();
                    t.emit(true);
                }
            }
            break s;
        }
        let boot_limit = BOOT_LIMIT.min(spec.timeout);
        if boot.is_none() && start.elapsed() > boot_limit {
            // Dropping the run's guard kills the VM.
            return Err(BootHung(boot_limit).into());
        }
        if start.elapsed() > spec.timeout {
            if let Some(c) = guard.child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            bail!(
                "the VM timed out after {:?} (killed); stdout:\n{}\nstderr:\n{}\nconsole:\n{}",
                spec.timeout,
                tail_lines(&read_lossy(&io.join("stdout")), 30),
                tail_lines(&read_lossy(&io.join("stderr")), 30),
                tail_lines(&read_lossy(&io.join("console.log")), 30),
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let total = start.elapsed();
    guard.child = None;

    let status = read_lossy(&io.join("status"));
    let Ok(status) = status.trim().parse::<i32>() else {
        bail!(
            "the guest did not finish the command (qemu: {exit}); qemu:\n{}\nconsole:\n{}",
            tail_lines(&read_lossy(&io.join("qemu.log")), 20),
            tail_lines(&read_lossy(&io.join("console.log")), 40),
        );
    };
    let boot = boot.unwrap_or(total);
    Ok(VmOutput {
        status,
        stdout: read_lossy(&io.join("stdout")),
        stderr: read_lossy(&io.join("stderr")),
        kernel_release: read_lossy(&io.join("kernel_release")).trim().to_owned(),
        accel,
        boot_seconds: boot.as_secs_f64(),
        run_seconds: total.saturating_sub(boot).as_secs_f64(),
        missing_modules: read_lossy(&io.join("modules-missing"))
            .lines()
            .map(str::to_owned)
            .collect(),
        kernel_log: read_lossy(&io.join("dmesg")),
    })
}
