//! The real agent (`policy-agent run --cni-socket`) on a simulated node
//! whose pods are made by the CNI driver (Debian's ptp + host-local, ours
//! last): manifests or a fake API server as its source. Everything the
//! test makes (namespaces, pins, the manifests dir) goes on drop.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr},
    os::unix::net::UnixStream,
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use policy_agent::sim::cni::{CniRuntime, Sandbox};
use policy_cni::protocol::{Command, PROTOCOL_VERSION, Request, Response};
use serde_json::{Value, json};

use super::Fixture;

const AGENT: &str = env!("CARGO_BIN_EXE_policy-agent");
/// The node name the agent runs as (and the pods are scheduled to).
pub const NODE: &str = "node-1";
/// host-local's range in [`super::ptp_list`].
pub const POD_CIDR: &str = "10.99.0.0/24";

/// A pod object: labels, this node, no addresses yet (the kubelet
/// publishes them after the sandbox is up), the uid the sandbox passes.
pub fn pod(name: &str, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"), "labels": labels},
        "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "example"}]},
        "status": {"phase": "Pending"}})
}

pub fn namespace() -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "default", "labels": {"kubernetes.io/metadata.name": "default"}}})
}

/// A policy in `default` selecting `app=<app>`, isolating `types`
/// (`Ingress`/`Egress`), with `ingress` rules as given.
pub fn policy(name: &str, app: &str, types: &[&str], ingress: Value) -> Value {
    let mut spec = json!({"podSelector": {"matchLabels": {"app": app}}, "policyTypes": types});
    if !ingress.is_null() {
        spec["ingress"] = ingress;
    }
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "default"}, "spec": spec})
}

/// Objects as one multi-document YAML file (JSON is YAML).
pub fn yaml(objects: &[Value]) -> String {
    objects
        .iter()
        .map(|o| format!("---\n{o}\n"))
        .collect::<String>()
}

/// The agent and its node.
pub struct AgentNode {
    pub fx: Fixture,
    pub pin: PathBuf,
    pub agent: Option<Child>,
    /// Extra `run` arguments (`--pod-cidr`, `--cni-wait-secs`...).
    pub extra: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl AgentNode {
    pub fn new(prefix: &'static str) -> Self {
        let fx = Fixture::new(prefix);
        let pin = PathBuf::from(format!("/sys/fs/bpf/policy-agent-test-{prefix}"));
        let _ = std::fs::remove_dir_all(&pin);
        std::fs::create_dir_all(fx.manifests()).unwrap();
        Self {
            fx,
            pin,
            agent: None,
            extra: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Writes the manifests the agent reads in manifests mode.
    pub fn write(&self, objects: &[Value]) {
        std::fs::write(self.fx.manifests().join("cluster.yaml"), yaml(objects)).unwrap();
    }

    /// Starts `run` (manifests mode unless KUBECONFIG is in `env`) and
    /// waits until it answers STATUS (its first sync has run).
    pub fn start(&mut self) {
        self.start_no_wait();
        // The program load alone takes tens of seconds in a TCG guest:
        // the deadline follows the run's time scale (support::deadline).
        let scale: f64 = std::env::var("POLICY_AGENT_TEST_TIME_SCALE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1.0_f64)
            .max(1.0);
        let deadline = Instant::now() + Duration::from_secs(30).mul_f64(scale);
        loop {
            if let Some(child) = self.agent.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("the agent exited: {status} (arguments {:?})", self.extra);
            }
            if status(&self.fx.socket()).is_some_and(|r| r.ok) {
                return;
            }
            assert!(Instant::now() < deadline, "the agent never became ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn start_no_wait(&mut self) {
        assert!(self.agent.is_none());
        let mut cmd = self.fx.node.node.command(AGENT);
        cmd.args(["run", "--node", NODE, "--datapath", "bpf", "--listen"])
            .arg("127.0.0.1:19999")
            .arg("--pin-dir")
            .arg(&self.pin)
            .arg("--cni-socket")
            .arg(self.fx.socket())
            .args(&self.extra);
        if !self.env.iter().any(|(k, _)| k == "KUBECONFIG") {
            cmd.arg("--manifests").arg(self.fx.manifests());
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        self.agent = Some(cmd.spawn().unwrap());
    }

    /// Kills the agent (SIGKILL: a crash; enforcement stays pinned, the
    /// socket file stays behind).
    pub fn kill(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// A runtime whose list chains ours with `timeout` seconds.
    pub fn runtime(&self, timeout: f64) -> CniRuntime {
        self.fx.runtime("1.0.0", timeout, false)
    }

    pub fn sandbox(&self, rt: &CniRuntime, name: &str) -> Sandbox {
        self.fx.sandbox(rt, name)
    }
}

impl Drop for AgentNode {
    fn drop(&mut self) {
        self.kill();
        // Detach and unpin (the namespaces go with the fixture).
        let _ = self
            .fx
            .node
            .node
            .command(AGENT)
            .arg("reset")
            .arg("--pin-dir")
            .arg(&self.pin)
            .output();
        let _ = std::fs::remove_dir_all(&self.pin);
    }
}

/// The pod's IPv4 address from a CNI result.
pub fn ipv4(result: &Value) -> Ipv4Addr {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|ip| {
            let a: IpAddr = ip["address"].as_str()?.split('/').next()?.parse().ok()?;
            match a {
                IpAddr::V4(v4) => Some(v4),
                IpAddr::V6(_) => None,
            }
        })
        .expect("an IPv4 address")
}

/// One request to the agent's socket (None: no agent answering).
pub fn ask(socket: &std::path::Path, command: Command) -> Option<Response> {
    let mut s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = Request {
        version: PROTOCOL_VERSION,
        container_id: "test".into(),
        command,
    };
    let mut line = serde_json::to_string(&req).ok()?;
    line.push('\n');
    s.write_all(line.as_bytes()).ok()?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).ok()?;
    serde_json::from_str(&answer).ok()
}

pub fn status(socket: &std::path::Path) -> Option<Response> {
    ask(socket, Command::Status)
}
