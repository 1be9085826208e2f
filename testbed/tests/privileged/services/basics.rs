//! Services with the agents, on real traffic: a two-node simulated
//! cluster, `policy-agent run` on each node (BPF or iptables datapath),
//! kube-proxy's rules on each node (the stand-in, iptables or nftables
//! mode), and every verdict judged where it lands: who answered each
//! connection, and what each backend's server saw. The same case runs on
//! both datapaths and must give the same verdicts. Needs root; run with
//! `cargo test -p policy-testbed --test privileged -- services::basics`.
//! (`services::changes`: endpoints and policies changing under traffic.)

use std::{net::SocketAddr, time::Duration};

use policy_testbed::fixtures::{conformance::Backend, services::*};
use policy_testbed::tunnel::{TunnelKind, kernel_has_gre};
use policy_testbed::{
    backend::{L4, Reply},
    dns::{RecordType, Resolution, resolve},
    kube_proxy::ProxyMode,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// Connections (datagrams) per address and protocol.
const N: usize = 40;

/// Many connections to web's frontends: each answered only by an
/// `allowed` backend, and about as many unanswered as `denied` backends'
/// share (within five standard deviations); at the servers, the denied
/// backends saw nothing from the client and each allowed one exactly the
/// connections it answered.
fn spread(env: &Env, what: &str, allowed: &[&str], denied: &[&str]) {
    env.backends.clear();
    let frontends = web_frontends();
    let results = env.ask_all(CLIENT, &frontends, N, TIMEOUT);
    let client = env.ips(CLIENT);
    let share = denied.len() as f64 / (allowed.len() + denied.len()) as f64;
    // A TCP connection can get two picks within TIMEOUT: where the SYN
    // is dropped before conntrack confirms its entry (iptables, in
    // FORWARD), the retransmission a second later is DNATed afresh. So
    // as few as share² of them may go unanswered, as many as share.
    let bound = |p: f64| (N as f64 * p, (N as f64 * p * (1.0 - p)).sqrt());
    let (fewest, fewest_sd) = bound(share * share);
    let (mean, sd) = bound(share);
    let mut answered_by: std::collections::BTreeMap<(String, L4), usize> = Default::default();
    for ((to, l4), replies) in frontends.iter().zip(&results) {
        let by = answered(replies);
        let lost = unanswered(replies);
        let context = format!(
            "{what} ({}, {}): {l4:?} {to}: answered {by:?}, unanswered {lost} of {N}",
            env.datapath.flag(),
            env.mode
        );
        eprintln!("{context}");
        for r in replies {
            match r {
                Reply::Answered { pod, seen_from } => {
                    assert!(allowed.contains(&pod.as_str()), "{context}: {pod} answered");
                    assert!(
                        client.contains(&seen_from.ip()),
                        "{context}: {pod} saw {seen_from}, not the client"
                    );
                    *answered_by.entry((pod.clone(), *l4)).or_default() += 1;
                }
                Reply::Refused => panic!("{context}: refused"),
                Reply::NoAnswer => {}
            }
        }
        for a in allowed {
            assert!(
                by.get(*a).copied().unwrap_or(0) > 0,
                "{context}: {a} never answered"
            );
        }
        let low = (fewest - 5.0 * fewest_sd).max(if denied.is_empty() { 0.0 } else { 1.0 });
        let high = (mean + 5.0 * sd).min(if denied.is_empty() {
            0.0
        } else {
            N as f64 - 1.0
        });
        assert!(
            (low..=high).contains(&(lost as f64)),
            "{context}: expected {low:.0}..={high:.0} unanswered"
        );
    }
    for d in denied {
        let seen = env.served(d, CLIENT);
        assert!(
            seen.is_empty(),
            "{what}: denied backend {d} received {seen:?}"
        );
    }
    for a in allowed {
        for l4 in [L4::Tcp, L4::Udp] {
            let seen = env.served(a, CLIENT).iter().filter(|s| s.l4 == l4).count();
            let answered = answered_by.get(&(a.to_string(), l4)).copied().unwrap_or(0);
            assert_eq!(
                seen, answered,
                "{what}: {a} served {seen} {l4:?} but answered {answered}"
            );
        }
    }
}

/// (a) An egress policy allowing some of a Service's backends (one local,
/// one remote allowed; one local, one remote denied; the named target
/// port resolved per pod), then an ingress policy at one backend denying
/// the client.
fn some_backends(prefix: &'static str, datapath: Backend, mode: ProxyMode) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, mode, namespaces, m);
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {tier: ok}}}]\n      ports: [{protocol: TCP, port: http}, {protocol: UDP, port: 8082}]\n",
    ));
    env.start_agents();
    spread(
        &env,
        "egress to tier=ok",
        &["default/web-a", "default/web-c"],
        &["default/web-b", "default/web-d"],
    );

    deny_the_client_at_web_c(&env);
    spread(
        &env,
        "ingress at web-c denies the client",
        &["default/web-a", "default/web-b", "default/web-d"],
        &["default/web-c"],
    );
}

