//! What to run in the guest, and what came back.
use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

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
    /// Put in front of every streamed line (guests that run side by side).
    pub label: Option<String>,
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
            label: None,
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
    /// What the command wrote (also when streamed).
    pub stdout: String,
    // Read by callers that capture (none yet).
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

/// Single-quoted for sh.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script the guest runs: `cwd`, then the command with a clean
/// environment (PATH, HOME, USER, LANG, TERM plus `spec.env`).
pub(super) fn guest_script(spec: &VmSpec, cwd: &Path) -> String {
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
    script
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("a'b c"), r"'a'\''b c'");
    }
}
