//! `policy-cni install` and `uninstall`, for the DaemonSet.
//!
//! install: copy this binary into the node's CNI bin dir, then write our
//! own list, `00-policy-agent.conflist` = the primary network (the first
//! valid file by name, as the runtimes pick it; ours never counts) with
//! this plugin appended last. `--watch` keeps both current (the primary
//! rewritten, our file or binary removed) until SIGTERM/SIGINT, then, with
//! `--uninstall-on-exit`, uninstalls. uninstall: remove our list, then the
//! binary. Both are idempotent.
pub mod conflist;
pub mod files;

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use crate::{
    plugin::client::exchange,
    protocol::{self, PROTOCOL_VERSION, Request, Response},
};

pub const DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
pub const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";
/// Sorts before the usual primaries (`05-cilium`, `10-calico`,
/// `10-kindnet`, `10-flannel`, `87-podman`...).
pub const DEFAULT_FILE: &str = "00-policy-agent.conflist";

pub const USAGE: &str = "\
usage: policy-cni install [--watch] [options]
       policy-cni uninstall [options]
Without a subcommand, policy-cni is the CNI plugin (run by the container runtime).

options:
  --conf-dir DIR          the node's CNI config dir (default /etc/cni/net.d)
  --bin-dir DIR           the node's CNI bin dir (default /opt/cni/bin)
  --file NAME             our list's file name (default 00-policy-agent.conflist)
  --source PATH           the binary to install (default: this one)
  --socket PATH           the agent's socket, as the node sees it (default /run/policy-agent/cni.sock)
  --timeout-seconds N     how long ADD waits for the agent (default 5)
  --watch                 keep the files current until SIGTERM/SIGINT
  --interval-ms N         how often --watch looks (default 1000)
  --wait-for-agent        write the list only once the agent answers STATUS
  --uninstall-on-exit     with --watch: uninstall on SIGTERM/SIGINT";

/// Everything install and uninstall need.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    pub file: String,
    pub source: Option<PathBuf>,
    pub socket: String,
    pub timeout_seconds: f64,
    pub watch: bool,
    pub interval: Duration,
    pub wait_for_agent: bool,
    pub uninstall_on_exit: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            conf_dir: DEFAULT_CONF_DIR.into(),
            bin_dir: DEFAULT_BIN_DIR.into(),
            file: DEFAULT_FILE.into(),
            source: None,
            socket: protocol::DEFAULT_SOCKET.into(),
            timeout_seconds: crate::plugin::config::DEFAULT_TIMEOUT.as_secs_f64(),
            watch: false,
            interval: Duration::from_secs(1),
            wait_for_agent: false,
            uninstall_on_exit: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no usable CNI network config in {dir}{}", skipped_list(.skipped))]
    NoPrimary {
        dir: PathBuf,
        skipped: Vec<(PathBuf, conflist::Invalid)>,
    },
    #[error("cannot chain into {path}: {reason}")]
    Unchainable {
        path: PathBuf,
        reason: conflist::Invalid,
    },
}

fn skipped_list(skipped: &[(PathBuf, conflist::Invalid)]) -> String {
    skipped
        .iter()
        .map(|(p, e)| format!("; {} skipped: {e}", p.display()))
        .collect()
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_owned();
    move |source| InstallError::Io { what, path, source }
}

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub binary_written: bool,
    pub list_written: bool,
    /// The primary our list copies.
    pub primary: Option<PathBuf>,
    /// Problems that do not stop the pass (skipped files, our file sorting
    /// after the primary).
    pub warnings: Vec<String>,
}

fn source_binary(opts: &Options) -> Result<PathBuf, InstallError> {
    match &opts.source {
        Some(p) => Ok(p.clone()),
        None => std::env::current_exe().map_err(io("finding", Path::new("/proc/self/exe"))),
    }
}

