//! The Services test infrastructure on the real kernel, with no policy
//! agent involved: a two-node simulated cluster, a kube-proxy stand-in on
//! each node (iptables mode, then nftables mode), backends that answer
//! with their pod's name, and a kube-dns stand-in. Needs root; run with
//! `cargo test -p policy-testbed --test privileged -- services::simulated`.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use policy_agent::cluster::ClusterState;
use policy_common::proto::{TCP, UDP};
use policy_testbed::{
    SimCluster,
    backend::{Backends, L4, Reply, ask, tally},
    cleanup_prefix,
    dns::{DnsServer, NameTable, RecordType, Resolution, resolve},
    kube_proxy::{ProxyMode, endpoint_hash, leftovers, nft_endpoint_base},
    manifests::{Manifests, PodManifest, ServiceManifest, TargetPort},
    pod_ips,
};

const TIMEOUT: Duration = Duration::from_secs(3);

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sock(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// The cluster's objects: a client and three `web` backends (the named
/// target port `http` is 8080 on two of them, 8081 on the third), two
/// `solo` pods of which one is selected at a time, and kube-dns.
fn manifests() -> Manifests {
    let web = |name: &str, node: u8, host: u8, http: u16| {
        PodManifest::new(
            "default",
            name,
            &format!("node-{node}"),
            &pod_ips(node, host),
        )
        .label("app", "web")
        .port("http", TCP, http)
        .port("", UDP, 8082)
    };
    Manifests {
        pods: vec![
            PodManifest::new("default", "client", "node-1", &pod_ips(1, 2)).label("app", "client"),
            web("web-a", 1, 10, 8080),
            web("web-b", 2, 10, 8080),
            web("web-c", 2, 11, 8081),
            PodManifest::new("default", "solo-a", "node-1", &pod_ips(1, 20))
                .label("app", "solo")
                .port("", TCP, 9090),
            PodManifest::new("default", "solo-b", "node-2", &pod_ips(2, 20))
                .label("app", "spare")
                .port("", TCP, 9090),
            PodManifest::new("kube-system", "coredns", "node-2", &pod_ips(2, 53))
                .label("k8s-app", "kube-dns")
                .port("dns", UDP, 53)
                .port("dns-tcp", TCP, 53),
        ],
        services: vec![
            ServiceManifest::new("default", "web", &[ip("10.96.0.50"), ip("fd00:96::50")])
                .select("app", "web")
                .port("http", TCP, 80, TargetPort::Name("http".into()))
                .port("udp", UDP, 81, TargetPort::Number(8082))
                .node_port("http", 30080),
            ServiceManifest::new("default", "solo", &[ip("10.96.0.60"), ip("fd00:96::60")])
                .select("app", "solo")
                .port("", TCP, 80, TargetPort::Number(9090)),
            ServiceManifest::new(
                "kube-system",
                "kube-dns",
                &[ip("10.96.0.10"), ip("fd00:96::a")],
            )
            .select("k8s-app", "kube-dns")
            .port("dns", UDP, 53, TargetPort::Name("dns".into()))
            .port("dns-tcp", TCP, 53, TargetPort::Name("dns-tcp".into())),
        ],
    }
}

/// Deletes the namespaces of `prefix` even when an assertion fails (the
/// cluster and the stand-ins clean up on drop as well).
struct Cleanup(&'static str);

impl Drop for Cleanup {
    fn drop(&mut self) {
        cleanup_prefix(self.0);
    }
}

fn state(m: &Manifests) -> ClusterState {
    m.cluster_state("", &[]).unwrap()
}

/// Asserts every request was answered, by `backends` only, each at least
/// `min` times; returns the tally.
fn assert_spread(
    replies: &[Reply],
    backends: &[&str],
    min: usize,
    what: &str,
) -> BTreeMap<String, usize> {
    let t = tally(replies);
    eprintln!("{what}: {t:?}");
    assert_eq!(t.values().sum::<usize>(), replies.len());
    for (pod, n) in &t {
        assert!(
            backends.contains(&pod.as_str()),
            "{what}: unexpected {pod} ({n}) in {t:?}"
        );
    }
    for b in backends {
        let n = t.get(*b).copied().unwrap_or(0);
        assert!(
            n >= min && n <= replies.len() - min * (backends.len() - 1),
            "{what}: {b} answered {n} of {}: {t:?}",
            replies.len()
        );
    }
    t
}

fn run(prefix: &'static str, mode: ProxyMode) {
    cleanup_prefix(prefix);
    let _cleanup = Cleanup(prefix);
    let started = Instant::now();
    let mut m = manifests();
    let on = |n: &str| -> Vec<_> {
        m.pods
            .iter()
            .filter(|p| p.node == n)
            .map(PodManifest::sim_pod)
            .collect()
    };
    let cluster = SimCluster::create(prefix, &on("node-1"), &on("node-2")).unwrap();
    let mut proxies = cluster.kube_proxies(mode, &state(&m)).unwrap();

    let mut backends = Backends::new();
    for p in m.pods.iter().filter(|p| p.name.starts_with("web-")) {
        let (_, pod) = cluster.pod(&p.id()).unwrap();
        let sim = p.sim_pod();
        backends
            .add(&pod.netns, &p.id(), &p.ips, &sim.tcp_ports, &sim.udp_ports)
            .unwrap();
    }
    let mut names = NameTable::new();
    names.insert(
        "web.default.svc.cluster.local".into(),
        vec![ip("10.96.0.50"), ip("fd00:96::50")],
    );
    let (_, dns_pod) = cluster.pod("kube-system/coredns").unwrap();
    let _dns = DnsServer::start(&dns_pod.netns, &pod_ips(2, 53), 53, names).unwrap();
    let (node1, client) = cluster.pod("default/client").unwrap();
    let client_ips = pod_ips(1, 2);

    // (a) A ClusterIP spreads over every backend on both nodes, each
    // reached at its own resolution of the named port; no SNAT.
    let web = ["default/web-a", "default/web-b", "default/web-c"];
    for vip in [ip("10.96.0.50"), ip("fd00:96::50")] {
        let replies = ask(&client.netns, sock(vip, 80), L4::Tcp, 60, TIMEOUT).unwrap();
        assert_spread(&replies, &web, 5, &format!("{mode} TCP {vip}:80"));
        for r in &replies {
            let Reply::Answered { seen_from, .. } = r else {
                unreachable!()
            };
            assert!(
                client_ips.contains(&seen_from.ip()),
                "ClusterIP traffic from a pod was masqueraded: {r:?}"
            );
        }
        let replies = ask(&client.netns, sock(vip, 81), L4::Udp, 60, TIMEOUT).unwrap();
        assert_spread(&replies, &web, 5, &format!("{mode} UDP {vip}:81"));
    }

    // Hairpin: a backend reaching itself through the ClusterIP is
    // masqueraded (it would otherwise answer itself directly); reaching
    // another backend it is not.
    let (_, web_a) = cluster.pod("default/web-a").unwrap();
    let own = pod_ips(1, 10);
    for vip in [ip("10.96.0.50"), ip("fd00:96::50")] {
        let replies = ask(&web_a.netns, sock(vip, 80), L4::Tcp, 45, TIMEOUT).unwrap();
        let t = assert_spread(&replies, &web, 1, &format!("{mode} hairpin {vip}:80"));
        assert!(t["default/web-a"] > 0);
        for r in &replies {
            let Reply::Answered { pod, seen_from } = r else {
                unreachable!()
            };
            let masqueraded = !own.contains(&seen_from.ip());
            assert_eq!(masqueraded, pod == "default/web-a", "hairpin: {r:?}");
            if masqueraded {
                assert!(node1.ips().contains(&seen_from.ip()), "hairpin: {r:?}");
            }
        }
    }

    // (b) NodePort on the client's own node: reaches the backends,
    // masqueraded to the node's address.
    for node_ip in node1.ips() {
        let replies = ask(&client.netns, sock(node_ip, 30080), L4::Tcp, 30, TIMEOUT).unwrap();
        let t = tally(&replies);
        eprintln!("{mode} NodePort {node_ip}:30080: {t:?}");
        for r in &replies {
            let Reply::Answered { pod, seen_from } = r else {
                panic!("NodePort: {r:?} in {t:?}")
            };
            assert!(web.contains(&pod.as_str()));
            assert_eq!(
                seen_from.ip(),
                node_ip,
                "the backend saw {seen_from} for {pod}"
            );
        }
    }

    // (c) Endpoints change during the run.
    let solo_v4 = sock(ip("10.96.0.60"), 80);
    let solo_v6 = sock(ip("fd00:96::60"), 80);
    let mut solo = Backends::new();
    for id in ["default/solo-a", "default/solo-b"] {
        let (_, pod) = cluster.pod(id).unwrap();
        solo.add(&pod.netns, id, &pod.pod.ips, &[9090], &[])
            .unwrap();
    }
    for vip in [solo_v4, solo_v6] {
        let replies = ask(&client.netns, vip, L4::Tcp, 10, TIMEOUT).unwrap();
        assert_spread(
            &replies,
            &["default/solo-a"],
            10,
            &format!("{mode} solo {vip}"),
        );
    }
    // Scaled to zero: rejected, and the old endpoint's chains are gone.
    m.pods.retain(|p| p.name != "solo-a");
    proxies.update(&state(&m)).unwrap();
    for vip in [solo_v4, solo_v6] {
        let replies = ask(&client.netns, vip, L4::Tcp, 10, TIMEOUT).unwrap();
        assert_eq!(
            tally(&replies),
            BTreeMap::from([("(refused)".to_owned(), 10)]),
            "{mode} solo {vip} at zero"
        );
    }
    let stale = match mode {
        ProxyMode::Iptables => format!(
            "KUBE-SEP-{}",
            endpoint_hash("default/solo", "tcp", "10.244.1.20:9090")
        ),
        ProxyMode::Nftables => {
            nft_endpoint_base("default", "solo", "tcp", "", ip("10.244.1.20"), 9090)
        }
        // Not run here (a Service without endpoints is not refused in the
        // stand-in's IPVS mode): tests/ipvs.rs, in the 6.1 guest.
        ProxyMode::Ipvs => unreachable!("IPVS mode is tested by tests/ipvs.rs"),
    };
    let rules = |node: &SimCluster| -> String {
        node.nodes
            .iter()
            .map(|n| match mode {
                ProxyMode::Iptables => n.sim.node.exec("iptables-save", &["-t", "nat"]).unwrap(),
                ProxyMode::Nftables => n
                    .sim
                    .node
                    .exec("nft", &["list", "table", "ip", "kube-proxy"])
                    .unwrap(),
                ProxyMode::Ipvs => unreachable!("IPVS mode is tested by tests/ipvs.rs"),
            })
            .collect()
    };
    let now = rules(&cluster);
    assert!(!now.contains(&stale), "{stale} left behind:\n{now}");
    // Back to one (another pod): that one serves.
    m.pod_mut("default/solo-b")
        .unwrap()
        .labels
        .insert("app".into(), "solo".into());
    proxies.update(&state(&m)).unwrap();
    for vip in [solo_v4, solo_v6] {
        let replies = ask(&client.netns, vip, L4::Tcp, 10, TIMEOUT).unwrap();
        assert_spread(
            &replies,
            &["default/solo-b"],
            10,
            &format!("{mode} solo {vip} scaled back"),
        );
    }

    // A UDP flow to an endpoint that goes away moves on at its next
    // datagram: the stand-in deletes its conntrack entry, as kube-proxy
    // does (web-c keeps serving, it only leaves the Service).
    let vip = sock(ip("10.96.0.50"), 81);
    let who = |s: &UdpSocket| -> String {
        s.send(b"who\n").unwrap();
        let mut buf = [0u8; 128];
        let len = s.recv(&mut buf).unwrap();
        let text = String::from_utf8_lossy(&buf[..len]).into_owned();
        text.strip_prefix("pod:")
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_owned()
    };
    let flow = client
        .netns
        .spawn(move || {
            (0..100).find_map(|_| {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.connect(vip).unwrap();
                s.set_read_timeout(Some(TIMEOUT)).unwrap();
                (who(&s) == "default/web-c").then_some(s)
            })
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
        .expect("no flow landed on web-c");
    assert_eq!(
        who(&flow),
        "default/web-c",
        "the flow stays on its endpoint"
    );
    m.pod_mut("default/web-c")
        .unwrap()
        .labels
        .insert("app".into(), "retired".into());
    proxies.update(&state(&m)).unwrap();
    let next = who(&flow);
    assert!(
        ["default/web-a", "default/web-b"].contains(&next.as_str()),
        "{mode}: the flow still reached {next}"
    );

    // (d) kube-dns behind its ClusterIP, over UDP and TCP, both families.
    for server in [ip("10.96.0.10"), ip("fd00:96::a")] {
        for l4 in [L4::Udp, L4::Tcp] {
            let got = resolve(
                &client.netns,
                sock(server, 53),
                "web.default.svc.cluster.local",
                RecordType::A,
                l4,
                TIMEOUT,
            )
            .unwrap();
            assert_eq!(
                got,
                Resolution::Addresses(vec![ip("10.96.0.50")]),
                "{mode} {server} {l4:?}"
            );
            let got = resolve(
                &client.netns,
                sock(server, 53),
                "web.default.svc.cluster.local.",
                RecordType::Aaaa,
                l4,
                TIMEOUT,
            )
            .unwrap();
            assert_eq!(
                got,
                Resolution::Addresses(vec![ip("fd00:96::50")]),
                "{mode} {server} {l4:?}"
            );
            let got = resolve(
                &client.netns,
                sock(server, 53),
                "nope.default.svc.cluster.local",
                RecordType::A,
                l4,
                TIMEOUT,
            )
            .unwrap();
            assert_eq!(got, Resolution::NxDomain, "{mode} {server} {l4:?}");
        }
    }

    // (e) remove leaves nothing of kube-proxy behind, and the ClusterIP
    // is no longer translated.
    proxies.remove().unwrap();
    for n in &cluster.nodes {
        let left = leftovers(&n.sim.node).unwrap();
        assert!(left.is_empty(), "{mode} on {}: {left:#?}", n.name);
    }
    let replies = ask(
        &client.netns,
        sock(ip("10.96.0.50"), 80),
        L4::Tcp,
        3,
        Duration::from_millis(300),
    )
    .unwrap();
    assert!(replies.iter().all(|r| r.pod().is_none()), "{replies:?}");
    eprintln!("{mode}: {:?}", started.elapsed());
}

#[test]
fn services_through_kube_proxy_iptables_mode() {
    run("svcipt", ProxyMode::Iptables);
}

#[test]
fn services_through_kube_proxy_nftables_mode() {
    run("svcnft", ProxyMode::Nftables);
}