/// (a) over a pod network routed through an L3 tunnel between the nodes
/// (GRE where the kernel has it, a tun pair elsewhere): the remote
/// backends are reached by a device without a link-layer header, where
/// the client's egress is judged after DNAT as on an Ethernet uplink.
fn some_backends_over_a_tunnel(prefix: &'static str, datapath: Backend) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, ProxyMode::Iptables, namespaces, m);
    let kind = if kernel_has_gre() {
        TunnelKind::Gre
    } else {
        TunnelKind::Tun
    };
    env.tunnel(kind);
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {tier: ok}}}]\n      ports: [{protocol: TCP, port: http}, {protocol: UDP, port: 8082}]\n",
    ));
    env.start_agents();
    // web-c answering proves the tunnel carries the remote backends'
    // traffic; web-d (remote, denied) must never be reached through it.
    spread(
        &env,
        &format!("egress to tier=ok over a {kind:?} tunnel"),
        &["default/web-a", "default/web-c"],
        &["default/web-b", "default/web-d"],
    );
}

/// (b) Deny-all egress in a namespace but DNS to kube-dns: names resolve
/// through the kube-dns ClusterIP over UDP and TCP (both families, both
/// replicas on both nodes), and nothing else is reached: not another
/// Service, not a pod directly, not the other node's pods.
fn dns_only(prefix: &'static str, datapath: Backend, mode: ProxyMode) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, mode, namespaces, m);
    env.write_policies(&policy(
        "default",
        "dns-only",
        "  podSelector: {}\n  policyTypes: [Egress]\n  egress:\n    - to: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: kube-system}}, podSelector: {matchLabels: {k8s-app: kube-dns}}}]\n      ports: [{protocol: UDP, port: 53}, {protocol: TCP, port: 53}]\n",
    ));
    env.start_agents();
    let netns = env.netns(CLIENT);
    for server in [ip(DNS_V4), ip(DNS_V6)] {
        for l4 in [L4::Udp, L4::Tcp] {
            for (kind, want) in [(RecordType::A, WEB_V4), (RecordType::Aaaa, WEB_V6)] {
                // Several queries: kube-proxy spreads them over both replicas.
                for _ in 0..4 {
                    let got = resolve(netns, sock(server, 53), WEB_NAME, kind, l4, scaled(TIMEOUT))
                        .unwrap();
                    assert_eq!(
                        got,
                        Resolution::Addresses(vec![ip(want)]),
                        "{} {mode}: {kind:?} over {l4:?} via {server}",
                        datapath.flag()
                    );
                }
            }
            let got = resolve(
                netns,
                sock(server, 53),
                "nope.default.svc.cluster.local",
                RecordType::A,
                l4,
                scaled(TIMEOUT),
            )
            .unwrap();
            assert_eq!(
                got,
                Resolution::NxDomain,
                "{} {mode}: via {server} {l4:?}",
                datapath.flag()
            );
        }
    }
    let mut elsewhere = web_frontends();
    elsewhere.extend([
        (sock(ip(SOLO_V4), 80), L4::Tcp),
        (sock(ip(SOLO2_V6), 80), L4::Udp),
        (sock(ip(WEB_V4), ECHO_SVC_PORT), L4::Tcp),
        (sock(ip(DNS_V4), ECHO_SVC_PORT), L4::Tcp),
        (
            sock(env.cluster().nodes[0].ips()[0], WEB_NODE_PORT),
            L4::Tcp,
        ),
        (sock(env.ips("default/web-a")[0], 8080), L4::Tcp),
        (sock(env.ips("default/web-c")[1], 8081), L4::Tcp),
        (sock(env.ips("default/solo-d")[0], 9090), L4::Udp),
        (sock(env.ips("default/solo-b")[1], 9090), L4::Udp),
    ]);
    let results = env.ask_all(CLIENT, &elsewhere, 3, Duration::from_secs(1));
    for ((to, l4), replies) in elsewhere.iter().zip(&results) {
        assert!(
            replies.iter().all(|r| *r == Reply::NoAnswer),
            "{} {mode}: {l4:?} {to} with DNS only: {replies:?}",
            datapath.flag()
        );
    }
    let served = env.backends.served();
    assert!(served.is_empty(), "reached with DNS only: {served:?}");
}

