//! Services through kube-proxy's IPVS mode, with the agents, on real
//! traffic: the two-node cluster of `services::basics`, but every Service
//! address on each node's `kube-ipvs0` dummy device (local addresses)
//! and IPVS virtual servers forwarding by NAT to the backends. The client's
//! packets to a ClusterIP are delivered to the node (INPUT), where IPVS
//! picks the backend and sends them out (OUTPUT): they never cross
//! FORWARD. Judged where they land: who answered, what each backend saw
//! (forged sources included).
//!
//! Needs the `ip_vs` module: on a kernel without it (the 6.18 host) every
//! test prints a SKIPPED line and passes; `cargo xtask test` runs them in
//! the 6.1 guest, where a skip fails the suite. Needs root; run with
//! `cargo test -p policy-testbed --test privileged -- services::ipvs`.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use policy_testbed::fixtures::{conformance::Backend, raw::send_raw, services::*};
use policy_testbed::{
    NetNs,
    backend::{L4, Reply},
    kube_proxy::{ProxyMode, ipvs_missing},
    packet::Packet,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// Connections (datagrams) per address and protocol.
/// 3 per backend: IPVS's round robin spreads them evenly.
const N: usize = 12;
/// More rounds for a frontend where an allowed backend never answered.
const RETRIES: usize = 2;

/// Whether the kernel has IPVS; if not, says why and the test passes.
fn ipvs_or_skip(test: &str) -> bool {
    match ipvs_missing() {
        Some(why) => {
            println!("SKIPPED {test}: {why}; `cargo xtask test` runs it in the 6.1 guest");
            false
        }
        None => true,
    }
}

/// The node's IPVS table and its dummy device's addresses (failure
/// messages).
fn ipvs_state(env: &Env) -> String {
    let node = &env.cluster().nodes[0].sim.node;
    format!(
        "{}\n{}",
        node.exec("ipvsadm", &["-Ln"])
            .unwrap_or_else(|e| e.to_string()),
        node.ip(&["addr", "show", "dev", "kube-ipvs0"])
            .unwrap_or_else(|e| e.to_string())
    )
}

/// `N` connections to each of web's frontends: answered only by
/// `allowed` backends (every one of them at least once, round robin), the
/// `denied` ones never reached.
fn spread(env: &Env, what: &str, allowed: &[&str], denied: &[&str]) {
    env.backends.clear();
    let frontends = web_frontends();
    let mut results = env.ask_all(CLIENT, &frontends, N, TIMEOUT);
    // A frontend where an allowed backend never answered is asked again:
    // a reply lost on a loaded machine (an IPv6 neighbour resolution
    // timing out under emulation) is not a verdict. Every round counts
    // against the denied backends.
    for _ in 0..RETRIES {
        let short: Vec<usize> = (0..frontends.len())
            .filter(|i| {
                let by = answered(&results[*i]);
                allowed.iter().any(|a| !by.contains_key(*a))
            })
            .collect();
        if short.is_empty() {
            break;
        }
        let again: Vec<(SocketAddr, L4)> = short.iter().map(|i| frontends[*i]).collect();
        for (i, more) in short.iter().zip(env.ask_all(CLIENT, &again, N, TIMEOUT)) {
            results[*i].extend(more);
        }
    }
    let client = env.ips(CLIENT);
    for ((to, l4), replies) in frontends.iter().zip(&results) {
        let by = answered(replies);
        let context = format!(
            "{what} ({}, ipvs): {l4:?} {to}: answered {by:?}, unanswered {} of {}",
            env.datapath.flag(),
            unanswered(replies),
            replies.len()
        );
        eprintln!("{context}");
        for r in replies {
            match r {
                Reply::Answered { pod, seen_from } => {
                    assert!(
                        allowed.contains(&pod.as_str()),
                        "{context}: {pod} answered\n{}",
                        ipvs_state(env)
                    );
                    assert!(client.contains(&seen_from.ip()), "{context}: {r:?}");
                }
                Reply::Refused => panic!("{context}: refused\n{}", ipvs_state(env)),
                Reply::NoAnswer => {}
            }
        }
        for a in allowed {
            assert!(
                by.get(*a).copied().unwrap_or(0) > 0,
                "{context}: {a} never answered\n{}",
                ipvs_state(env)
            );
        }
        if !denied.is_empty() {
            assert!(unanswered(replies) > 0, "{context}: nothing was denied");
        }
    }
    for d in denied {
        let seen = env.served(d, CLIENT);
        assert!(
            seen.is_empty(),
            "{what}: denied backend {d} received {seen:?}\n{}",
            ipvs_state(env)
        );
    }
}

/// Egress to a Service judged on the backend IPVS chose (one local and
/// one remote backend allowed, one of each denied), then an ingress policy
/// at a remote backend denying the client.
fn per_backend(prefix: &'static str, datapath: Backend) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, ProxyMode::Ipvs, namespaces, m);
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
    not_node_addresses(&env, datapath);
    forged_sources(&env, datapath);
}

/// The client (egress allowed nowhere) forges the address of solo-a, a
/// pod on its node that no policy isolates, on UDP datagrams to web's
/// ClusterIPs: none may reach a backend. IPVS delivers them to the node
/// (INPUT) and forwards them through OUTPUT, where the iptables datapath
/// judges a pod by its source address — without a source check before
/// (`pa-agent:INPUT`) they went out as solo-a's. The node's own reverse
/// path filter is off, so the agent's check is what is tested.
fn forged_sources(env: &Env, datapath: Backend) {
    let what = format!("{} ipvs", datapath.flag());
    let (node, client) = env.cluster().pod(CLIENT).unwrap();
    for key in [
        "net.ipv4.conf.all.rp_filter".to_owned(),
        "net.ipv4.conf.default.rp_filter".to_owned(),
        format!("net.ipv4.conf.{}.rp_filter", client.host_if),
    ] {
        node.sim.node.sysctl(&key, "0").unwrap();
    }
    let solo_a = env.ips("default/solo-a");
    env.backends.clear();
    for vip in [ip(WEB_V4), ip(WEB_V6)] {
        let forged = *solo_a
            .iter()
            .find(|a| a.is_ipv4() == vip.is_ipv4())
            .unwrap();
        let packets = (0..N as u16)
            .map(|i| Packet::udp(forged, 41000 + i, vip, 81))
            .collect();
        send_raw(&client.netns, packets);
    }
    std::thread::sleep(scaled(Duration::from_secs(1)));
    let reached: Vec<_> = env
        .backends
        .served()
        .into_iter()
        .filter(|s| solo_a.contains(&s.peer.ip()))
        .collect();
    assert!(
        reached.is_empty(),
        "{what}: datagrams forged with solo-a's address reached backends through the ClusterIP: {reached:?}\n{}",
        env.dump("node-1")
    );
}

/// One TCP connection from the node's own namespace to `to`, with the
/// source address `from` (a local address: a node address, or a Service
/// address on kube-ipvs0); the greeting's pod name if answered.
fn connect_from(node: &NetNs, from: IpAddr, to: SocketAddr) -> Option<String> {
    let timeout = scaled(Duration::from_secs(2));
    node.spawn(move || {
        let domain = socket2::Domain::for_address(to);
        let s = socket2::Socket::new(domain, socket2::Type::STREAM, None).ok()?;
        s.bind(&SocketAddr::new(from, 0).into()).ok()?;
        s.connect_timeout(&to.into(), timeout).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        let mut stream: std::net::TcpStream = s.into();
        let _ = stream.write_all(b"hello\n");
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if got.ends_with(b"\n") {
                break;
            }
        }
        let text = String::from_utf8_lossy(&got).into_owned();
        (!text.is_empty()).then_some(text)
    })
    .unwrap()
    .join()
    .unwrap()
    .unwrap()
}

