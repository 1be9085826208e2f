//! `nodes` peers (experimental EgressNodePeers): the upstream tests
//! CNPAdminTierEgressNodePeers and CNPBaselineTierEgressNodePeers on the
//! simulated node, on both datapaths. Upstream's host-network server
//! (centaur-1, on some node) is a server in this node's own namespace on
//! its addresses, ports 9000-9004 standing for `HostNetworkPorts[0..4]`;
//! gryffindor is namespace beta. Judged at the server (what arrived), and
//! the whole pod matrix beside it, the node's own probes to the pods
//! included: the pods' answers to the node must pass although their
//! egress to the node is denied.
use std::{
    collections::BTreeSet,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use policy_testbed::{
    NODE_V4, NODE_V6, NetNs,
    fixtures::conformance::{Backend, Conformance, NODE, ns_of},
};

use super::always;

const TCP_PORTS: [u16; 2] = [9000, 9001];
const UDP_PORTS: [u16; 2] = [9002, 9004];

/// This node as a Node object: the labels upstream selects on and its
/// addresses.
fn node_object() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels: {{kubernetes.io/os: linux}}\nstatus:\n  addresses:\n  - {{type: InternalIP, address: \"{NODE_V4}\"}}\n  - {{type: InternalIP, address: \"{NODE_V6}\"}}\n  - {{type: Hostname, address: {NODE}}}\n"
    )
}

/// What arrived at the node's servers: (client address, port, transport).
type Arrived = Arc<Mutex<BTreeSet<(IpAddr, u16, &'static str)>>>;

/// Host-network servers in the node namespace, stopped on drop.
struct NodeServers {
    arrived: Arrived,
    stop: Arc<AtomicBool>,
}

impl NodeServers {
    fn start(node: &NetNs) -> Self {
        let arrived = Arrived::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (arrived.clone(), stop.clone());
        node.spawn(move || {
            let mut tcp = Vec::new();
            let mut udp = Vec::new();
            for ip in [IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)] {
                for port in TCP_PORTS {
                    let l = TcpListener::bind(SocketAddr::new(ip, port)).unwrap();
                    l.set_nonblocking(true).unwrap();
                    tcp.push((l, port));
                }
                for port in UDP_PORTS {
                    let u = UdpSocket::bind(SocketAddr::new(ip, port)).unwrap();
                    u.set_nonblocking(true).unwrap();
                    udp.push((u, port));
                }
            }
            // Bounded: the test ends well within this.
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while !s.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                for (l, port) in &tcp {
                    if let Ok((mut c, from)) = l.accept() {
                        let _ = c.write_all(b"ok");
                        a.lock().unwrap().insert((from.ip(), *port, "tcp"));
                    }
                }
                for (u, port) in &udp {
                    let mut buf = [0u8; 64];
                    if let Ok((_, from)) = u.recv_from(&mut buf) {
                        a.lock().unwrap().insert((from.ip(), *port, "udp"));
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
        .unwrap();
        Self { arrived, stop }
    }

    fn clear(&self) {
        self.arrived.lock().unwrap().clear();
    }

    fn reached(&self, from: IpAddr, port: u16, transport: &'static str) -> bool {
        self.arrived
            .lock()
            .unwrap()
            .contains(&(from, port, transport))
    }
}

impl Drop for NodeServers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Sends one TCP connection and one datagram per port from `pod` to the
/// node's address of each family.
fn poke_node(pod: &NetNs) {
    pod.spawn(|| {
        for ip in [IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)] {
            for port in TCP_PORTS {
                let to = SocketAddr::new(ip, port);
                if let Ok(mut s) = TcpStream::connect_timeout(&to, Duration::from_millis(500)) {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut buf = [0u8; 2];
                    let _ = s.read(&mut buf);
                }
            }
            for port in UDP_PORTS {
                let bind = if ip.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
                if let Ok(u) = UdpSocket::bind(bind) {
                    for _ in 0..3 {
                        let _ = u.send_to(b"probe", SocketAddr::new(ip, port));
                    }
                }
            }
        }
    })
    .unwrap()
    .join()
    .unwrap()
    .unwrap();
    // Datagrams in flight land before the servers are read.
    std::thread::sleep(Duration::from_millis(200));
}

/// Checks what each of `clients` reached on the node: `open(port,
/// transport)` says what must arrive from a subject pod (beta); a pod of
/// another namespace reaches every port.
fn check_node(c: &Conformance, servers: &NodeServers, open: impl Fn(u16, &str) -> bool) {
    servers.clear();
    let clients = ["beta/web", "beta/api", "alpha/web"];
    for id in clients {
        poke_node(&c.node().pod(id).unwrap().netns);
    }
    let mut wrong = Vec::new();
    for id in clients {
        for v6 in [false, true] {
            let from = c.pod_ip(id, v6);
            let ports = TCP_PORTS
                .iter()
                .map(|p| (*p, "tcp"))
                .chain(UDP_PORTS.iter().map(|p| (*p, "udp")));
            for (port, transport) in ports {
                let want = ns_of(id) != "beta" || open(port, transport);
                if servers.reached(from, port, transport) != want {
                    wrong.push(format!(
                        "{id} ({from}) -> node {transport}/{port}: want {}",
                        if want { "open" } else { "closed" }
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "to the node:\n{}", wrong.join("\n"));
}

const ADMIN: &str = "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: node-and-cidr-as-peers-example}\nspec:\n  tier: Admin\n  priority: 75\n  subject:\n    pods: {namespaceSelector: {matchLabels: {team: b}}, podSelector: {}}\n  egress:\n  - name: allow-egress-to-9000-on-nodes\n    action: Accept\n    to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}]\n    protocols: [{tcp: {destinationPort: {number: 9000}}}]\n  - name: pass-egress-to-9002-on-nodes\n    action: Pass\n    to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}]\n    protocols: [{udp: {destinationPort: {number: 9002}}}]\n  - name: deny-egress-to-slytherin-and-nodes-and-internet\n    action: Deny\n    to:\n    - pods: {namespaceSelector: {matchLabels: {team: c}}, podSelector: {}}\n    - nodes: {matchLabels: {kubernetes.io/os: linux}}\n    - networks: [0.0.0.0/0, \"::/0\"]\n";

const BASELINE: &str = "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: default}\nspec:\n  tier: Baseline\n  priority: 10\n  subject:\n    namespaces: {matchLabels: {kubernetes.io/metadata.name: beta}}\n  egress:\n  - name: allow-egress-to-9000-9001-on-nodes\n    action: Accept\n    to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}]\n    protocols: [{tcp: {destinationPort: {range: {start: 9000, end: 9001}}}}]\n  - name: deny-egress-to-nodes-and-internet\n    action: Deny\n    to:\n    - nodes: {matchLabels: {kubernetes.io/os: linux}}\n    - networks: [0.0.0.0/0, \"::/0\"]\n";

/// CNPAdminTierEgressNodePeers: "allow-egress" at port 0 (Accept), Pass
/// at port 2 (nothing below decides: allowed), "deny-egress" at ports 1
/// and 4 (the Deny of nodes); the Deny of every network closes beta's
/// egress to every pod too.
fn admin_tier_egress_node_peers(prefix: &'static str, backend: Backend) {
    let c = crate::flow_audit::audited(prefix, backend);
    let servers = NodeServers::start(&c.node().node);
    c.write_policies(&format!("{}---\n{ADMIN}", node_object()));
    c.apply_ok();
    check_node(&c, &servers, |port, transport| {
        (transport, port) == ("tcp", 9000) || (transport, port) == ("udp", 9002)
    });
    c.check("node peers: beta's egress denied", |f, t, _, _| {
        always(f, t) || ns_of(f) != "beta"
    });
    if backend == Backend::Bpf {
        // `dump` shows each tier slot decoded: the Accept of TCP 9000 is
        // rule 0 of the policy of priority 75, held by no NetworkPolicy.
        let dump = c.dump();
        let accept = dump["policy"].as_array().unwrap().iter().any(|row| {
            row["ports"] == "9000"
                && row["network_policy"] == false
                && row["admin"]["action"] == "Accept"
                && row["admin"]["priority"] == 75
                && row["admin"]["rule"] == 0
        });
        assert!(accept, "{:#}", dump["policy"]);
    }
    // A Node that no longer carries the label is no peer: its ports stay
    // closed by the Deny of every network, the Accept no longer applies.
    c.write_policies(&format!(
        "{}---\n{ADMIN}",
        node_object().replace("kubernetes.io/os: linux", "kubernetes.io/os: windows")
    ));
    c.apply_ok();
    check_node(&c, &servers, |_, _| false);
}

/// CNPBaselineTierEgressNodePeers: the TCP range 0-1 accepted, port 4
/// denied; the Deny of every network closes beta's egress to every pod.
fn baseline_tier_egress_node_peers(prefix: &'static str, backend: Backend) {
    let c = crate::flow_audit::audited(prefix, backend);
    let servers = NodeServers::start(&c.node().node);
    c.write_policies(&format!("{}---\n{BASELINE}", node_object()));
    c.apply_ok();
    check_node(&c, &servers, |_, transport| transport == "tcp");
    c.check("node peers: beta's egress denied", |f, t, _, _| {
        always(f, t) || ns_of(f) != "beta"
    });
}

#[test]
fn cnp_admin_tier_egress_node_peers_bpf() {
    admin_tier_egress_node_peers("cnpnode", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_egress_node_peers_iptables() {
    admin_tier_egress_node_peers("cnpnodei", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_egress_node_peers_bpf() {
    baseline_tier_egress_node_peers("cnpnodeb", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_egress_node_peers_iptables() {
    baseline_tier_egress_node_peers("cnpnodebi", Backend::Iptables);
}
