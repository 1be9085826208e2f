//! The conformance suite's ClusterIP pass: every pod gets a ClusterIP
//! Service of its own (IPv4 and IPv6 ClusterIPs, one port per container
//! port, same numbers) and the EndpointSlices the EndpointSlice controller
//! would write, appended to the manifests the agent reads; kube-proxy's
//! rules for them (the `sim::kube_proxy` stand-in, iptables or nftables
//! mode) are installed in the node namespace from the same manifests.
//! The matrix is then probed a second time through the ClusterIPs and
//! judged where it lands, the pod's own address, against the very same
//! expectation as the pod-IP pass.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use policy_agent::{
    cluster::ClusterState,
    sim::{
        CLUSTER_CIDR_V4, CLUSTER_CIDR_V6, Cell, NODE_ROW, NODE_V4, NODE_V6, NetNs, Outcome, Probe,
        SERVICE_CIDR_V4, SERVICE_CIDR_V6, Transport,
        kube_proxy::{KubeProxy, ProxyConfig, ProxyMode},
        manifests::{Manifests, PodManifest, ServiceManifest, TargetPort},
        run_probes,
    },
};
use policy_common::proto;

use super::{
    conformance::{Conformance, NODE, PROBE_TIMEOUT, PodSpec},
    deadline::scaled,
};

/// The agent's `--service-cidr` arguments (the sim's Service ranges).
pub const SERVICE_CIDR_ARGS: [&str; 4] = [
    "--service-cidr",
    SERVICE_CIDR_V4,
    "--service-cidr",
    SERVICE_CIDR_V6,
];

/// The ClusterIP of the Service of the pod holding `ip`: 10.244.a.b →
/// 10.96.a.b, fd00:244:a::b → fd00:96::a0b (a and b below 256, as every
/// conformance pod's are), both inside the sim's Service ranges.
pub fn cluster_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let [_, _, x, y] = a.octets();
            IpAddr::V4(Ipv4Addr::new(10, 96, x, y))
        }
        IpAddr::V6(a) => {
            let s = a.segments();
            let low = (s[2] << 8) | (s[7] & 0xff);
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, low))
        }
    }
}

/// Cells the ClusterIP pass leaves out, and why:
/// * the node's row: kube-proxy masquerades node-sourced traffic to a
///   ClusterIP with a random source port (`--random-fully`), so the
///   receiver cannot tell which request was the probe's; and node
///   traffic is always allowed, so there is no policy verdict to compare;
/// * a pod to its own Service (hairpin): kube-proxy masquerades it to a
///   node address (KUBE-SEP's `-s <endpoint> -j KUBE-MARK-MASQ`), so what
///   arrives is node traffic, not the pod's; upstream documents hairpin
///   NetworkPolicy behaviour as implementation-defined, and the pod-IP
///   run's "a pod reaches itself" never leaves the pod.
///
/// ICMP is not probed at all (the pass runs without the ping column): a
/// ClusterIP answers no echo, kube-proxy only DNATs TCP, UDP and SCTP.
pub fn skipped((from, target, _): &Cell) -> bool {
    from == NODE_ROW || *from == target.pod || target.transport == Transport::Ping
}

fn protocol(p: &str) -> u8 {
    match p {
        "UDP" => proto::UDP,
        _ => proto::TCP,
    }
}

/// The pod as the Service manifests see it (on the conformance node).
fn pod_manifest(p: &PodSpec) -> PodManifest {
    let mut m = PodManifest::new(&p.namespace, &p.name, NODE, &p.ips);
    for (k, v) in &p.labels {
        m = m.label(k, v);
    }
    for (name, port, proto) in &p.ports {
        m = m.port(name, protocol(proto), *port);
    }
    m
}