fn read_dir(dir: &Path) -> Result<Vec<(String, String)>, InstallError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io("reading", dir))? {
        let entry = entry.map_err(io("reading", dir))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if !conflist::is_config_name(&name) || !entry.path().is_file() {
            continue;
        }
        // A file removed or unreadable between listing and reading is
        // skipped like an invalid one.
        if let Ok(text) = std::fs::read_to_string(entry.path()) {
            files.push((name, text));
        }
    }
    Ok(files)
}

/// Copies the binary (when `binary`) and regenerates our list. Without a
/// usable primary our list is removed (a copy of a network that is gone
/// would be wrong) and the error says why.
pub fn install_pass(opts: &Options, binary: bool) -> Result<Pass, InstallError> {
    let mut pass = Pass::default();
    if binary {
        let source = source_binary(opts)?;
        let target = opts.bin_dir.join(conflist::PLUGIN_TYPE);
        pass.binary_written = files::install_binary(&source, &target)
            .map_err(io("installing the binary as", &target))?;
    }
    let ours = opts.conf_dir.join(&opts.file);
    let picked = conflist::pick(&opts.conf_dir, &read_dir(&opts.conf_dir)?, &opts.file);
    let primary = match picked {
        Ok(p) => p,
        Err(skipped) => {
            files::remove(&ours).map_err(io("removing", &ours))?;
            return Err(InstallError::NoPrimary {
                dir: opts.conf_dir.clone(),
                skipped,
            });
        }
    };
    for (path, why) in &primary.skipped {
        pass.warnings
            .push(format!("{} skipped: {why}", path.display()));
    }
    if primary.path.file_name().and_then(|n| n.to_str()) < Some(opts.file.as_str()) {
        pass.warnings.push(format!(
            "{} sorts before {}: the runtime loads it, not ours, and new pods are not held for the agent",
            primary.path.display(),
            opts.file
        ));
    }
    let entry = conflist::entry(&opts.socket, opts.timeout_seconds);
    let list = match conflist::chained(&primary.list, &entry) {
        Ok(l) => l,
        Err(reason) => {
            files::remove(&ours).map_err(io("removing", &ours))?;
            return Err(InstallError::Unchainable {
                path: primary.path,
                reason,
            });
        }
    };
    pass.list_written = files::write_atomic(&ours, conflist::render(&list).as_bytes(), 0o644)
        .map_err(io("writing", &ours))?;
    pass.primary = Some(primary.path);
    Ok(pass)
}

/// Removes our list first (the runtime falls back to the primary), then
/// the binary. Returns what it removed.
pub fn uninstall(opts: &Options) -> Result<Vec<PathBuf>, InstallError> {
    let mut removed = Vec::new();
    for path in [
        opts.conf_dir.join(&opts.file),
        opts.bin_dir.join(conflist::PLUGIN_TYPE),
    ] {
        if files::remove(&path).map_err(io("removing", &path))? {
            removed.push(path);
        }
    }
    Ok(removed)
}

fn log(line: &str) {
    eprintln!("policy-cni install: {line}");
}

/// Sleeps `d` in short steps; false when `stop` was set meanwhile.
fn sleep_unless(stop: &AtomicBool, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
    }
    !stop.load(Ordering::Relaxed)
}

/// Whether the agent answers STATUS with ok.
pub fn agent_ready(socket: &Path) -> bool {
    let request = Request {
        version: PROTOCOL_VERSION,
        container_id: String::new(),
        command: protocol::Command::Status,
    };
    matches!(
        exchange(socket, &request, Duration::from_secs(1), false),
        Ok(Response { ok: true, .. })
    )
}

