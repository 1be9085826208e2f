//! The per-run I/O directory the guest writes back into, and reading it.
use std::{
    fs,
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
    process::Child,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;

/// The per-run I/O directory and the VM; dropping it kills the VM and
/// removes the directory (also when unwinding from a panic).
pub(super) struct Run {
    pub io: PathBuf,
    pub child: Option<Child>,
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

/// Streams what a guest file gained since the last call, line by line,
/// each line behind `label` when there is one (guests side by side).
pub(super) struct Tail {
    pub path: PathBuf,
    pub pos: u64,
    pub stderr: bool,
    pub label: Option<String>,
    /// The start of a line not ended yet.
    pub partial: Vec<u8>,
}

impl Tail {
    pub fn pump(&mut self) {
        let Ok(mut f) = fs::File::open(&self.path) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        if let Ok(n) = f.read_to_end(&mut buf) {
            self.pos += n as u64;
            self.partial.extend_from_slice(&buf);
            self.emit(false);
        }
    }

    /// Writes the complete lines gathered (and the rest with `all`).
    pub fn emit(&mut self, all: bool) {
        let end = if all {
            self.partial.len()
        } else {
            match self.partial.iter().rposition(|b| *b == b'\n') {
                Some(i) => i + 1,
                None => return,
            }
        };
        if end == 0 {
            return;
        }
        let chunk: Vec<u8> = self.partial.drain(..end).collect();
        let mut out = Vec::with_capacity(chunk.len());
        for l in chunk.split_inclusive(|b| *b == b'\n') {
            if let Some(label) = &self.label {
                out.extend_from_slice(format!("[{label}] ").as_bytes());
            }
            out.extend_from_slice(l);
        }
        let _ = if self.stderr {
            std::io::stderr().write_all(&out)
        } else {
            std::io::stdout().write_all(&out)
        };
    }
}

pub(super) fn read_lossy(p: &Path) -> String {
    fs::read(p)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

pub(super) fn tail_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A fresh I/O directory (mode 0700) under `$TMPDIR`, after removing those
/// of killed runs.
pub(super) fn create_io_dir() -> anyhow::Result<Run> {
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
    Ok(Run { io, child: None })
}
