//! The chained CNI plugin: ADD hands the pod to the agent and returns
//! `prevResult` only once the agent confirms the pod is enforced; DEL tells
//! it to forget and always succeeds; CHECK asks it; STATUS and GC exist
//! for 1.1.0 configs; VERSION lists what is spoken.
//!
//! Everything runs on the values passed in ([`run`]): the process wrapper
//! ([`main`]) only reads the environment and stdin and writes the outcome.
pub mod client;
pub mod config;
pub mod env;
pub mod error;
pub mod host;
pub mod netlink;
pub mod result;

use std::io::Read;

use self::{
    client::exchange,
    config::{NetConf, SUPPORTED, Version},
    env::{Command, Env, parse_args},
    error::{CniError, codes},
};
use crate::protocol::{self, PROTOCOL_VERSION, Request, Response, code};

/// What the process prints on stdout and exits with.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: String,
    pub status: i32,
}

impl Outcome {
    fn success(stdout: String) -> Self {
        Self { stdout, status: 0 }
    }

    fn failure(e: &CniError, cni_version: Option<&str>) -> Self {
        log(&format!("{e}"));
        Self {
            stdout: e.to_json(cni_version),
            status: 1,
        }
    }
}

/// Logs go to stderr: the runtime keeps stdout for the result.
pub fn log(line: &str) {
    eprintln!("policy-cni: {line}");
}

/// The largest stdin read (a config with its prevResult is a few KiB).
const MAX_STDIN: u64 = 4 << 20;

/// The process: environment and stdin in, stdout and the exit status out.
pub fn main() -> i32 {
    let get = |k: &str| std::env::var(k).ok();
    let command = env::command(&get);
    // VERSION may come without stdin; never wait on a terminal.
    // SAFETY: isatty has no preconditions.
    let interactive = unsafe { libc::isatty(0) } == 1;
    let mut stdin = Vec::new();
    let skip = interactive && command == Ok(Command::Version);
    if let Err(e) = (!skip)
        .then(|| std::io::stdin().take(MAX_STDIN).read_to_end(&mut stdin))
        .transpose()
    {
        let out = Outcome::failure(
            &CniError::new(codes::IO, "reading stdin", e.to_string()),
            None,
        );
        println!("{}", out.stdout);
        return out.status;
    }
    let out = run(&get, &stdin);
    if !out.stdout.is_empty() {
        println!("{}", out.stdout);
    }
    out.status
}

/// One invocation.
pub fn run(get: &dyn Fn(&str) -> Option<String>, stdin: &[u8]) -> Outcome {
    let command = match env::command(get) {
        Ok(c) => c,
        Err(e) => return Outcome::failure(&e, None),
    };
    match command {
        Command::Version => Outcome::success(version(stdin)),
        Command::Del => {
            del(get, stdin);
            Outcome::success(String::new())
        }
        _ => {
            let conf = match config::parse(stdin) {
                Ok(c) => c,
                Err(e) => return Outcome::failure(&e, None),
            };
            let done = env::read(get, command).and_then(|env| match command {
                Command::Add => add(&env, &conf),
                Command::Check => check(&env, &conf).map(|()| String::new()),
                Command::Status => status(&conf).map(|()| String::new()),
                _ => gc(&conf).map(|()| String::new()),
            });
            match done {
                Ok(stdout) => Outcome::success(stdout),
                Err(e) => Outcome::failure(&e, Some(&conf.cni_version)),
            }
        }
    }
}

/// `{"cniVersion": <the input's, if spoken>, "supportedVersions": [...]}`.
fn version(stdin: &[u8]) -> String {
    let asked = serde_json::from_slice::<serde_json::Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .filter(|v| SUPPORTED.contains(&v.as_str()));
    serde_json::json!({
        "cniVersion": asked.as_deref().unwrap_or(SUPPORTED[SUPPORTED.len() - 1]),
        "supportedVersions": SUPPORTED,
    })
    .to_string()
}

fn pod_of(env: &Env) -> Result<protocol::PodId, CniError> {
    let args = parse_args(&env.args)?;
    if let Some(infra) = args
        .infra_container_id
        .as_ref()
        .filter(|i| **i != env.container_id)
    {
        log(&format!(
            "K8S_POD_INFRA_CONTAINER_ID {infra} is not CNI_CONTAINERID {}",
            env.container_id
        ));
    }
    args.pod().ok_or_else(|| {
        CniError::env("CNI_ARGS lacks K8S_POD_NAMESPACE or K8S_POD_NAME: not a Kubernetes pod")
    })
}

fn prev_result(conf: &NetConf) -> Result<&serde_json::Value, CniError> {
    conf.prev_result.as_ref().ok_or_else(|| {
        CniError::config(format!(
            "no prevResult: {} must be chained after the node's main plugin in a .conflist",
            conf.plugin_type
        ))
    })
}

