//! The conformance harness: a simulated node with three namespaces of three
//! pods each (TCP 80 and 8080, UDP 53 and 5353, IPv4 and IPv6), manifests
//! written to a directory, `policy-agent apply`/`run` in the node
//! namespace, and the full connectivity matrix compared with expectations.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use super::{
    conformance_svc::{self, SERVICE_CIDR_ARGS, ServiceRun},
    deadline::scaled,
};
use policy_agent::{
    datapath::bpf::PinLayout,
    sim::{
        Matrix, NODE_ROW, Servers, SimNode, SimPod, Target, Transport, Via, cleanup_prefix,
        kube_proxy::ProxyMode,
    },
};

pub const AGENT: &str = env!("CARGO_BIN_EXE_policy-agent");
/// How long the probes of one matrix wait, together, on the host (see
/// [`scaled`]): a cell is open only if its reply came within it.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(350);
/// How long `run` may take to be ready, on the host.
pub const DAEMON_READY: Duration = Duration::from_secs(20);
/// A cell expected open that failed is probed again, this long, so many
/// times, before it counts (a slow answer on a loaded machine is no
/// verdict). Cells expected blocked are judged once, strictly.
pub const RETRY_TIMEOUT: Duration = Duration::from_millis(1500);
pub const RETRIES: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Bpf,
    Iptables,
}

impl Backend {
    pub fn flag(self) -> &'static str {
        match self {
            Backend::Bpf => "bpf",
            Backend::Iptables => "iptables",
        }
    }
}

#[derive(Clone, Debug)]
pub struct NsSpec {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub ips: Vec<IpAddr>,
    /// Container port name → (number, protocol).
    pub ports: Vec<(String, u16, &'static str)>,
}

impl PodSpec {
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// alpha {team: a, env: prod}, beta {team: b, env: prod}, gamma {team: c,
/// env: dev}; in each: web {app: web, tier: front}, api {app: api, tier:
/// back}, db {app: db, tier: back}. Ports: http=80, admin=8080 (TCP), dns=53,
/// cache=5353 (UDP); in gamma the names http and admin are swapped.
pub fn default_cluster() -> (Vec<NsSpec>, Vec<PodSpec>) {
    let nss = [
        ("alpha", "a", "prod"),
        ("beta", "b", "prod"),
        ("gamma", "c", "dev"),
    ];
    let pods = [("web", "front"), ("api", "back"), ("db", "back")];
    let mut ns_specs = Vec::new();
    let mut pod_specs = Vec::new();
    for (i, (ns, team, env)) in nss.iter().enumerate() {
        ns_specs.push(NsSpec {
            name: (*ns).into(),
            labels: labels(&[("team", team), ("env", env)]),
        });
        for (j, (pod, tier)) in pods.iter().enumerate() {
            let (http, admin) = if *ns == "gamma" {
                (8080, 80)
            } else {
                (80, 8080)
            };
            pod_specs.push(PodSpec {
                namespace: (*ns).into(),
                name: (*pod).into(),
                labels: labels(&[("app", pod), ("tier", tier)]),
                ips: vec![
                    format!("10.244.{}.{}", i + 1, 10 + j).parse().unwrap(),
                    format!("fd00:244:{}::{}", i + 1, 10 + j).parse().unwrap(),
                ],
                ports: vec![
                    ("http".into(), http, "TCP"),
                    ("admin".into(), admin, "TCP"),
                    ("dns".into(), 53, "UDP"),
                    ("cache".into(), 5353, "UDP"),
                ],
            });
        }
    }
    (ns_specs, pod_specs)
}

pub const NODE: &str = "node-1";

fn yaml_map(m: &BTreeMap<String, String>) -> String {
    let inner: Vec<String> = m.iter().map(|(k, v)| format!("{k:?}: {v:?}")).collect();
    format!("{{{}}}", inner.join(", "))
}

pub fn cluster_yaml(nss: &[NsSpec], pods: &[PodSpec]) -> String {
    let mut out = String::new();
    for ns in nss {
        out += &format!(
            "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: {}\n  labels: {}\n",
            ns.name,
            yaml_map(&ns.labels)
        );
    }
    for p in pods {
        let ports: Vec<String> = p
            .ports
            .iter()
            .map(|(n, port, proto)| {
                format!("{{name: {n}, containerPort: {port}, protocol: {proto}}}")
            })
            .collect();
        let ips: Vec<String> = p.ips.iter().map(|ip| format!("{{ip: \"{ip}\"}}")).collect();
        out += &format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n  namespace: {}\n  labels: {}\nspec:\n  nodeName: {NODE}\n  containers:\n    - name: main\n      image: example\n      ports: [{}]\nstatus:\n  phase: Running\n  podIPs: [{}]\n",
            p.name,
            p.namespace,
            yaml_map(&p.labels),
            ports.join(", "),
            ips.join(", ")
        );
    }
    out
}

pub struct Conformance {
    pub prefix: &'static str,
    pub dir: PathBuf,
    pub layout: PinLayout,
    pub backend: Backend,
    pub namespaces: Vec<NsSpec>,
    pub pods: Vec<PodSpec>,
    pub servers: Option<Servers>,
    pub daemon: Option<Child>,
    /// Each pod's ClusterIP Service and kube-proxy's rules for them, once
    /// [`Self::with_services`] is called: every check then runs a second
    /// pass through the ClusterIPs.
    pub services: std::cell::RefCell<Option<ServiceRun>>,
    /// Declared last: dropped after the servers.
    pub node: Option<SimNode>,
}

pub struct AgentRun {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Conformance {
    /// A fresh simulated node named by `prefix` (at most 9 alphanumerics).
    pub fn new(prefix: &'static str, backend: Backend) -> Self {
        let (namespaces, pods) = default_cluster();
        Self::with_cluster(prefix, backend, namespaces, pods)
    }