/// (c) A NodePort from a pod: the client's own node's address (kube-proxy
/// translates it there, masqueraded) and the other node's (translated on
/// that node; on the client's it is just an address).
fn node_port(prefix: &'static str, datapath: Backend, mode: ProxyMode) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, mode, namespaces, m);
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {app: nobody}}}]\n",
    ));
    env.start_agents();
    let node_ips: Vec<Vec<std::net::IpAddr>> =
        env.cluster().nodes.iter().map(|n| n.ips()).collect();
    let frontends: Vec<(SocketAddr, L4)> = node_ips
        .iter()
        .flatten()
        .map(|ip| (sock(*ip, WEB_NODE_PORT), L4::Tcp))
        .collect();
    let what = format!("{} {mode}", datapath.flag());
    // Denied: nothing reaches any backend.
    let results = env.ask_all(CLIENT, &frontends, 10, Duration::from_millis(1500));
    for ((to, _), replies) in frontends.iter().zip(&results) {
        assert!(
            replies.iter().all(|r| *r == Reply::NoAnswer),
            "{what}: NodePort {to} with web denied: {replies:?}"
        );
    }
    let served = env.backends.served();
    assert!(
        served.is_empty(),
        "{what}: reached through a NodePort: {served:?}"
    );

    // The backends allowed: the own node's NodePort works; the other
    // node's address is no frontend here and not allowed.
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {app: web}}}]\n      ports: [{protocol: TCP, port: http}]\n",
    ));
    let own = frontends[0].0;
    eventually("web allowed", Duration::from_secs(5), || {
        let r = env.ask(CLIENT, own, L4::Tcp, 1, Duration::from_millis(500));
        r[0].pod().map(|_| ()).ok_or(format!("{r:?}"))
    });
    env.backends.clear();
    let results = env.ask_all(CLIENT, &frontends, 10, Duration::from_millis(1500));
    for ((to, _), replies) in frontends.iter().zip(&results) {
        let own_node = node_ips[0].contains(&to.ip());
        for r in replies {
            match r {
                Reply::Answered { pod, seen_from } if own_node => {
                    assert!(pod.starts_with("default/web-"), "{what}: {to}: {r:?}");
                    assert_eq!(
                        seen_from.ip(),
                        to.ip(),
                        "{what}: {to} is masqueraded: {r:?}"
                    );
                }
                Reply::NoAnswer if !own_node => {}
                _ => panic!("{what}: NodePort {to}: {replies:?}"),
            }
        }
    }
    let remote: Vec<_> = env
        .backends
        .served()
        .into_iter()
        .filter(|s| node_ips[1].contains(&s.peer.ip()))
        .collect();
    assert!(
        remote.is_empty(),
        "{what}: through node-2's NodePort: {remote:?}"
    );

    // An ipBlock allows node-2's address: its NodePort works too.
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {app: web}}}]\n      ports: [{protocol: TCP, port: http}]\n    - to: [{ipBlock: {cidr: 192.168.200.2/32}}, {ipBlock: {cidr: \"fd00:ffff::2/128\"}}]\n      ports: [{protocol: TCP, port: 30080}]\n",
    ));
    let other = frontends[2].0;
    eventually("node-2 allowed", Duration::from_secs(5), || {
        let r = env.ask(CLIENT, other, L4::Tcp, 1, Duration::from_millis(500));
        r[0].pod().map(|_| ()).ok_or(format!("{r:?}"))
    });
    let results = env.ask_all(CLIENT, &frontends, 10, Duration::from_millis(1500));
    for ((to, _), replies) in frontends.iter().zip(&results) {
        assert!(
            replies
                .iter()
                .all(|r| r.pod().is_some_and(|p| p.starts_with("default/web-"))),
            "{what}: NodePort {to} allowed: {replies:?}"
        );
    }
}

macro_rules! suite {
    ($module:ident, $datapath:expr, $mode:expr, $p:literal) => {
        mod $module {
            use super::*;

            #[test]
            fn egress_to_a_service_is_judged_per_backend() {
                some_backends(concat!("sva", $p), $datapath, $mode);
            }

            #[test]
            fn dns_through_the_cluster_ip_and_nothing_else() {
                dns_only(concat!("svb", $p), $datapath, $mode);
            }

            #[test]
            fn node_port_from_a_pod() {
                node_port(concat!("svc", $p), $datapath, $mode);
            }
        }
    };
}

suite!(bpf, Backend::Bpf, ProxyMode::Iptables, "bi");
suite!(iptables, Backend::Iptables, ProxyMode::Iptables, "ii");

/// The pod network over an L3 tunnel: both datapaths.
mod tunnel {
    use super::*;

    #[test]
    fn bpf_egress_to_a_service_over_a_tunnel_is_judged_per_backend() {
        some_backends_over_a_tunnel("svtb", Backend::Bpf);
    }

    #[test]
    fn iptables_egress_to_a_service_over_a_tunnel_is_judged_per_backend() {
        some_backends_over_a_tunnel("svti", Backend::Iptables);
    }
}

/// kube-proxy in nftables mode: the key case on both datapaths.
mod nftables_mode {
    use super::*;

    #[test]
    fn bpf_egress_to_a_service_is_judged_per_backend() {
        some_backends("svabn", Backend::Bpf, ProxyMode::Nftables);
    }

    #[test]
    fn iptables_egress_to_a_service_is_judged_per_backend() {
        some_backends("svain", Backend::Iptables, ProxyMode::Nftables);
    }
}
