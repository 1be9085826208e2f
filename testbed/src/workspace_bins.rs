//! The binaries of this workspace that the testbed runs (`policy-agent`,
//! `policy-cni`), as the user runs them.
//!
//! `CARGO_BIN_EXE_*` only names a package's own binaries, so they are
//! found at run time: `$POLICY_AGENT_BIN` / `$POLICY_CNI_BIN` when set
//! (the 6.1 guest, which has no toolchain, is handed them), else
//! `target/<profile>/` beside the running test, bench or demo binary,
//! built there with cargo once per process when cargo runs us (a no-op
//! when current).
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, OnceLock},
};

/// A binary of this workspace, by package (each has one of its name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bin {
    Agent,
    Cni,
}

impl Bin {
    pub fn name(self) -> &'static str {
        match self {
            Bin::Agent => "policy-agent",
            Bin::Cni => "policy-cni",
        }
    }

    /// The variable that names it explicitly.
    pub fn var(self) -> &'static str {
        match self {
            Bin::Agent => "POLICY_AGENT_BIN",
            Bin::Cni => "POLICY_CNI_BIN",
        }
    }
}

/// The path of `bin`, built first when needed (see the module's note).
pub fn path(bin: Bin) -> Result<PathBuf, String> {
    if let Some(explicit) = std::env::var_os(bin.var()) {
        let explicit = PathBuf::from(explicit);
        return match explicit.file_name().and_then(|n| n.to_str()) {
            Some(name) if name == bin.name() && explicit.is_file() => Ok(explicit),
            _ => Err(format!(
                "{}={} is not an existing .../{}",
                bin.var(),
                explicit.display(),
                bin.name()
            )),
        };
    }
    static BUILT: OnceLock<Mutex<BTreeMap<Bin, Result<PathBuf, String>>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    built.entry(bin).or_insert_with(|| build(bin)).clone()
}

/// The directory holding `bin` (for `CNI_PATH`).
pub fn dir(bin: Bin) -> Result<PathBuf, String> {
    let p = path(bin)?;
    p.parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("{} has no parent directory", p.display()))
}

/// `target/<profile>` above the running executable (`deps/` for tests
/// and benches).
fn profile_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding the running binary: {e}"))?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    Ok(dir)
}

fn build(bin: Bin) -> Result<PathBuf, String> {
    let profile_dir = profile_dir()?;
    let target = profile_dir.join(bin.name());
    // Only a process cargo started may run cargo: the guest and a demo
    // run by hand use what is there.
    let Some(cargo) = std::env::var_os("CARGO") else {
        return if target.is_file() {
            Ok(target)
        } else {
            Err(format!(
                "{} is missing: build it (`cargo build -p {}`) or set {}",
                target.display(),
                bin.name(),
                bin.var()
            ))
        };
    };
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("no profile directory at {}", profile_dir.display()))?
        .to_owned();
    let target_dir = profile_dir
        .parent()
        .ok_or_else(|| format!("no target directory above {}", profile_dir.display()))?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "-p", bin.name(), "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    // What cargo sets for the test it runs must not leak into this build
    // (build scripts track some of it and would rebuild).
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        if [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
        ]
        .iter()
        .any(|p| name.starts_with(p))
        {
            cmd.env_remove(&name);
        }
    }
    let out = cmd.output().map_err(|e| format!("running cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build -p {} failed: {}",
            bin.name(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    if !target.is_file() {
        return Err(format!("{} was not built", target.display()));
    }
    Ok(target)
}