    pub fn with_cluster(
        prefix: &'static str,
        backend: Backend,
        namespaces: Vec<NsSpec>,
        pods: Vec<PodSpec>,
    ) -> Self {
        cleanup_prefix(prefix);
        let dir = std::env::temp_dir().join(format!("policy-agent-conformance-{prefix}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let layout = PinLayout::new(format!("/sys/fs/bpf/policy-agent-test-{prefix}"));
        let mut this = Self {
            prefix,
            dir,
            layout,
            backend,
            namespaces,
            pods,
            servers: None,
            daemon: None,
            services: std::cell::RefCell::new(None),
            node: None,
        };
        let sim_pods: Vec<SimPod> = this
            .pods
            .iter()
            .map(|p| SimPod {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                ips: p.ips.clone(),
                tcp_ports: vec![80, 8080],
                udp_ports: vec![53, 5353],
            })
            .collect();
        let node = SimNode::create(prefix, &sim_pods).expect("create the simulated node");
        this.servers = Some(Servers::start(&node).expect("start servers"));
        this.node = Some(node);
        this.write_cluster();
        this.write_policies("");
        this
    }

    pub fn node(&self) -> &SimNode {
        self.node.as_ref().unwrap()
    }

    /// Writes Namespaces and Pods (and, with Services, each pod's
    /// Service and EndpointSlices, kube-proxy following them).
    pub fn write_cluster(&self) {
        let mut text = cluster_yaml(&self.namespaces, &self.pods);
        let mut services = self.services.borrow_mut();
        if let Some(run) = services.as_mut() {
            text += &conformance_svc::yaml(&conformance_svc::manifests(&self.pods));
            run.update(&self.pods);
        }
        std::fs::write(self.dir.join("cluster.yaml"), text).unwrap();
    }

    /// Gives every pod a ClusterIP Service (written into the manifests)
    /// and starts kube-proxy (`mode`) in the node namespace on the same
    /// manifests; from now on every check also probes through the
    /// ClusterIPs. Call before applying.
    pub fn with_services(&self, mode: ProxyMode) {
        let run = ServiceRun::install(&self.node().node, mode, &self.pods);
        *self.services.borrow_mut() = Some(run);
        self.write_cluster();
    }

    fn service_args(&self) -> Vec<&'static str> {
        if self.services.borrow().is_some() {
            SERVICE_CIDR_ARGS.to_vec()
        } else {
            Vec::new()
        }
    }

    pub fn write_policies(&self, yaml: &str) {
        std::fs::write(self.dir.join("policies.yaml"), yaml).unwrap();
    }

    pub fn pod_mut(&mut self, id: &str) -> &mut PodSpec {
        self.pods.iter_mut().find(|p| p.id() == id).unwrap()
    }

    pub fn ns_mut(&mut self, name: &str) -> &mut NsSpec {
        self.namespaces.iter_mut().find(|n| n.name == name).unwrap()
    }

    fn agent(&self, args: &[&str]) -> Command {
        let mut cmd = self.node().node.command(AGENT);
        cmd.args(args)
            .args(["--pin-dir", self.layout.root().to_str().unwrap()]);
        cmd
    }

    /// `policy-agent apply` in the node namespace.
    pub fn apply(&self) -> AgentRun {
        self.apply_with(&[])
    }

    /// `policy-agent apply` with extra arguments.
    pub fn apply_with(&self, extra: &[&str]) -> AgentRun {
        let dir = self.dir.to_str().unwrap().to_owned();
        let out: Output = self
            .agent(&[
                "apply",
                "--manifests",
                &dir,
                "--node",
                NODE,
                "--datapath",
                self.backend.flag(),
            ])
            .args(self.service_args())
            .args(extra)
            .output()
            .unwrap();
        AgentRun {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Applies and requires success.
    pub fn apply_ok(&self) {
        let run = self.apply();
        assert!(
            run.ok,
            "apply failed:\nstdout: {}\nstderr: {}",
            run.stdout, run.stderr
        );
    }

    /// Starts `policy-agent run` on the manifests (metrics on `port`).
    pub fn start_daemon(&mut self, port: u16) {
        let dir = self.dir.to_str().unwrap().to_owned();
        self.start_daemon_with(port, &["--manifests", &dir], &[]);
    }

    /// Starts `policy-agent run` with `args` and `env` (cluster mode: no
    /// --manifests, KUBECONFIG in `env`).
    pub fn start_daemon_with(&mut self, port: u16, args: &[&str], env: &[(&str, &str)]) {
        let listen = format!("127.0.0.1:{port}");
        let child = self
            .agent(&[
                "run",
                "--node",
                NODE,
                "--listen",
                &listen,
                "--datapath",
                self.backend.flag(),
            ])
            .args(self.service_args())
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        // Ready once the first sync is enforced.
        let deadline = Instant::now() + scaled(DAEMON_READY);
        while Instant::now() < deadline {
            if self.http_get(port, "/readyz").starts_with("HTTP/1.1 200") {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the daemon did not become ready");
    }

    /// `policy-agent dump --json`, parsed.
    pub fn dump(&self) -> serde_json::Value {
        let out = self.agent(&["dump", "--json"]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `policy-agent reset`.
    pub fn reset(&self) {
        let out = self.agent(&["reset"]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Stops the daemon (enforcement stays pinned).
    pub fn stop_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }

    /// A GET from inside the node namespace (the daemon listens there).
    pub fn http_get(&self, port: u16, path: &str) -> String {
        let script = format!(
            "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET {path} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' >&3 && cat <&3"
        );
        self.node()
            .node
            .exec("bash", &["-c", &script])
            .unwrap_or_default()
    }

    /// The matrix as the senders and the receivers saw it, once.
    pub fn matrix(&self) -> Matrix {
        self.node()
            .probe_matrix_at(self.servers.as_ref().unwrap(), scaled(PROBE_TIMEOUT), true)
            .unwrap()
    }

    /// The matrix compared with `expect(from, to, port, transport)` (true:
    /// open), the same expectation for both families.
    pub fn check(&self, what: &str, expect: impl Fn(&str, &str, u16, Transport) -> bool) -> Matrix {
        self.check_by_family(what, |f, t, port, tr, _| expect(f, t, port, tr))
    }

    /// Compares the whole matrix with `expect(from, to, port, transport,
    /// is_ipv6)` (true: open); `from` is a pod id or "(node)". Every cell
    /// is judged at both ends: open means the request reached the
    /// destination pod and the reply came back, blocked that nothing
    /// reached it. Cells expected open that failed are retried. With
    /// Services ([`Self::with_services`]) the matrix is probed a second
    /// time through each pod's ClusterIPs, against the same expectation
    /// (the cells [`conformance_svc::skipped`] says cannot go through a
    /// Service left out).
    pub fn check_by_family(
        &self,
        what: &str,
        expect: impl Fn(&str, &str, u16, Transport, bool) -> bool,
    ) -> Matrix {
        let (m, wrong) = self.judged(&expect, true);
        assert!(
            wrong.is_empty(),
            "{what}: {} cell(s) differ from the expectation:\n{}\nmatrix:\n{m}",
            wrong.len(),
            wrong.join("\n")
        );
        let mode = self.services.borrow().as_ref().map(|s| s.mode);
        if let Some(mode) = mode {
            let (s, wrong) = self.judged_via_services(&expect);
            assert!(
                !s.cells.is_empty(),
                "{what}: nothing was probed through the ClusterIPs"
            );
            assert!(
                wrong.is_empty(),
                "{what}, through the pods' ClusterIPs (kube-proxy {mode} mode): {} cell(s) differ from the pod-IP expectation:\n{}\nmatrix:\n{s}",
                wrong.len(),
                wrong.join("\n")
            );
        }
        m
    }

    /// The ClusterIP pass: every probe to the target pod's Service
    /// ClusterIP (same family, same port), judged at the pod.
    fn judged_via_services(
        &self,
        expect: &impl Fn(&str, &str, u16, Transport, bool) -> bool,
    ) -> (Matrix, Vec<String>) {
        let by_target = |f: &str, t: &Target, v6: bool| expect(f, &t.pod, t.port, t.transport, v6);
        let via = Via {
            address: &conformance_svc::via_address,
            skip: &conformance_svc::skipped,
        };
        self.node()
            .judge_matrix_via(
                self.servers.as_ref().unwrap(),
                false,
                scaled(PROBE_TIMEOUT),
                scaled(RETRY_TIMEOUT),
                RETRIES,
                &by_target,
                Some(&via),
            )
            .unwrap()
    }

    /// Probes and judges; `retry` retries cells expected open that failed.
    fn judged(
        &self,
        expect: &impl Fn(&str, &str, u16, Transport, bool) -> bool,
        retry: bool,
    ) -> (Matrix, Vec<String>) {
        let by_target = |f: &str, t: &Target, v6: bool| expect(f, &t.pod, t.port, t.transport, v6);
        self.node()
            .judge_matrix(
                self.servers.as_ref().unwrap(),
                true,
                scaled(PROBE_TIMEOUT),
                scaled(RETRY_TIMEOUT),
                if retry { RETRIES } else { 0 },
                &by_target,
            )
            .unwrap()
    }

    /// Re-checks until the matrix matches (for `run` mode), up to `within`
    /// ([`scaled`]). Returns how long it took.
    pub fn eventually(
        &self,
        what: &str,
        within: Duration,
        expect: impl Fn(&str, &str, u16, Transport) -> bool,
    ) -> Duration {
        self.eventually_by_family(what, within, |f, t, port, tr, _| expect(f, t, port, tr))
    }

    /// [`Self::eventually`] with an expectation per family.
    pub fn eventually_by_family(
        &self,
        what: &str,
        within: Duration,
        expect: impl Fn(&str, &str, u16, Transport, bool) -> bool,
    ) -> Duration {
        let within = scaled(within);
        let start = Instant::now();
        loop {
            // Not converged while a cell expected blocked is not: cells
            // expected open are retried only once those agree.
            let (_, wrong) = self.judged(&expect, false);
            let blocked_ok = wrong.iter().all(|w| w.contains("expected open"));
            let wrong = if wrong.is_empty() || !blocked_ok {
                wrong
            } else {
                self.judged(&expect, true).1
            };
            if wrong.is_empty() {
                return start.elapsed();
            }
            if start.elapsed() > within {
                panic!(
                    "{what}: still {} cell(s) wrong after {within:?}:\n{}",
                    wrong.len(),
                    wrong.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Conformance {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        if self.node.is_some() {
            let _ = self.agent(&["reset"]).output();
        }
        self.servers = None;
        // kube-proxy's rules go before the node namespace.
        *self.services.borrow_mut() = None;
        self.node = None;
        cleanup_prefix(self.prefix);
        let _ = std::fs::remove_dir_all(self.layout.root());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Same namespace?
pub fn same_ns(a: &str, b: &str) -> bool {
    a.split('/').next() == b.split('/').next()
}

pub fn ns_of(id: &str) -> &str {
    id.split('/').next().unwrap_or("")
}

pub fn name_of(id: &str) -> &str {
    id.split('/').nth(1).unwrap_or("")
}

pub fn is_node(id: &str) -> bool {
    id == NODE_ROW
}

pub fn socket(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// Cells of `m` judged (at both ends) differently from `expect(from, to,
/// port, transport)`, described ("expected open"/"expected blocked").
#[allow(dead_code)]
pub fn mismatches(m: &Matrix, expect: &impl Fn(&str, &str, u16, Transport) -> bool) -> Vec<String> {
    m.mismatches(&|f: &str, t: &Target, _v6: bool| expect(f, &t.pod, t.port, t.transport))
}
