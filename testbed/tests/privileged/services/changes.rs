//! Services with the agents while things change under traffic: a
//! Service's endpoints moving (scaled to zero, back to another pod, from
//! an allowed to a denied pod) while connections and long-lived UDP flows
//! are being made, and established connections through a ClusterIP cut by
//! a policy change at either end. Same harness as `services::basics`; needs
//! root; run with
//! `cargo test -p policy-testbed --test privileged -- services::changes`.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use policy_testbed::fixtures::{conformance::Backend, services::*};
use policy_testbed::{
    NetNs, Outcome,
    backend::{L4, Reply, ask},
    connect, echo,
    kube_proxy::ProxyMode,
};

fn solo_frontends() -> Vec<(SocketAddr, L4)> {
    vec![
        (sock(ip(SOLO_V4), 80), L4::Tcp),
        (sock(ip(SOLO_V6), 80), L4::Tcp),
        (sock(ip(SOLO_V4), 80), L4::Udp),
        (sock(ip(SOLO_V6), 80), L4::Udp),
    ]
}

/// What a long-lived UDP flow (one connected socket) got for each
/// datagram: the pod that answered, "(none)" or "(refused)".
type FlowLog = Arc<Mutex<Vec<(SocketAddr, String)>>>;

/// A datagram every 50 ms on one socket per frontend, until `stop`.
fn long_lived_flows(
    netns: &NetNs,
    to: Vec<SocketAddr>,
    stop: Arc<AtomicBool>,
    log: FlowLog,
) -> std::thread::JoinHandle<()> {
    let name = netns.name.clone();
    std::thread::spawn(move || {
        NetNs::borrow(&name).enter().unwrap();
        let sockets: Vec<(SocketAddr, UdpSocket)> = to
            .iter()
            .map(|a| {
                let bind: SocketAddr = if a.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
                    .parse()
                    .unwrap();
                let s = UdpSocket::bind(bind).unwrap();
                s.connect(a).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(150)))
                    .unwrap();
                (*a, s)
            })
            .collect();
        let mut buf = [0u8; 256];
        while !stop.load(Ordering::Relaxed) {
            for (to, s) in &sockets {
                let got = match s.send(b"who\n").and_then(|_| s.recv(&mut buf)) {
                    Ok(len) => String::from_utf8_lossy(&buf[..len])
                        .strip_prefix("pod:")
                        .and_then(|r| r.split(' ').next())
                        .unwrap_or("(garbled)")
                        .to_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        "(refused)".into()
                    }
                    Err(_) => "(none)".into(),
                };
                log.lock().unwrap().push((*to, got));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}

/// (d) The endpoints of `default/solo` change while the client keeps
/// connecting (new TCP connections and UDP datagrams, and one long-lived
/// UDP flow per family): `pick: a` (node-1, allowed), none, `c` (node-2,
/// allowed), `d` (node-2, denied), `b` (node-1, denied), `a` again. A
/// denied backend never receives a packet from the client; allowed ones
/// do, and answer.
fn endpoints_change(prefix: &'static str, datapath: Backend, mode: ProxyMode) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, mode, namespaces, m);
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {tier: ok}}}]\n      ports: [{protocol: TCP, port: 9090}, {protocol: UDP, port: 9090}]\n",
    ));
    env.start_agents();
    let what = format!("{} {mode}", datapath.flag());
    let stop = Arc::new(AtomicBool::new(false));
    let flows: FlowLog = Arc::default();
    let long = long_lived_flows(
        env.netns(CLIENT),
        vec![sock(ip(SOLO_V4), 80), sock(ip(SOLO_V6), 80)],
        stop.clone(),
        flows.clone(),
    );
    let background: Arc<Mutex<Vec<Reply>>> = Arc::default();
    let short = {
        let (stop, background) = (stop.clone(), background.clone());
        let netns = env.netns(CLIENT).name.clone();
        std::thread::spawn(move || {
            let netns = NetNs::borrow(&netns);
            while !stop.load(Ordering::Relaxed) {
                for (to, l4) in solo_frontends() {
                    let r = ask(&netns, to, l4, 2, Duration::from_millis(300)).unwrap();
                    background.lock().unwrap().extend(r);
                }
            }
        })
    };
    let phases: [(&str, Option<&str>); 6] = [
        ("a", Some("default/solo-a")),
        ("none", None),
        ("c", Some("default/solo-c")),
        ("d", None),
        ("b", None),
        ("a", Some("default/solo-a")),
    ];
    for (i, (pick, serves)) in phases.iter().enumerate() {
        if i > 0 {
            env.update(|m| {
                let solo = m.services.iter_mut().find(|s| s.name == "solo").unwrap();
                solo.selector.insert("pick".into(), (*pick).into());
            });
        }
        let started = Instant::now();
        // Where a backend serves, a connection gets 3 s: a SYN the loaded
        // kernel loses outside the datapath is resent after 1 s, and an
        // allowed connection must get through, not necessarily at once.
        // Whether the datapath itself dropped anything is asked of its
        // counters below.
        let wait = Duration::from_secs(if serves.is_some() { 3 } else { 1 });
        let mut results = env.ask_all(CLIENT, &solo_frontends(), 10, wait);
        if serves.is_some() {
            // A connection the loaded kernel lost twice (its SYN and the
            // one resend the wait allows) is asked once more. Within a
            // phase nothing changes, so a datapath that dropped it drops
            // the new one too; and at the first phase the BPF datapath
            // must have counted no drop at all (below).
            for ((to, l4), replies) in solo_frontends().iter().zip(results.iter_mut()) {
                let lost = replies
                    .iter()
                    .filter(|r| matches!(r, Reply::NoAnswer))
                    .count();
                if lost > 0 {
                    replies.retain(|r| !matches!(r, Reply::NoAnswer));
                    replies.extend(env.ask_all(CLIENT, &[(*to, *l4)], lost, wait).remove(0));
                }
            }
        }
        for ((to, l4), replies) in solo_frontends().iter().zip(&results) {
            let ok = replies.iter().all(|r| match serves {
                Some(pod) => r.pod() == Some(pod),
                None => r.pod().is_none(),
            });
            assert!(ok, "{what}: pick {pick}: {l4:?} {to}: {replies:?}");
        }
        if i == 0 && datapath == Backend::Bpf {
            // Everything so far was allowed: the client's node dropped
            // nothing (a transient deny during start would show here).
            let drops = drop_counters(&env.dump("node-1"));
            assert!(drops.is_empty(), "{what}: pick {pick}: drops {drops:?}");
        }
        // Let the background traffic run in this state for a while.
        std::thread::sleep(Duration::from_millis(1200).saturating_sub(started.elapsed()));
    }
    stop.store(true, Ordering::Relaxed);
    short.join().unwrap();
    long.join().unwrap();

    let allowed = ["default/solo-a", "default/solo-c"];
    let background = background.lock().unwrap();
    for r in background.iter() {
        if let Some(pod) = r.pod() {
            assert!(allowed.contains(&pod), "{what}: a new flow reached {pod}");
        }
    }
    let flows = flows.lock().unwrap();
    let mut by_flow: BTreeMap<SocketAddr, BTreeMap<&str, usize>> = BTreeMap::new();
    for (to, got) in flows.iter() {
        *by_flow
            .entry(*to)
            .or_default()
            .entry(got.as_str())
            .or_default() += 1;
    }
    eprintln!("{what}: long-lived flows: {by_flow:?}");
    for (to, got) in &by_flow {
        for pod in got.keys().filter(|p| p.starts_with("default/")) {
            assert!(
                allowed.contains(pod),
                "{what}: the long-lived flow to {to} reached {pod}: {got:?}"
            );
        }
        assert!(
            got.contains_key("default/solo-c"),
            "{what}: the long-lived flow to {to} never moved to solo-c: {got:?}"
        );
    }
    for denied in ["default/solo-b", "default/solo-d"] {
        let seen = env.served(denied, CLIENT);
        assert!(
            seen.is_empty(),
            "{what}: denied backend {denied} received {seen:?}"
        );
    }
    for pod in allowed {
        assert!(
            !env.served(pod, CLIENT).is_empty(),
            "{what}: {pod} served nothing"
        );
    }
}

