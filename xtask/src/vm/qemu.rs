//! The QEMU command line: kernel, initramfs, the 9p shares and the
//! kernel arguments `scripts/vm/init` reads.
use std::{
    fs,
    os::unix::process::CommandExt as _,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use super::{Accel, Kernel, VmSpec};

/// 9p message size: 512000 is the most 6.1's virtio transport takes.
const MSIZE: u32 = 512_000;

/// QEMU for `spec`, its console and its own output going into `io`; the
/// list of writable shares is written there for the guest.
pub(super) fn command(
    spec: &VmSpec,
    kernel: &Kernel,
    initramfs: &Path,
    accel: Accel,
    io: &Path,
) -> anyhow::Result<Command> {
    // 9p cache mode of the root: "loose" (the default) caches pages and
    // metadata, right for a root that does not change while the VM runs.
    let cache = std::env::var("POLICY_AGENT_VM_9P_CACHE").unwrap_or_else(|_| "loose".into());

    let mut append = format!(
        "console=ttyS0 quiet loglevel=3 panic=-1 pavm_io={} pavm_kernel={} \
         pavm_msize={MSIZE} pavm_cache={cache}",
        io.display(),
        kernel.dir.display()
    );
    // Extra kernel arguments, for experiments (e.g. mitigations=off).
    if let Ok(extra) = std::env::var("POLICY_AGENT_VM_APPEND") {
        append.push(' ');
        append.push_str(&extra);
    }
    let mut qemu = Command::new("qemu-system-x86_64");
    match accel {
        Accel::Kvm => qemu.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => qemu.args(["-accel", "tcg,thread=multi", "-cpu", "max"]),
    };
    qemu.args(["-m", &spec.memory_mib.to_string()])
        .args(["-smp", &spec.cpus.to_string()])
        .args(["-nodefaults", "-no-user-config", "-no-reboot"])
        .args(["-display", "none", "-vga", "none", "-monitor", "none"])
        .args(["-nic", "none"])
        .arg("-serial")
        .arg(format!("file:{}", io.join("console.log").display()))
        .arg("-kernel")
        .arg(kernel.image())
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg(append);
    let mut share = |tag: &str, path: &Path, readonly: bool| {
        qemu.arg("-virtfs").arg(format!(
            "local,path={},mount_tag={tag},security_model=none,multidevs=remap{}",
            path.display(),
            if readonly { ",readonly=on" } else { "" }
        ));
    };
    share("root", Path::new("/"), true);
    share("io", io, false);
    let mut writable = String::new();
    for (i, w) in spec.writable.iter().enumerate() {
        let w = fs::canonicalize(w).with_context(|| format!("writable {}", w.display()))?;
        let text = w.to_string_lossy();
        if text.contains(['\n', ',']) || text.contains(char::is_whitespace) {
            bail!("{text}: writable paths must be plain");
        }
        let tag = format!("w{i}");
        share(&tag, &w, false);
        writable.push_str(&format!("{tag} {text}\n"));
    }
    if !writable.is_empty() {
        fs::write(io.join("writable"), writable)?;
    }
    let qemu_log = fs::File::create(io.join("qemu.log"))?;
    qemu.stdin(Stdio::null())
        .stdout(qemu_log.try_clone()?)
        .stderr(qemu_log);
    // SAFETY: prctl is async-signal-safe; it only sets a flag of the child.
    // The VM dies with us even when we are killed and no guard runs (the
    // flag follows the spawning thread: call `run` from one that outlives
    // the VM).
    unsafe {
        qemu.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(qemu)
}
