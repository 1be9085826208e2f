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
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    os::unix::{
        fs::{DirBuilderExt as _, PermissionsExt as _},
        process::CommandExt as _,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};

/// Where `scripts/setup.sh` unpacks the kernel (`current` → `<release>/`).
const DEFAULT_CACHE: &str = "/var/cache/policy-agent/vm";
/// The initramfs's /init.
const INIT: &str = include_str!("../../scripts/vm/init");
/// Run as PID 1 on the host's root.
const STAGE2: &str = include_str!("../../scripts/vm/stage2");
/// Statically linked (package busybox-static).
const BUSYBOX: &str = "/bin/busybox";
/// What mounting the root needs, with their dependencies (from
/// modules.dep); built-in ones are skipped.
const ROOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];
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
];
/// 9p message size: 512000 is the most 6.1's virtio transport takes.
const MSIZE: u32 = 512_000;

/// What to run in the guest.
#[derive(Clone, Debug)]
pub struct VmSpec {
    /// Program and arguments (PATH is searched in the guest).
    pub command: Vec<String>,
    /// Added to a clean environment (PATH, HOME=/root, LANG=C.UTF-8).
    pub env: Vec<(String, String)>,
    /// Working directory in the guest (a host path); default: ours.
    pub cwd: Option<PathBuf>,
    /// The VM is killed after this long (boot included).
    pub timeout: Duration,
    /// Host directories the guest may write to (the rest of the host's root
    /// is read-only there), at the same paths.
    pub writable: Vec<PathBuf>,
    /// Copy the command's stdout and stderr to ours as they come.
    pub stream: bool,
    pub memory_mib: u32,
    pub cpus: u32,
}

impl VmSpec {
    pub fn new(command: Vec<String>) -> Self {
        Self {
            command,
            env: Vec::new(),
            cwd: None,
            timeout: Duration::from_secs(600),
            writable: Vec::new(),
            stream: false,
            memory_mib: 2048,
            cpus: 2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

/// What the guest did.
#[derive(Clone, Debug)]
pub struct VmOutput {
    /// The command's exit status (128 + N for signal N).
    pub status: i32,
    // Read by callers that capture (`cargo xtask vm` streams instead).
    #[allow(dead_code)]
    pub stdout: String,
    #[allow(dead_code)]
    pub stderr: String,
    /// `uname -r` in the guest.
    pub kernel_release: String,
    pub accel: Accel,
    /// QEMU started → the command started (modules loaded).
    pub boot_seconds: f64,
    /// The command started → QEMU exited.
    pub run_seconds: f64,
    /// [`MODULES`] the guest kernel has neither built in nor as a module.
    pub missing_modules: Vec<String>,
    /// The guest's kernel log (`dmesg`) after the command.
    pub kernel_log: String,
}

impl VmOutput {
    /// Kernel log lines that tell of a kernel bug or warning.
    pub fn kernel_trouble(&self) -> Vec<&str> {
        self.kernel_log
            .lines()
            .filter(|l| {
                [
                    "BUG:",
                    "WARNING:",
                    "Oops",
                    "Call Trace",
                    "general protection",
                ]
                .iter()
                .any(|w| l.contains(w))
            })
            .collect()
    }
}

/// The unpacked kernel: `<dir>/boot/vmlinuz-<release>` and
/// `<dir>/lib/modules/<release>/`.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub dir: PathBuf,
    pub release: String,
}

impl Kernel {
    /// The kernel `scripts/setup.sh` fetched (`POLICY_AGENT_VM_CACHE`
    /// overrides the cache directory).
    pub fn cached() -> anyhow::Result<Self> {
        let cache = std::env::var_os("POLICY_AGENT_VM_CACHE")
            .map_or_else(|| DEFAULT_CACHE.into(), PathBuf::from);
        let current = cache.join("current");
        let dir = fs::canonicalize(&current).with_context(|| {
            format!(
                "no test VM kernel at {} (run `cargo xtask setup`)",
                current.display()
            )
        })?;
        let release = dir
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned)
            .with_context(|| format!("kernel directory {}", dir.display()))?;
        // The guest reaches it through the host's root, where these are
        // its own tmpfs.
        if ["/tmp", "/run", "/var/tmp"]
            .iter()
            .any(|t| dir.starts_with(t))
        {
            bail!(
                "{}: the VM kernel cache must not be under /tmp, /run or /var/tmp",
                dir.display()
            );
        }
        let kernel = Self { dir, release };
        for p in [kernel.vmlinuz(), kernel.modules().join("modules.dep")] {
            if !p.is_file() {
                bail!("{} missing (run `cargo xtask setup`)", p.display());
            }
        }
        Ok(kernel)
    }

    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join(format!("boot/vmlinuz-{}", self.release))
    }

    /// What QEMU boots: the uncompressed ELF (PVH entry, no decompression)
    /// when setup unpacked it, else the bzImage.
    pub fn image(&self) -> PathBuf {
        let elf = self.dir.join(format!("boot/vmlinux-{}", self.release));
        if elf.is_file() { elf } else { self.vmlinuz() }
    }