/// The non-zero drop counters (and conntrack failures) of a `dump`.
fn drop_counters(dump: &str) -> Vec<String> {
    dump.split("\nCOUNTERS\n")
        .nth(1)
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("drop_") || l.starts_with("ct_"))
        .filter(|l| l.split_whitespace().last() != Some("0"))
        .map(str::to_owned)
        .collect()
}

/// (e) Connections through ClusterIPs (to solo-a on the client's node, to
/// solo-c on the other, both families) are cut at their next packet when
/// a policy change denies them, at the client's egress or at the
/// backend's ingress; the others carry on, their replies passing the
/// client's ingress isolation.
fn established_cut(prefix: &'static str, datapath: Backend, mode: ProxyMode) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, mode, namespaces, m);
    let backend_in = |from: &str| {
        policy(
            "default",
            "solo-in",
            &format!(
                "  podSelector: {{matchLabels: {{tier: ok}}}}\n  ingress: [{{from: [{{podSelector: {{matchLabels: {{app: {from}}}}}}}], ports: [{{port: {ECHO_PORT}}}]}}]\n"
            ),
        )
    };
    let egress_to = |selector: &str| {
        client_policy(&format!(
            "    - to: [{{podSelector: {{matchLabels: {{{selector}}}}}}}]\n      ports: [{{protocol: TCP, port: {ECHO_PORT}}}]\n"
        ))
    };
    env.write_policies(&format!(
        "{}{}",
        egress_to("tier: ok"),
        backend_in("client")
    ));
    env.start_agents();
    let what = format!("{} {mode}", datapath.flag());
    let netns = env.netns(CLIENT);
    let open = |vip: &str| {
        let mut s = connect(
            netns,
            sock(ip(vip), ECHO_SVC_PORT),
            scaled(Duration::from_secs(2)),
        )
        .unwrap_or_else(|e| panic!("{what}: connecting to {vip}: {e}"));
        assert_eq!(
            echo(&mut s, b"hello", scaled(Duration::from_secs(1))),
            Outcome::Open,
            "{what}: {vip}"
        );
        s
    };
    let mut a4 = open(SOLO_V4);
    let mut a6 = open(SOLO_V6);
    let mut c4 = open(SOLO2_V4);
    let mut c6 = open(SOLO2_V6);
    let short = Duration::from_millis(400);

    // The client's egress now allows solo-c only: the connections to
    // solo-a (node-1) are cut, those to solo-c (node-2) carry on.
    env.write_policies(&format!("{}{}", egress_to("pick: c"), backend_in("client")));
    eventually(
        "egress to solo-a denied",
        Duration::from_secs(10),
        || match echo(&mut a4, b"ping", short) {
            Outcome::Blocked => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    assert_eq!(
        echo(&mut a6, b"ping", short),
        Outcome::Blocked,
        "{what}: IPv6 to solo-a"
    );
    for (s, fam) in [(&mut c4, "IPv4"), (&mut c6, "IPv6")] {
        assert_eq!(
            echo(s, b"still", scaled(Duration::from_secs(1))),
            Outcome::Open,
            "{what}: {fam} to solo-c"
        );
    }

    // solo-c's ingress no longer admits the client: node-2's agent cuts.
    env.write_policies(&format!("{}{}", egress_to("pick: c"), backend_in("nobody")));
    env.dump_on_failure(|| {
        eventually(
            "ingress at solo-c denied",
            Duration::from_secs(10),
            || match echo(&mut c4, b"ping", short) {
                Outcome::Blocked => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
    });
    assert_eq!(
        echo(&mut c6, b"ping", short),
        Outcome::Blocked,
        "{what}: IPv6 to solo-c"
    );
    assert!(
        connect(netns, sock(ip(SOLO2_V4), ECHO_SVC_PORT), scaled(short)).is_err(),
        "{what}: a new connection to solo-c"
    );
}

macro_rules! suite {
    ($module:ident, $datapath:expr, $mode:expr, $p:literal $(, #[$cut:meta])*) => {
        mod $module {
            use super::*;

            #[test]
            fn endpoints_change_under_traffic() {
                endpoints_change(concat!("svd", $p), $datapath, $mode);
            }

            // Was flaky on BPF (a connection through a ClusterIP kept
            // echoing after the backend's ingress policy cut it): the
            // backend's own mid-stream ACK, between the cut and the
            // client's next segment, opened a flow in the backend's name
            // and the client's segments passed as its replies. A TCP
            // segment without SYN now opens nothing (kernel_hardening
            // holds it).
            #[test]
            $(#[$cut])*
            fn established_connections_through_a_service_are_cut() {
                established_cut(concat!("sve", $p), $datapath, $mode);
            }
        }
    };
}

suite!(bpf, Backend::Bpf, ProxyMode::Iptables, "bi");
// The iptables datapath had the same hole through the kernel's conntrack:
// after `conntrack -D` the backend's mid-stream ACK was picked up as a new
// flow it opened (nf_conntrack_tcp_loose), confirmed because its egress
// is open, and the client's segments rode it as ESTABLISHED (about 1 run
// in 5). Flows are now revoked (a connmark bit), not deleted.
suite!(iptables, Backend::Iptables, ProxyMode::Iptables, "ii");
suite!(bpf_nftables_mode, Backend::Bpf, ProxyMode::Nftables, "bn");
suite!(
    iptables_nftables_mode,
    Backend::Iptables,
    ProxyMode::Nftables,
    "in"
);