/// No fail-open: the Service addresses on kube-ipvs0 are local, yet never
/// the node's. A client allowed nowhere reaches no backend through any
/// ClusterIP; and (BPF) a backend that takes ingress only from web pods
/// (the node always may reach its pods) answers the node's own address
/// but not a connection whose source is a ClusterIP. The iptables
/// datapath judges nothing the node sends itself (OUTPUT with a local
/// source, a ClusterIP on kube-ipvs0 included), so that half is BPF's.
fn not_node_addresses(env: &Env, datapath: Backend) {
    let web_b_in = policy(
        "default",
        "web-b-in",
        "  podSelector: {matchLabels: {pod: web-b}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n",
    );
    env.write_policies(&format!(
        "{}{web_b_in}",
        client_policy("    - to: [{podSelector: {matchLabels: {app: nobody}}}]\n")
    ));
    let what = format!("{} ipvs", datapath.flag());
    // In force once web-a (node-1, allowed until now) no longer answers
    // the client directly.
    eventually("egress denied", Duration::from_secs(5), || {
        let direct = env.ask(
            CLIENT,
            sock(env.ips("default/web-a")[0], 8080),
            L4::Tcp,
            1,
            Duration::from_millis(400),
        );
        match &direct[0] {
            Reply::NoAnswer => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    env.backends.clear();
    let results = env.ask_all(CLIENT, &web_frontends(), 4, Duration::from_millis(1500));
    for ((to, l4), replies) in web_frontends().iter().zip(&results) {
        assert!(
            replies.iter().all(|r| *r == Reply::NoAnswer),
            "{what}: {l4:?} {to} with egress denied: {replies:?}\n{}",
            ipvs_state(env)
        );
    }
    let served = env.backends.served();
    assert!(
        served.is_empty(),
        "{what}: reached with egress denied: {served:?}"
    );

    if datapath != Backend::Bpf {
        return;
    }
    let node = &env.cluster().nodes[0];
    let web_b = env.ips("default/web-b");
    for (family, node_ip, vip) in [
        ("IPv4", IpAddr::V4(node.v4), ip(WEB_V4)),
        ("IPv6", IpAddr::V6(node.v6), ip(WEB_V6)),
    ] {
        let to = sock(
            *web_b.iter().find(|a| a.is_ipv4() == vip.is_ipv4()).unwrap(),
            8080,
        );
        let from_node = connect_from(&node.sim.node, node_ip, to);
        assert!(
            from_node.as_deref().is_some_and(|t| t.contains("web-b")),
            "{what} {family}: the node ({node_ip}) to web-b: {from_node:?}"
        );
        let from_vip = connect_from(&node.sim.node, vip, to);
        assert_eq!(
            from_vip,
            None,
            "{what} {family}: a connection from the ClusterIP {vip} (on kube-ipvs0) to web-b was let in as the node's\n{}",
            env.dump("node-1")
        );
    }
}

macro_rules! suite {
    ($module:ident, $datapath:expr, $p:literal) => {
        mod $module {
            use super::*;

            /// One cluster per datapath (its start is most of the time
            /// in the emulated guest): per-backend verdicts, then no
            /// fail-open through the Service addresses.
            #[test]
            fn egress_is_judged_on_the_backend_ipvs_chose_and_service_addresses_are_not_the_nodes()
            {
                if ipvs_or_skip(stringify!($module)) {
                    per_backend(concat!("ipv", $p), $datapath);
                }
            }
        }
    };
}

suite!(bpf, Backend::Bpf, "b");
suite!(iptables, Backend::Iptables, "i");