    /// `lib/modules/<release>`.
    pub fn modules(&self) -> PathBuf {
        self.dir.join("lib/modules").join(&self.release)
    }
}

/// KVM if the CPU has hardware virtualization and /dev/kvm is there, else
/// TCG; `POLICY_AGENT_VM_ACCEL` overrides.
pub fn accel() -> Accel {
    match std::env::var("POLICY_AGENT_VM_ACCEL").as_deref() {
        Ok("kvm") => return Accel::Kvm,
        Ok("tcg") => return Accel::Tcg,
        _ => {}
    }
    let hw = fs::read_to_string("/proc/cpuinfo").is_ok_and(|s| {
        s.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    });
    if hw && Path::new("/dev/kvm").exists() {
        Accel::Kvm
    } else {
        Accel::Tcg
    }
}

/// The modules `roots` need, dependencies first, as paths relative to the
/// modules directory; built-in ones are left out.
fn module_closure(modules: &Path, roots: &[&str]) -> anyhow::Result<Vec<String>> {
    let dep = fs::read_to_string(modules.join("modules.dep"))
        .with_context(|| format!("reading {}/modules.dep", modules.display()))?;
    let builtin = fs::read_to_string(modules.join("modules.builtin")).unwrap_or_default();
    let name = |path: &str| -> String {
        let file = path.rsplit('/').next().unwrap_or(path);
        let stem = file.split(".ko").next().unwrap_or(file);
        stem.replace('-', "_")
    };
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in dep.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        let needs = rest.split_whitespace().map(&name).collect();
        deps.insert(name(path), (path.to_owned(), needs));
    }
    let builtin: BTreeSet<String> = builtin.lines().map(&name).collect();

    fn visit(
        m: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) {
        if !seen.insert(m.to_owned()) {
            return;
        }
        if let Some((path, needs)) = deps.get(m) {
            for n in needs {
                visit(n, deps, seen, out);
            }
            out.push(path.clone());
        }
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for root in roots {
        let root = root.replace('-', "_");
        if !deps.contains_key(&root) && !builtin.contains(&root) {
            bail!("module {root} is neither in modules.dep nor built in");
        }
        visit(&root, &deps, &mut seen, &mut out);
    }
    Ok(out)
}

/// A newc cpio archive, written in memory.
#[derive(Default)]
struct Cpio {
    data: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), body: &[u8]) {
        self.ino += 1;
        let namesize = name.len() + 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            body.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            namesize,
            0
        );
        self.data.extend_from_slice(header.as_bytes());
        self.data.extend_from_slice(name.as_bytes());
        self.data.push(0);
        self.pad();
        self.data.extend_from_slice(body);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.data.len().is_multiple_of(4) {
            self.data.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, mode: u32, body: &[u8]) {
        self.entry(name, 0o100_000 | mode, (0, 0), body);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.data
    }
}

fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

