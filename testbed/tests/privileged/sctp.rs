//! Real SCTP associations through both datapaths (elsewhere SCTP is only
//! crafted packets through BPF_PROG_TEST_RUN): a victim pod listens on two
//! SCTP ports, a policy (a NetworkPolicy, or an Admin ClusterNetworkPolicy)
//! admits one port from one pod, and what the listeners accepted and read
//! decides (judged at the receiver). Needs the
//! kernel's `sctp` module: the 6.1 test guest loads it; a kernel without
//! it skips with the reason printed. Needs root.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use policy_testbed::NetNs;
use policy_testbed::fixtures::{
    conformance::{Backend, Conformance, NsSpec, PodSpec, labels},
    deadline::scaled,
};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

const IPPROTO_SCTP: i32 = 132;
/// Admitted from the trusted pod.
const OPEN_PORT: u16 = 9002;
/// Listened on, admitted from nobody.
const CLOSED_PORT: u16 = 9003;

fn sctp() -> Protocol {
    Protocol::from(IPPROTO_SCTP)
}

/// Why SCTP sockets cannot be had here, if they cannot.
fn sctp_unavailable() -> Option<String> {
    Socket::new(Domain::IPV4, Type::STREAM, Some(sctp()))
        .err()
        .map(|e| format!("no SCTP sockets on this kernel ({e}); the 6.1 test guest runs this"))
}

fn pod(name: &str, i: u8) -> PodSpec {
    PodSpec::numbered("s", name, 7, i, vec![("assoc".into(), OPEN_PORT, "SCTP")])
}

/// What the victim's listeners accepted: (its port, the peer, the bytes).
type Accepted = Arc<Mutex<Vec<(u16, SocketAddr, Vec<u8>)>>>;

/// SCTP listeners (one-to-one style, dual-stack) on `ports` inside
/// `netns`, recording every association and what it sent, until dropped.
struct Listener {
    accepted: Accepted,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), policy_testbed::Error>>>,
}

impl Listener {
    fn start(netns: &NetNs, ports: &[u16]) -> Self {
        let accepted: Accepted = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (acc, halt, ports) = (accepted.clone(), stop.clone(), ports.to_vec());
        let thread = netns
            .spawn(move || {
                let sockets: Vec<(u16, Socket)> = ports
                    .iter()
                    .map(|port| {
                        let s = Socket::new(Domain::IPV6, Type::STREAM, Some(sctp())).unwrap();
                        s.set_only_v6(false).unwrap();
                        s.set_reuse_address(true).unwrap();
                        let any = SocketAddr::new("::".parse().unwrap(), *port);
                        s.bind(&SockAddr::from(any)).unwrap();
                        s.listen(16).unwrap();
                        s.set_nonblocking(true).unwrap();
                        (*port, s)
                    })
                    .collect();
                ready_tx.send(()).unwrap();
                while !halt.load(Ordering::Relaxed) {
                    for (port, s) in &sockets {
                        let Ok((conn, peer)) = s.accept() else {
                            continue;
                        };
                        let mut stream: std::net::TcpStream = {
                            // A one-to-one SCTP socket reads and writes as a
                            // stream socket does.
                            conn.set_nonblocking(false).unwrap();
                            conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                            conn.into()
                        };
                        let mut data = Vec::new();
                        let _ = stream.read_to_end(&mut data);
                        acc.lock()
                            .unwrap()
                            .push((*port, peer.as_socket().unwrap(), data));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
            .unwrap();
        ready_rx.recv().unwrap();
        Self {
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    fn accepted(&self) -> Vec<(u16, SocketAddr, Vec<u8>)> {
        self.accepted.lock().unwrap().clone()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// From inside `netns`: an association to `to`, `message` sent on it,
/// closed. Whether it was set up is not the verdict (the listener's record
/// is); the sender only waits `timeout` for it.
fn send(netns: &NetNs, to: SocketAddr, message: Vec<u8>, timeout: Duration) {
    netns
        .spawn(move || {
            let domain = if to.is_ipv6() {
                Domain::IPV6
            } else {
                Domain::IPV4
            };
            let s = Socket::new(domain, Type::STREAM, Some(sctp())).unwrap();
            if s.connect_timeout(&SockAddr::from(to), timeout).is_ok() {
                let mut stream: std::net::TcpStream = s.into();
                let _ = stream.write_all(&message);
            }
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
}

/// The NetworkPolicy: the victim admits the trusted pod on the open port.
fn network_policy() -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: victim, namespace: s}}\nspec:\n  podSelector: {{matchLabels: {{app: victim}}}}\n  ingress:\n    - from: [{{podSelector: {{matchLabels: {{app: trusted}}}}}}]\n      ports: [{{protocol: SCTP, port: {OPEN_PORT}}}]\n"
    )
}

/// The same verdicts from an Admin ClusterNetworkPolicy (upstream
/// CNPAdminTierIngressSCTP's shape: an Accept of one pod on one SCTP port,
/// then a Deny of every SCTP port from everyone).
fn cluster_policy() -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: sctp-guard}}\nspec:\n  tier: Admin\n  priority: 5\n  subject: {{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: victim}}}}}}}}\n  ingress:\n  - name: allow-trusted-sctp\n    action: Accept\n    from: [{{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: trusted}}}}}}}}]\n    protocols: [{{sctp: {{destinationPort: {{number: {OPEN_PORT}}}}}}}]\n  - name: deny-sctp\n    action: Deny\n    from: [{{namespaces: {{}}}}]\n    protocols: [{{sctp: {{}}}}]\n"
    )
}