/// install, once or (`opts.watch`) until `stop`. Returns the exit status.
pub fn run(opts: &Options, stop: &AtomicBool) -> i32 {
    if opts.wait_for_agent {
        let mut waited = 0u64;
        while !agent_ready(Path::new(&opts.socket)) {
            if waited.is_multiple_of(30) {
                log(&format!("waiting for the agent on {}", opts.socket));
            }
            waited += 1;
            if !sleep_unless(stop, Duration::from_secs(1)) {
                return 0;
            }
        }
    }
    let mut last_error = None;
    let mut last_warnings = Vec::new();
    loop {
        let status = match install_pass(opts, true) {
            Ok(pass) => {
                if pass.warnings != last_warnings {
                    pass.warnings.iter().for_each(|w| log(w));
                    last_warnings = pass.warnings.clone();
                }
                if pass.binary_written {
                    log(&format!(
                        "installed {}",
                        opts.bin_dir.join(conflist::PLUGIN_TYPE).display()
                    ));
                }
                if pass.list_written {
                    log(&format!(
                        "wrote {} from {}",
                        opts.conf_dir.join(&opts.file).display(),
                        pass.primary.as_deref().unwrap_or(Path::new("?")).display()
                    ));
                }
                last_error = None;
                0
            }
            Err(e) => {
                let text = e.to_string();
                if last_error.as_ref() != Some(&text) {
                    log(&text);
                    last_error = Some(text);
                }
                1
            }
        };
        if !opts.watch {
            return status;
        }
        if !sleep_unless(stop, opts.interval) {
            break;
        }
    }
    if opts.uninstall_on_exit {
        match uninstall(opts) {
            Ok(removed) => removed
                .iter()
                .for_each(|p| log(&format!("removed {}", p.display()))),
            Err(e) => {
                log(&e.to_string());
                return 1;
            }
        }
    }
    0
}

/// Parses `install ...` / `uninstall ...`.
pub fn parse_args(args: &[String]) -> Result<(bool, Options), String> {
    let mut it = args.iter();
    let install = match it.next().map(String::as_str) {
        Some("install") => true,
        Some("uninstall") => false,
        _ => return Err(USAGE.into()),
    };
    let mut opts = Options::default();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--conf-dir" => opts.conf_dir = value()?.into(),
            "--bin-dir" => opts.bin_dir = value()?.into(),
            "--file" => opts.file = value()?,
            "--source" => opts.source = Some(value()?.into()),
            "--socket" => opts.socket = value()?,
            "--timeout-seconds" => {
                let v = value()?;
                opts.timeout_seconds = v
                    .parse::<f64>()
                    .ok()
                    .filter(|t| *t > 0.0 && *t <= crate::plugin::config::MAX_TIMEOUT.as_secs_f64())
                    .ok_or_else(|| {
                        format!("--timeout-seconds {v}: a number of seconds above 0, at most 100")
                    })?;
            }
            "--interval-ms" => {
                let v = value()?;
                let ms = v
                    .parse::<u64>()
                    .ok()
                    .filter(|m| (10..=60_000).contains(m))
                    .ok_or_else(|| format!("--interval-ms {v}: 10 to 60000"))?;
                opts.interval = Duration::from_millis(ms);
            }
            "--watch" if install => opts.watch = true,
            "--wait-for-agent" if install => opts.wait_for_agent = true,
            "--uninstall-on-exit" if install => opts.uninstall_on_exit = true,
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    if !opts.file.ends_with(".conflist") || opts.file.contains('/') || opts.file.starts_with('.') {
        return Err(format!("--file {}: a plain *.conflist name", opts.file));
    }
    if !opts.socket.starts_with('/') {
        return Err(format!("--socket {}: an absolute path", opts.socket));
    }
    Ok((install, opts))
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// The process: `args` starts with `install` or `uninstall`.
pub fn main(args: &[String]) -> i32 {
    let (install, opts) = match parse_args(args) {
        Ok(p) => p,
        Err(text) => {
            eprintln!("{text}");
            return 2;
        }
    };
    if !install {
        return match uninstall(&opts) {
            Ok(removed) => {
                removed
                    .iter()
                    .for_each(|p| log(&format!("removed {}", p.display())));
                0
            }
            Err(e) => {
                log(&e.to_string());
                1
            }
        };
    }
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
    run(&opts, &STOP)
}

#[cfg(test)]
mod tests;