/// The initramfs for `kernel`, built once per content of its inputs (init,
/// busybox, modules) and cached next to the kernel.
pub fn initramfs(kernel: &Kernel) -> anyhow::Result<PathBuf> {
    let modules = module_closure(&kernel.modules(), ROOT_MODULES)?;
    let busybox =
        fs::read(BUSYBOX).with_context(|| format!("reading {BUSYBOX} (package busybox-static)"))?;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut order = String::new();
    for m in &modules {
        let base = m.rsplit('/').next().unwrap_or(m).to_owned();
        if !base.ends_with(".ko") {
            bail!("{m}: compressed modules are not supported by the initramfs");
        }
        let body =
            fs::read(kernel.modules().join(m)).with_context(|| format!("reading module {m}"))?;
        order.push_str(&base);
        order.push('\n');
        files.push((format!("modules/{base}"), body));
    }

    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for part in [INIT.as_bytes(), &busybox, order.as_bytes()] {
        fnv1a(&mut hash, part);
    }
    for (_, body) in &files {
        fnv1a(&mut hash, body);
    }
    let path = kernel.dir.join(format!("initramfs-{hash:016x}.cpio"));
    if path.is_file() {
        return Ok(path);
    }

    let mut cpio = Cpio::default();
    for d in ["bin", "dev", "proc", "sys", "newroot", "modules"] {
        cpio.dir(d);
    }
    // The kernel opens it for init's stdin, stdout and stderr.
    cpio.entry("dev/console", 0o020_600, (5, 1), &[]);
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("bin/busybox", 0o755, &busybox);
    cpio.file("modules/order", 0o644, order.as_bytes());
    for (name, body) in &files {
        cpio.file(name, 0o644, body);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, cpio.finish()).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    // Older ones are for other inputs.
    if let Ok(dir) = fs::read_dir(&kernel.dir) {
        for e in dir.flatten() {
            let n = e.file_name();
            let n = n.to_string_lossy();
            if n.starts_with("initramfs-") && e.path() != path {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    Ok(path)
}

/// Single-quoted for sh.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The per-run I/O directory and the VM; dropping it kills the VM and
/// removes the directory (also when unwinding from a panic).
struct Run {
    io: PathBuf,
    child: Option<Child>,
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::env::var_os("POLICY_AGENT_VM_KEEP").is_some() {
            eprintln!("vm: kept {}", self.io.display());
        } else {
            let _ = fs::remove_dir_all(&self.io);
        }
    }
}

/// I/O directories are `$TMPDIR/<IO_PREFIX><pid>.<nanos>`.
const IO_PREFIX: &str = "policy-agent-vm.";

/// Removes the I/O directories of runs whose process is gone (killed
/// before its guard could clean up).
fn remove_stale_io_dirs() {
    let Ok(dir) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(IO_PREFIX))
            .and_then(|n| n.split('.').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// Streams what a guest file gained since the last call.
struct Tail {
    path: PathBuf,
    pos: u64,
    stderr: bool,
}

impl Tail {
    fn pump(&mut self) {
        let Ok(mut f) = fs::File::open(&self.path) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        if let Ok(n) = f.read_to_end(&mut buf) {
            self.pos += n as u64;
            if n > 0 {
                let _ = if self.stderr {
                    std::io::stderr().write_all(&buf)
                } else {
                    std::io::stdout().write_all(&buf)
                };
            }
        }
    }
}

fn read_lossy(p: &Path) -> String {
    fs::read(p)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn tail_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Boots the guest, runs `spec.command` in it and returns what it did.
/// Errors if the guest could not run the command or the timeout passed
/// (the VM is killed); a failing command is an `Ok` with its status.
pub fn run(spec: &VmSpec) -> anyhow::Result<VmOutput> {
    if spec.command.is_empty() {
        bail!("no command to run in the VM");
    }
    let kernel = Kernel::cached()?;
    let initramfs = initramfs(&kernel)?;
    let accel = accel();

    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    remove_stale_io_dirs();
    let io = std::env::temp_dir().join(format!("{IO_PREFIX}{}.{nanos:x}", std::process::id()));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&io)
        .with_context(|| format!("creating {}", io.display()))?;
    let mut guard = Run {
        io: io.clone(),
        child: None,
    };
    for p in [&io, &kernel.dir] {
        if p.to_str().is_none_or(|s| s.contains(char::is_whitespace)) {
            bail!(
                "{}: the path must be plain (it goes on the kernel command line)",
                p.display()
            );
        }
    }
    // 9p cache mode of the root: "loose" (the default) caches pages and
    // metadata, right for a root that does not change while the VM runs.
    let cache = std::env::var("POLICY_AGENT_VM_9P_CACHE").unwrap_or_else(|_| "loose".into());

    let cwd = match &spec.cwd {
        Some(c) => c.clone(),
        None => std::env::current_dir().context("current directory")?,
    };
    let mut script = format!(
        "cd {} || exit 125\nexec env -i --",
        quote(&cwd.to_string_lossy())
    );
    let base = [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("HOME", "/root"),
        ("USER", "root"),
        ("LANG", "C.UTF-8"),
        ("TERM", "dumb"),
    ];
    for (k, v) in base
        .iter()
        .map(|(k, v)| (*k, *v))
        .chain(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    {
        script.push(' ');
        script.push_str(&quote(&format!("{k}={v}")));
    }
    for a in &spec.command {
        script.push(' ');
        script.push_str(&quote(a));
    }
    script.push('\n');
    fs::write(io.join("command"), script)?;
    fs::write(io.join("stage2"), STAGE2)?;
    fs::set_permissions(io.join("stage2"), fs::Permissions::from_mode(0o755))?;
    fs::write(io.join("modules"), MODULES.join("\n") + "\n")?;

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
        .arg(&initramfs)
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
    share("io", &io, false);
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
        },
        Tail {
            path: io.join("stderr"),
            pos: 0,
            stderr: true,
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
            break s;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("a'b c"), r"'a'\''b c'");
    }

    #[test]
    fn closure_puts_dependencies_first_and_skips_builtins() {
        let dir = std::env::temp_dir().join(format!("xtask-vm-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("modules.dep"),
            "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko\n\
             kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko\n\
             kernel/fs/netfs/netfs.ko:\n\
             kernel/net/9p/9pnet.ko:\n",
        )
        .unwrap();
        fs::write(
            dir.join("modules.builtin"),
            "kernel/drivers/virtio/virtio_pci.ko\n",
        )
        .unwrap();
        let got = module_closure(&dir, &["virtio_pci", "9p"]).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got,
            [
                "kernel/net/9p/9pnet.ko",
                "kernel/fs/netfs/netfs.ko",
                "kernel/fs/fscache/fscache.ko",
                "kernel/fs/9p/9p.ko"
            ]
        );
    }

    #[test]
    fn cpio_entries_are_aligned() {
        let mut c = Cpio::default();
        c.file("init", 0o755, b"abc");
        let data = c.finish();
        assert!(data.len().is_multiple_of(4));
        assert!(data.starts_with(b"070701"));
    }
}