/// Each pod's Service: `<ns>/<pod name>`, selecting `app: <pod name>`,
/// a port per container port with its name and number. TCP ports and
/// `dns` target the container port by name (in gamma "http" is 8080 and
/// "admin" 80, so the name resolves per pod), the others by number.
pub fn manifests(pods: &[PodSpec]) -> Manifests {
    let services = pods
        .iter()
        .map(|p| {
            let ips: Vec<IpAddr> = p.ips.iter().map(|ip| cluster_ip(*ip)).collect();
            let mut s = ServiceManifest::new(&p.namespace, &p.name, &ips).select("app", &p.name);
            for (name, port, proto) in &p.ports {
                let target = if *proto == "TCP" || name == "dns" {
                    TargetPort::Name(name.clone())
                } else {
                    TargetPort::Number(*port)
                };
                s = s.port(name, protocol(proto), *port, target);
            }
            s
        })
        .collect();
    Manifests {
        pods: pods.iter().map(pod_manifest).collect(),
        services,
    }
}

/// The Services and EndpointSlices as YAML documents (the Pods are
/// written by the conformance harness itself).
pub fn yaml(m: &Manifests) -> String {
    let mut out = String::new();
    for s in &m.services {
        out += "---\n";
        out += &serde_yaml::to_string(&s.to_service()).unwrap();
    }
    for s in m.slices() {
        out += "---\n";
        out += &serde_yaml::to_string(&s).unwrap();
    }
    out
}

/// The model kube-proxy reads: the manifests as written, read back.
pub fn state(m: &Manifests) -> ClusterState {
    m.cluster_state("", &[]).unwrap()
}

/// kube-proxy's configuration on the conformance node.
pub fn proxy_config() -> ProxyConfig {
    let net = |s: &str| s.parse().unwrap();
    ProxyConfig {
        node_name: NODE.into(),
        node_ips: vec![IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)],
        cluster_cidrs: vec![net(CLUSTER_CIDR_V4), net(CLUSTER_CIDR_V6)],
        service_cidrs: vec![net(SERVICE_CIDR_V4), net(SERVICE_CIDR_V6)],
    }
}

/// kube-proxy in the node namespace, following the pods it was given.
pub struct ServiceRun {
    pub mode: ProxyMode,
    pub proxy: KubeProxy,
}

impl ServiceRun {
    pub fn install(node: &NetNs, mode: ProxyMode, pods: &[PodSpec]) -> Self {
        let proxy = KubeProxy::install(node, mode, proxy_config(), &state(&manifests(pods)))
            .expect("install the kube-proxy stand-in");
        Self { mode, proxy }
    }

    /// Syncs to changed pods (as kube-proxy follows the API server).
    pub fn update(&mut self, pods: &[PodSpec]) {
        self.proxy.update(&state(&manifests(pods))).unwrap();
    }
}

/// The ClusterIP pass's target: the column's pod through its Service.
pub fn via_address(_pod: &str, ip: IpAddr) -> Option<IpAddr> {
    Some(cluster_ip(ip))
}

/// One pod's connection to its own ClusterIP.
#[derive(Debug)]
pub struct Hairpin {
    pub pod: String,
    pub v6: bool,
    /// What the pod saw.
    pub outcome: Outcome,
    /// The sources its connection request arrived from at the pod's own
    /// address.
    pub from: Vec<SocketAddr>,
    /// The node's addresses.
    pub node: [IpAddr; 2],
}

/// Each pod to its own ClusterIP on TCP 80, both families, one at a time:
/// what it saw and where its request came from at the pod (by capture).
pub fn hairpin(c: &Conformance) -> Vec<Hairpin> {
    let servers = c.servers.as_ref().unwrap();
    let mut out = Vec::new();
    for p in &c.node().pods {
        for ip in &p.pod.ips {
            // What arrived before is no part of it.
            servers.arrivals().unwrap();
            let probe = Probe {
                to: SocketAddr::new(cluster_ip(*ip), 80),
                transport: Transport::Tcp,
            };
            let timeout = scaled(PROBE_TIMEOUT);
            let sent = p
                .netns
                .spawn(move || run_probes(&[probe], timeout))
                .unwrap()
                .join()
                .unwrap()
                .unwrap()
                .unwrap();
            let at = SocketAddr::new(*ip, 80);
            let from = servers
                .arrivals()
                .unwrap()
                .all
                .iter()
                .filter(|a| a.to == at && a.syn)
                .map(|a| a.from)
                .collect();
            out.push(Hairpin {
                pod: p.pod.id(),
                v6: ip.is_ipv6(),
                outcome: sent[0].outcome,
                from,
                node: [IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)],
            });
        }
    }
    out
}
