//! The Services harness: a two-node simulated cluster with a policy agent
//! daemon (`policy-agent run`) in each node namespace (its own `--node`,
//! `--pin-dir`, the sim's `--service-cidr`s, one manifest directory for
//! both), a kube-proxy stand-in per node fed from the same manifests, and
//! servers in the pods that say who they are (`sim::backend`) and echo
//! (`sim::Servers`, for connections kept open).
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use policy_agent::{
    cluster::ClusterState,
    sim::{
        KubeProxies, NetNs, SERVICE_CIDR_V4, SERVICE_CIDR_V6, Servers, SimCluster, SimPod,
        backend::{Backends, L4, Reply, Served, ask},
        cleanup_prefix,
        dns::{DnsServer, NameTable},
        kube_proxy::ProxyMode,
        manifests::{Manifests, PodManifest, ServiceManifest, TargetPort},
        pod_ips,
    },
};
use policy_common::proto::{TCP, UDP};

use super::conformance::{AGENT, Backend};

/// Every pod also serves a TCP echo (greeting, then echo) on this port,
/// for connections a test keeps open.
pub const ECHO_PORT: u16 = 7000;
/// Where each agent serves /metrics and /readyz (inside its node's
/// network namespace: the same port on both nodes).
const LISTEN_PORT: u16 = 9402;

