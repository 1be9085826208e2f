//! How the control-plane bench reads time and memory: the agent's sync
//! log, percentiles, and the agent's memory from /proc and its cgroup.
use std::{
    path::{Path, PathBuf},
    process::Child,
    time::{Duration, Instant, SystemTime},
};

use policy_testbed::fixtures::flow_reader::parse_rfc3339;

/// The agent's log level: the lines the sync log reads, warnings else.
pub const AGENT_LOG: &str = "warn,policy_agent::worker::reconcile=info,policy_agent::source::manifests::watch=info,policy_agent::source::kube=debug";

/// Where the log of the agent started for `phase` goes: in
/// BENCH_AGENT_LOG_DIR when set (kept), else beside the manifests. Its
/// sync lines say when each change's last write landed.
pub fn agent_log_path(dir: &Path, phase: &str) -> PathBuf {
    let name = format!("agent-{phase}.log");
    std::env::var_os("BENCH_AGENT_LOG_DIR").map_or_else(
        || dir.with_extension(&name),
        |keep| PathBuf::from(keep).join(&name),
    )
}

/// The agent's log, read as it grows: when a source read a change and
/// sent it to the worker, and when each sync's reconcile began and ended.
pub struct SyncLog {
    path: PathBuf,
    offset: usize,
    /// Each update a source sent: (when its read began, when it was sent;
    /// the line is logged right before). The manifest watcher's read
    /// begins `read_us` before; the API watch's publication reads nothing
    /// more.
    reads: Vec<(SystemTime, SystemTime)>,
    /// Each sync: (its reconcile's start, after which it takes nothing
    /// more; its end).
    syncs: Vec<(SystemTime, SystemTime)>,
}

/// Where one change's time went.
#[derive(Clone, Copy)]
pub struct Carried {
    /// From the change to the end of the sync that carried it.
    pub total: Duration,
    /// The source's read of it (the directory re-read; zero for the API
    /// watch, which logs no read time).
    pub read: Duration,
    /// The reconcile that carried it: compile and writes.
    pub reconcile: Duration,
}

/// A `key=<micros>` field of a log line.
fn micros(line: &str, key: &str) -> Option<Duration> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .map(Duration::from_micros)
}

impl SyncLog {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            reads: Vec::new(),
            syncs: Vec::new(),
        }
    }

    /// Reads the lines written since the last call (whole lines only).
    fn poll(&mut self) {
        let Ok(text) = std::fs::read(&self.path) else {
            return;
        };
        let Some(new) = text.get(self.offset..) else {
            return;
        };
        let Some(upto) = new.iter().rposition(|b| *b == b'\n').map(|i| i + 1) else {
            return;
        };
        self.offset += upto;
        for line in String::from_utf8_lossy(&new[..upto]).lines() {
            let Some(t) = line.split_whitespace().next().and_then(parse_rfc3339) else {
                continue;
            };
            if line.contains("manifests changed") {
                let took = micros(line, "read_us").unwrap_or_default();
                self.reads.push((t - took, t));
            } else if line.contains("cluster changes published") {
                self.reads.push((t, t));
            } else if line.contains(" synced ") {
                let took = micros(line, "reconcile_us").expect("a sync line says reconcile_us");
                self.syncs.push((t - took, t));
            }
        }
    }

    /// The sync that carried a change made at `t0`: the first update a
    /// source began to read at or after `t0` (a read that began earlier
    /// may have missed it: counting from the next one never flatters),
    /// then the first sync whose reconcile began after that update was
    /// sent.
    ///
    /// With `late`, a read that began before `t0` and ended after it counts
    /// when none began later: the later reads found nothing new, so that
    /// one carried the change.
    fn carried(&self, t0: SystemTime, late: bool) -> Option<Carried> {
        let (read_start, sent) =
            *self
                .reads
                .iter()
                .find(|(start, _)| *start >= t0)
                .or_else(|| {
                    late.then(|| self.reads.iter().find(|(_, sent)| *sent >= t0))
                        .flatten()
                })?;
        let (reconcile_start, end) = *self.syncs.iter().find(|(start, _)| *start >= sent)?;
        Some(Carried {
            total: end.duration_since(t0).unwrap_or_default(),
            read: sent.duration_since(read_start).unwrap_or_default(),
            reconcile: end.duration_since(reconcile_start).unwrap_or_default(),
        })
    }

    /// Waits (30 s at most) for the sync that carried a change made at
    /// `t0`.
    pub fn wait_end(&mut self, t0: SystemTime) -> Carried {
        let start = Instant::now();
        loop {
            self.poll();
            let late = start.elapsed() > Duration::from_secs(3);
            if let Some(carried) = self.carried(t0, late) {
                return carried;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no sync carried the change of {t0:?} in {}",
                self.path.display()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The nearest-rank percentile of sorted samples; refuses a percentile
/// the samples cannot tell apart from the maximum (fewer than two samples
/// above it).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let above = (sorted.len() as f64 * (1.0 - p)).floor();
    assert!(
        above >= 2.0,
        "{} samples cannot give a p{}: it would be the maximum",
        sorted.len(),
        p * 100.0
    );
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

pub fn wait_until(what: &str, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: not within 30 s"
        );
        std::thread::sleep(Duration::from_micros(500));
    }
    start.elapsed()
}

pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `/proc/<pid>/status` figure in KiB (VmHWM: the peak RSS; VmRSS).
pub fn proc_status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// A memory cgroup of the agent's own: what the kernel charges to it,
/// BPF maps included (they are charged to the cgroup of the process that
/// made them). cgroup v2 where it is mounted, else v1's memory controller
/// under this process's own group.
pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// A fresh group named `name` (None where neither hierarchy lets this
    /// process make one: the figures are then left out, not guessed).
    pub fn create(name: &str) -> Option<Self> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let (base, rel, v2) = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
            ("/sys/fs/cgroup", rel.to_owned(), true)
        } else {
            let rel = own
                .lines()
                .find_map(|l| l.split_once(":memory:").map(|(_, r)| r))?;
            ("/sys/fs/cgroup/memory", rel.to_owned(), false)
        };
        let dir = Path::new(base).join(rel.trim_start_matches('/')).join(name);
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).ok()?;
        let this = Self { dir, v2 };
        this.read(if v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        })?;
        Some(this)
    }

    /// The `cgroup.procs` file a child writes "0" to, to join.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn read(&self, file: &str) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Bytes charged now.
    pub fn current(&self) -> Option<u64> {
        self.read(if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        })
    }

    /// The most bytes ever charged.
    pub fn peak(&self) -> Option<u64> {
        self.read(if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        })
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Empty once its processes have exited; a few tries while the
        // last one is reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// What the verifier processed for each pinned program in `dir` (the
/// kernel's `verified_insns`, since 5.16): (name, instructions).
pub fn verified_instructions(dir: &Path) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let info = aya::programs::ProgramInfo::from_pin(entry.path()).ok()?;
            Some((
                entry.file_name().to_string_lossy().into_owned(),
                u64::from(info.verified_instruction_count()?),
            ))
        })
        .collect();
    out.sort();
    out
}