fn sctp_traffic(prefix: &'static str, backend: Backend, policy: &str) {
    if let Some(why) = sctp_unavailable() {
        eprintln!("SKIPPED {prefix}: {why}");
        return;
    }
    let c = Conformance::with_cluster(
        prefix,
        backend,
        vec![NsSpec {
            name: "s".into(),
            labels: labels(&[("team", "s")]),
        }],
        vec![pod("victim", 21), pod("trusted", 22), pod("other", 23)],
    );
    c.write_policies(policy);
    c.apply_ok();
    let netns = |id: &str| NetNs::borrow(&c.node().pod(id).unwrap().netns.name);
    let listener = Listener::start(&netns("s/victim"), &[OPEN_PORT, CLOSED_PORT]);
    let mut expected = Vec::new();
    for v6 in [false, true] {
        let victim = c.pod_ip("s/victim", v6);
        for (from, port, admitted) in [
            ("s/trusted", OPEN_PORT, true),
            ("s/trusted", CLOSED_PORT, false),
            ("s/other", OPEN_PORT, false),
        ] {
            let message = format!("{from} to {port} v6={v6}").into_bytes();
            let timeout = scaled(Duration::from_secs(if admitted { 3 } else { 1 }));
            send(
                &netns(from),
                SocketAddr::new(victim, port),
                message.clone(),
                timeout,
            );
            if admitted {
                expected.push((port, c.pod_ip(from, v6), message));
            }
        }
    }
    // The admitted associations' data may still be in flight.
    let deadline = Instant::now() + scaled(Duration::from_secs(3));
    let got = loop {
        let got = listener.accepted();
        if got.len() >= expected.len() || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(listener);
    let seen: Vec<(u16, IpAddr, Vec<u8>)> = got
        .iter()
        .map(|(port, peer, data)| (*port, canonical(peer.ip()), data.clone()))
        .collect();
    for e in &expected {
        assert!(
            seen.contains(e),
            "{backend:?}: the admitted association {} -> port {} did not deliver {:?}; the listeners saw {seen:?}",
            e.1,
            e.0,
            String::from_utf8_lossy(&e.2)
        );
    }
    assert_eq!(
        seen.len(),
        expected.len(),
        "{backend:?}: only the admitted associations may reach the victim; it saw {seen:?}"
    );
}

/// A dual-stack listener sees IPv4 peers as mapped IPv6 addresses.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[test]
fn sctp_associations_through_the_bpf_datapath() {
    sctp_traffic("sctpb", Backend::Bpf, &network_policy());
}

#[test]
fn sctp_associations_through_the_iptables_datapath() {
    sctp_traffic("sctpi", Backend::Iptables, &network_policy());
}

#[test]
fn sctp_under_a_cluster_network_policy_through_the_bpf_datapath() {
    sctp_traffic("sctpcb", Backend::Bpf, &cluster_policy());
}

#[test]
fn sctp_under_a_cluster_network_policy_through_the_iptables_datapath() {
    sctp_traffic("sctpci", Backend::Iptables, &cluster_policy());
}