/// `d` scaled by `POLICY_AGENT_TEST_TIME_SCALE` (a factor, default 1): a
/// slow machine (an emulated VM) stretches every deadline.
pub fn scaled(d: Duration) -> Duration {
    let factor = std::env::var("POLICY_AGENT_TEST_TIME_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|f| *f >= 1.0)
        .unwrap_or(1.0);
    d.mul_f64(factor)
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub fn sock(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// A namespace and its labels (`kubernetes.io/metadata.name` is added).
#[derive(Clone, Debug)]
pub struct Namespace {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

impl Namespace {
    pub fn new(name: &str, labels: &[(&str, &str)]) -> Self {
        Self {
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }
}

/// The cluster, its agents and stand-ins; everything is removed on drop
/// (agents killed and reset, servers stopped, kube-proxy's rules removed,
/// namespaces and pins deleted), also when a test fails.
pub struct Env {
    pub prefix: &'static str,
    pub datapath: Backend,
    pub mode: ProxyMode,
    pub dir: PathBuf,
    pub namespaces: Vec<Namespace>,
    pub m: Manifests,
    agents: Vec<Child>,
    pub backends: Backends,
    echo: Vec<Servers>,
    dns: Vec<DnsServer>,
    pub proxies: Option<KubeProxies>,
    /// Declared last: dropped after everything running inside it.
    pub cluster: Option<SimCluster>,
}

impl Env {
    /// Creates the cluster of `m` (`prefix`: at most 9 alphanumerics),
    /// writes the manifests (no policy yet), starts kube-proxy on both
    /// nodes, the echo servers of every pod, the identity servers of every
    /// pod with container ports, and a DNS server in every `k8s-app:
    /// kube-dns` pod (answering [`WEB_NAME`]). The agents are started by
    /// [`Self::start_agents`].
    pub fn new(
        prefix: &'static str,
        datapath: Backend,
        mode: ProxyMode,
        namespaces: Vec<Namespace>,
        m: Manifests,
    ) -> Self {
        cleanup_prefix(prefix);
        let dir = std::env::temp_dir().join(format!("policy-agent-services-{prefix}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut this = Self {
            prefix,
            datapath,
            mode,
            dir,
            namespaces,
            m,
            agents: Vec::new(),
            backends: Backends::new(),
            echo: Vec::new(),
            dns: Vec::new(),
            proxies: None,
            cluster: None,
        };
        let on = |n: &str| -> Vec<SimPod> {
            this.m
                .pods
                .iter()
                .filter(|p| p.node == n)
                .map(|p| SimPod {
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    ips: p.ips.clone(),
                    tcp_ports: vec![ECHO_PORT],
                    udp_ports: Vec::new(),
                })
                .collect()
        };
        let cluster = SimCluster::create(prefix, &on("node-1"), &on("node-2"))
            .expect("create the simulated cluster");
        this.cluster = Some(cluster);
        this.write_cluster();
        this.write_policies("");
        let state = this.state();
        this.proxies = Some(this.cluster().kube_proxies(mode, &state).unwrap());
        this.echo = this
            .cluster()
            .nodes
            .iter()
            .map(|node| Servers::start(&node.sim).unwrap())
            .collect();
        let pods = this.m.pods.clone();
        for p in pods.iter().filter(|p| !p.ports.is_empty()) {
            let netns = NetNs::borrow(&this.netns(&p.id()).name);
            if p.labels.get("k8s-app").map(String::as_str) == Some("kube-dns") {
                let mut names = NameTable::new();
                names.insert(WEB_NAME.into(), vec![ip(WEB_V4), ip(WEB_V6)]);
                this.dns
                    .push(DnsServer::start(&netns, &p.ips, 53, names).unwrap());
                continue;
            }
            let sim = p.sim_pod();
            let tcp: Vec<u16> = sim
                .tcp_ports
                .into_iter()
                .filter(|p| *p != ECHO_PORT)
                .collect();
            this.backends
                .add(&netns, &p.id(), &p.ips, &tcp, &sim.udp_ports)
                .unwrap();
        }
        this
    }

    pub fn cluster(&self) -> &SimCluster {
        self.cluster.as_ref().unwrap()
    }

    /// A pod's network namespace.
    pub fn netns(&self, pod: &str) -> &NetNs {
        &self
            .cluster()
            .pod(pod)
            .unwrap_or_else(|| panic!("no pod {pod}"))
            .1
            .netns
    }

    /// The pod's addresses.
    pub fn ips(&self, pod: &str) -> Vec<IpAddr> {
        self.m
            .pods
            .iter()
            .find(|p| p.id() == pod)
            .unwrap_or_else(|| panic!("no pod {pod}"))
            .ips
            .clone()
    }

    /// The model kube-proxy reads: the manifests as written.
    pub fn state(&self) -> ClusterState {
        self.m.cluster_state("", &[]).unwrap()
    }

    /// Writes Namespaces, Pods, Services and EndpointSlices.
    pub fn write_cluster(&self) {
        let mut text = String::new();
        for ns in &self.namespaces {
            let mut labels = ns.labels.clone();
            labels.insert("kubernetes.io/metadata.name".into(), ns.name.clone());
            let labels: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k:?}: {v:?}"))
                .collect();
            text += &format!(
                "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {}\n  labels: {{{}}}\n---\n",
                ns.name,
                labels.join(", ")
            );
        }
        text += &self.m.to_yaml().unwrap();
        // Written whole, then renamed: the agents never read half a file.
        let tmp = self.dir.join(".cluster.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.dir.join("cluster.yaml")).unwrap();
    }

    pub fn write_policies(&self, yaml: &str) {
        let tmp = self.dir.join(".policies.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, self.dir.join("policies.yaml")).unwrap();
    }

    /// Changes the cluster: the manifests (the agents follow them) and
    /// then kube-proxy on both nodes, as in a cluster where both watch the
    /// API server.
    pub fn update(&mut self, change: impl FnOnce(&mut Manifests)) {
        change(&mut self.m);
        self.write_cluster();
        let state = self.state();
        self.proxies.as_mut().unwrap().update(&state).unwrap();
    }

    /// Runs `check`; if it fails, prints what every node's maps hold
    /// (`policy-agent dump`: endpoints with their revisions, policy
    /// entries, conntrack) before failing: the kernel's side of a wrong
    /// verdict.
    pub fn dump_on_failure<T>(&self, check: impl FnOnce() -> T) -> T {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)) {
            Ok(v) => v,
            Err(panic) => {
                for node in &self.cluster().nodes {
                    let out = node
                        .sim
                        .node
                        .command(AGENT)
                        .arg("dump")
                        .arg("--pin-dir")
                        .arg(self.pin_root(&node.name))
                        .output();
                    match out {
                        Ok(o) => eprintln!(
                            "--- maps of {} ---\n{}{}",
                            node.name,
                            String::from_utf8_lossy(&o.stdout),
                            String::from_utf8_lossy(&o.stderr)
                        ),
                        Err(e) => eprintln!("--- maps of {}: dump failed: {e}", node.name),
                    }
                }
                std::panic::resume_unwind(panic)
            }
        }
    }

    fn pin_root(&self, node: &str) -> PathBuf {
        PathBuf::from(format!(
            "/sys/fs/bpf/policy-agent-test-{}-{node}",
            self.prefix
        ))
    }

    /// Starts `policy-agent run` on both nodes and waits until both have
    /// enforced their first sync.
    pub fn start_agents(&mut self) {
        let started = Instant::now();
        let dir = self.dir.to_str().unwrap().to_owned();
        let listen = format!("127.0.0.1:{LISTEN_PORT}");
        for node in &self.cluster.as_ref().unwrap().nodes {
            let pins = self.pin_root(&node.name);
            let child = node
                .sim
                .node
                .command(AGENT)
                .args([
                    "run",
                    "--manifests",
                    &dir,
                    "--node",
                    &node.name,
                    "--listen",
                    &listen,
                    "--datapath",
                    self.datapath.flag(),
                    "--pin-dir",
                    pins.to_str().unwrap(),
                    "--service-cidr",
                    SERVICE_CIDR_V4,
                    "--service-cidr",
                    SERVICE_CIDR_V6,
                ])
                .env(
                    "RUST_LOG",
                    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap();
            self.agents.push(child);
        }
        let deadline = Instant::now() + scaled(Duration::from_secs(30));
        for node in &self.cluster().nodes {
            loop {
                if http_get(&node.sim.node, "/readyz").starts_with("HTTP/1.1 200") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the agent of {} did not become ready",
                    node.name
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        eprintln!("{}: agents ready in {:?}", self.prefix, started.elapsed());
    }

    /// `policy-agent dump` of `node`'s pins (for failure messages).
    pub fn dump(&self, node: &str) -> String {
        let n = self.cluster().node(node).unwrap();
        let pins = self.pin_root(node);
        n.sim
            .node
            .exec(AGENT, &["dump", "--pin-dir", pins.to_str().unwrap()])
            .unwrap_or_else(|e| format!("dump failed: {e}"))
    }

    /// `count` connections (TCP) or datagrams (UDP, each its own flow)
    /// from `from` to `to`.
    pub fn ask(
        &self,
        from: &str,
        to: SocketAddr,
        l4: L4,
        count: usize,
        timeout: Duration,
    ) -> Vec<Reply> {
        ask(self.netns(from), to, l4, count, scaled(timeout)).unwrap()
    }

    /// Several [`Self::ask`]s at once (one thread each): their timeouts
    /// overlap instead of adding up.
    pub fn ask_all(
        &self,
        from: &str,
        asks: &[(SocketAddr, L4)],
        count: usize,
        timeout: Duration,
    ) -> Vec<Vec<Reply>> {
        let netns = self.netns(from);
        std::thread::scope(|s| {
            let handles: Vec<_> = asks
                .iter()
                .map(|(to, l4)| {
                    s.spawn(move || ask(netns, *to, *l4, count, scaled(timeout)).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// What `pod`'s identity server answered, from `from`'s addresses.
    pub fn served(&self, pod: &str, from: &str) -> Vec<Served> {
        let from = self.ips(from);
        self.backends
            .served()
            .into_iter()
            .filter(|s| s.pod == pod && from.contains(&s.peer.ip()))
            .collect()
    }
}

/// A GET from inside `netns` (each agent listens in its node's namespace).
pub fn http_get(netns: &NetNs, path: &str) -> String {
    http_get_at(netns, LISTEN_PORT, path)
}

/// A GET of `127.0.0.1:port` from inside `netns`.
pub fn http_get_at(netns: &NetNs, port: u16, path: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n' >&3 && timeout 5 cat <&3"
    );
    netns.exec("bash", &["-c", &script]).unwrap_or_default()
}

/// Retries `check` until it passes, for at most `within` (scaled); the
/// last failure is the panic message.
pub fn eventually(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> Result<(), String>,
) -> Duration {
    let start = Instant::now();
    let within = scaled(within);
    loop {
        match check() {
            Ok(()) => return start.elapsed(),
            Err(e) if start.elapsed() > within => {
                panic!("{what}: still failing after {within:?}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for mut a in self.agents.drain(..) {
            let _ = a.kill();
            let _ = a.wait();
        }
        if let Some(cluster) = &self.cluster {
            for node in &cluster.nodes {
                let pins = self.pin_root(&node.name);
                let _ = node
                    .sim
                    .node
                    .command(AGENT)
                    .args(["reset", "--pin-dir", pins.to_str().unwrap()])
                    .output();
            }
        }
        self.echo.clear();
        self.dns.clear();
        self.backends = Backends::new();
        if let Some(p) = self.proxies.take() {
            let _ = p.remove();
        }
        self.cluster = None;
        cleanup_prefix(self.prefix);
        for node in ["node-1", "node-2"] {
            let _ = std::fs::remove_dir_all(self.pin_root(node));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The name the DNS servers answer (with web's ClusterIPs).
pub const WEB_NAME: &str = "web.default.svc.cluster.local";
/// The Services every case uses.
pub const WEB_V4: &str = "10.96.0.50";
pub const WEB_V6: &str = "fd00:96::50";
pub const WEB_NODE_PORT: u16 = 30080;
pub const SOLO_V4: &str = "10.96.0.60";
pub const SOLO_V6: &str = "fd00:96::60";
pub const SOLO2_V4: &str = "10.96.0.61";
pub const SOLO2_V6: &str = "fd00:96::61";
pub const DNS_V4: &str = "10.96.0.10";
pub const DNS_V6: &str = "fd00:96::a";
/// The port of every Service that reaches the pods' echo servers.
pub const ECHO_SVC_PORT: u16 = 7;

/// The cluster of every case:
///
/// * `default/client` (node-1, `app: client`), the pod whose traffic is
///   judged;
/// * every pod but the client also has the label `pod: <its name>`;
/// * `web-a`, `web-b` (node-1) and `web-c`, `web-d` (node-2), `app: web`,
///   behind `default/web` (TCP 80 to the named port `http`: 8080, on
///   web-c 8081; UDP 81 to 8082; NodePort 30080 for http); `web-a` and
///   `web-c` are `tier: ok`, `web-b` and `web-d` `tier: no`;
/// * `solo-a`, `solo-b` (node-1), `solo-c`, `solo-d` (node-2), `pick:
///   <letter>`, TCP and UDP 9090; `default/solo` selects `pick: a`,
///   `default/solo2` `pick: c` (TCP and UDP 80 to 9090); tiers as for web;
/// * `kube-system/coredns-a` (node-1) and `coredns-b` (node-2), `k8s-app:
///   kube-dns`, behind `kube-system/kube-dns` (UDP `dns` and TCP
///   `dns-tcp`, both 53; served by [`policy_agent::sim::dns`], not by an
///   identity server).
///
/// Every Service also has TCP 7 to every pod's echo server (7000).
pub fn cluster() -> (Vec<Namespace>, Manifests) {
    let web = |name: &str, node: u8, host: u8, http: u16, tier: &str| {
        PodManifest::new(
            "default",
            name,
            &format!("node-{node}"),
            &pod_ips(node, host),
        )
        .label("app", "web")
        .label("pod", name)
        .label("tier", tier)
        .port("http", TCP, http)
        .port("", UDP, 8082)
        .port("echo", TCP, ECHO_PORT)
    };
    let solo = |pick: &str, node: u8, host: u8, tier: &str| {
        PodManifest::new(
            "default",
            &format!("solo-{pick}"),
            &format!("node-{node}"),
            &pod_ips(node, host),
        )
        .label("pick", pick)
        .label("pod", &format!("solo-{pick}"))
        .label("tier", tier)
        .port("", TCP, 9090)
        .port("", UDP, 9090)
        .port("echo", TCP, ECHO_PORT)
    };
    let dns = |name: &str, node: u8| {
        PodManifest::new(
            "kube-system",
            name,
            &format!("node-{node}"),
            &pod_ips(node, 53),
        )
        .label("k8s-app", "kube-dns")
        .port("dns", UDP, 53)
        .port("dns-tcp", TCP, 53)
    };
    let echo =
        |s: ServiceManifest| s.port("echo", TCP, ECHO_SVC_PORT, TargetPort::Number(ECHO_PORT));
    let m = Manifests {
        pods: vec![
            PodManifest::new("default", "client", "node-1", &pod_ips(1, 2)).label("app", "client"),
            web("web-a", 1, 10, 8080, "ok"),
            web("web-b", 1, 11, 8080, "no"),
            web("web-c", 2, 10, 8081, "ok"),
            web("web-d", 2, 11, 8080, "no"),
            solo("a", 1, 20, "ok"),
            solo("b", 1, 21, "no"),
            solo("c", 2, 20, "ok"),
            solo("d", 2, 21, "no"),
            dns("coredns-a", 1),
            dns("coredns-b", 2),
        ],
        services: vec![
            echo(
                ServiceManifest::new("default", "web", &[ip(WEB_V4), ip(WEB_V6)])
                    .select("app", "web")
                    .port("http", TCP, 80, TargetPort::Name("http".into()))
                    .port("udp", UDP, 81, TargetPort::Number(8082)),
            )
            .node_port("http", WEB_NODE_PORT),
            echo(
                ServiceManifest::new("default", "solo", &[ip(SOLO_V4), ip(SOLO_V6)])
                    .select("pick", "a")
                    .port("tcp", TCP, 80, TargetPort::Number(9090))
                    .port("udp", UDP, 80, TargetPort::Number(9090)),
            ),
            echo(
                ServiceManifest::new("default", "solo2", &[ip(SOLO2_V4), ip(SOLO2_V6)])
                    .select("pick", "c")
                    .port("tcp", TCP, 80, TargetPort::Number(9090))
                    .port("udp", UDP, 80, TargetPort::Number(9090)),
            ),
            ServiceManifest::new("kube-system", "kube-dns", &[ip(DNS_V4), ip(DNS_V6)])
                .select("k8s-app", "kube-dns")
                .port("dns", UDP, 53, TargetPort::Name("dns".into()))
                .port("dns-tcp", TCP, 53, TargetPort::Name("dns-tcp".into())),
        ],
    };
    let namespaces = vec![
        Namespace::new("default", &[]),
        Namespace::new("kube-system", &[]),
    ];
    (namespaces, m)
}

/// A NetworkPolicy document.
pub fn policy(namespace: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{spec}"
    )
}

/// The client pod (`default/client`).
pub const CLIENT: &str = "default/client";

/// The client's policy: isolated both ways (replies must come back
/// through conntrack), egress as given.
pub fn client_policy(egress: &str) -> String {
    policy(
        "default",
        "client",
        &format!(
            "  podSelector: {{matchLabels: {{app: client}}}}\n  policyTypes: [Ingress, Egress]\n  egress:\n{egress}"
        ),
    )
}

/// web's ClusterIPs: TCP 80 and UDP 81, both families.
pub fn web_frontends() -> Vec<(SocketAddr, L4)> {
    vec![
        (sock(ip(WEB_V4), 80), L4::Tcp),
        (sock(ip(WEB_V6), 80), L4::Tcp),
        (sock(ip(WEB_V4), 81), L4::Udp),
        (sock(ip(WEB_V6), 81), L4::Udp),
    ]
}

/// The client's egress now allows every web backend, and web-c (node-2)
/// takes ingress only from web pods; returns once both agents have it
/// (web-b, node-1's egress, answers directly; web-c, node-2's ingress, no
/// longer does).
pub fn deny_the_client_at_web_c(env: &Env) {
    let web_c_in = policy(
        "default",
        "web-c-in",
        "  podSelector: {matchLabels: {pod: web-c}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n",
    );
    env.write_policies(&format!(
        "{}{web_c_in}",
        client_policy(
            "    - to: [{podSelector: {matchLabels: {app: web}}}]\n      ports: [{protocol: TCP, port: http}, {protocol: UDP, port: 8082}]\n"
        )
    ));
    eventually("the new policies", Duration::from_secs(5), || {
        let direct = env.ask_all(
            CLIENT,
            &[
                (sock(env.ips("default/web-b")[0], 8080), L4::Tcp),
                (sock(env.ips("default/web-c")[0], 8081), L4::Tcp),
            ],
            1,
            Duration::from_millis(400),
        );
        match (&direct[0][0], &direct[1][0]) {
            (Reply::Answered { .. }, Reply::NoAnswer) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
}

/// Replies answered by a pod, by pod.
pub fn answered(replies: &[Reply]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in replies {
        if let Some(p) = r.pod() {
            *out.entry(p.to_owned()).or_insert(0) += 1;
        }
    }
    out
}

/// How many replies are `NoAnswer`.
pub fn unanswered(replies: &[Reply]) -> usize {
    replies.iter().filter(|r| **r == Reply::NoAnswer).count()
}