/// The host-side interface of the pod's `CNI_IFNAME`, logging what the
/// cross-check noticed.
fn host_interface(
    env: &Env,
    prev: &serde_json::Value,
) -> Result<protocol::HostInterface, CniError> {
    let netns = env.netns.as_deref().unwrap_or_default();
    host::check_not_inside(netns)?;
    let found = host::resolve(netns, &env.ifname, &result::host_candidates(prev))?;
    for note in &found.notes {
        log(note);
    }
    Ok(found.interface)
}

/// Sends the request; an answer that is not `ok` becomes the CNI error
/// with the agent's code, a failed exchange code 11 (try again later).
/// `wait` retries an absent agent until the timeout (ADD, CHECK).
fn ask(conf: &NetConf, request: &Request, wait: bool) -> Result<(), CniError> {
    match exchange(&conf.socket, request, conf.timeout, wait) {
        Ok(Response { ok: true, .. }) => Ok(()),
        Ok(Response { code, message, .. }) => Err(CniError::new(
            code.filter(|&c| c != 0).unwrap_or(code::NOT_ENFORCED),
            "the policy agent did not enforce the pod",
            message,
        )),
        Err(e) => Err(CniError::new(
            codes::TRY_AGAIN,
            "the policy agent did not confirm the pod: try again later",
            e.to_string(),
        )),
    }
}

fn add(env: &Env, conf: &NetConf) -> Result<String, CniError> {
    let prev = prev_result(conf)?;
    // Converted first: a result this plugin cannot re-emit fails before
    // the agent enforces anything.
    let out = result::convert(prev, &conf.cni_version)?;
    let pod = pod_of(env)?;
    let container = result::container_interface(prev, &env.ifname, env.netns.as_deref());
    let ips = result::pod_ips(prev, container)?;
    if ips.is_empty() {
        return Err(CniError::new(
            code::NO_ADDRESS,
            "prevResult holds no address for the pod",
            format!("no ips[] entry for {}", env.ifname),
        ));
    }
    let interface = host_interface(env, prev)?;
    let request = Request {
        version: PROTOCOL_VERSION,
        container_id: env.container_id.clone(),
        command: protocol::Command::Add {
            pod,
            interface,
            ips,
        },
    };
    ask(conf, &request, true)?;
    Ok(out.to_string())
}

/// DEL always succeeds (SPEC: a missing pod or resource is success; an
/// unusable request must not wedge the pod's deletion): what goes wrong
/// is logged, and the agent reaps what it was not told about itself.
fn del(get: &dyn Fn(&str) -> Option<String>, stdin: &[u8]) {
    let env = match env::read(get, Command::Del) {
        Ok(e) => e,
        Err(e) => return log(&format!("DEL: {e}; nothing to tell the agent")),
    };
    let (socket, timeout) = match config::parse(stdin) {
        Ok(c) => (c.socket, c.timeout),
        Err(e) => {
            log(&format!("DEL: {e}; using the default socket"));
            (protocol::DEFAULT_SOCKET.into(), config::DEFAULT_TIMEOUT)
        }
    };
    let pod = match parse_args(&env.args) {
        Ok(a) => a.pod(),
        Err(e) => {
            log(&format!("DEL: {e}"));
            None
        }
    };
    let request = Request {
        version: PROTOCOL_VERSION,
        container_id: env.container_id.clone(),
        command: protocol::Command::Del { pod },
    };
    // One attempt: an absent agent must not hold up pod deletion.
    match exchange(&socket, &request, timeout, false) {
        Ok(Response { ok: true, .. }) => {}
        Ok(r) => log(&format!(
            "DEL {}: the agent answered {:?}: {}",
            env.container_id, r.code, r.message
        )),
        Err(e) => log(&format!("DEL {}: {e}", env.container_id)),
    }
}

fn check(env: &Env, conf: &NetConf) -> Result<(), CniError> {
    if conf.version < Version::V0_4_0 {
        return Err(CniError::version("config version does not allow CHECK"));
    }
    let prev = prev_result(conf)?;
    let pod = pod_of(env)?;
    let interface = host_interface(env, prev)?;
    let request = Request {
        version: PROTOCOL_VERSION,
        container_id: env.container_id.clone(),
        command: protocol::Command::Check { pod, interface },
    };
    ask(conf, &request, true)
}

fn status(conf: &NetConf) -> Result<(), CniError> {
    if conf.version < Version::V1_1_0 {
        return Err(CniError::version("config version does not allow STATUS"));
    }
    let request = Request {
        version: PROTOCOL_VERSION,
        container_id: String::new(),
        command: protocol::Command::Status,
    };
    ask(conf, &request, false).map_err(|e| {
        CniError::new(
            codes::NOT_AVAILABLE,
            "the policy agent cannot take pods",
            format!("{}: {}", e.msg, e.details),
        )
    })
}

/// GC (1.1.0): nothing of this plugin's outlives a pod but the agent's
/// state, which the agent reaps from its own pod list.
fn gc(conf: &NetConf) -> Result<(), CniError> {
    if conf.version < Version::V1_1_0 {
        return Err(CniError::version("config version does not allow GC"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
