//! `--pod-cidr` on the simulated node, both datapaths: a pod whose veth
//! the node's network set up but the agent does not know yet (no pod
//! classifier, no chains) gets no packet in or out from the pods next to
//! it, while they keep talking; once the agent learns it, its traffic
//! follows policy. The node's own address inside the range keeps working.
//! In cluster mode the ranges come from the Node object; a Node that
//! cannot be read at start keeps the guard the previous run armed.
//! Judged at the receivers (the pods' servers, a listener on the node).
//! Needs root.

use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    time::Duration,
};

use policy_testbed::fixtures::{
    conformance::{Backend, Conformance, NODE, NsSpec, PodSpec, cluster_yaml, labels},
    fake_apiserver::{FakeApi, node},
};
use policy_testbed::{NODE_ROW, NetNs, SimPod};

const FRESH: &str = "t/fresh";
const PEER: &str = "t/peer";
/// The node's pod ranges.
const POD_CIDRS: [&str; 2] = ["10.244.9.0/24", "fd00:244:9::/64"];
/// The node's address inside the pod range (ptp puts its gateway there).
const NODE_IN_RANGE: [&str; 2] = ["10.244.9.1", "fd00:244:9::1"];

fn pod(name: &str, i: u8) -> PodSpec {
    PodSpec::numbered("t", name, 9, i, vec![])
}

/// One UDP datagram from `from` (inside `from_ns`) to `to` (a listener in
/// `to_ns`), echoed back: (arrived at the listener, echo arrived back).
fn udp_round_trip(from_ns: &NetNs, to_ns: &NetNs, from: IpAddr, to: IpAddr) -> (bool, bool) {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let listener = to_ns
        .spawn(move || {
            let s = UdpSocket::bind(SocketAddr::new(to, 7777)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = [0u8; 64];
            match s.recv_from(&mut buf) {
                Ok((n, peer)) => {
                    let _ = s.send_to(&buf[..n], peer);
                    true
                }
                Err(_) => false,
            }
        })
        .unwrap();
    ready_rx.recv().unwrap();
    let echoed = from_ns
        .spawn(move || {
            let s = UdpSocket::bind(SocketAddr::new(from, 0)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let _ = s.send_to(b"pod-range guard", SocketAddr::new(to, 7777));
            let mut buf = [0u8; 64];
            s.recv_from(&mut buf).is_ok()
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    let arrived = listener.join().unwrap().unwrap();
    (arrived, echoed)
}

fn suite(prefix: &'static str, backend: Backend) {
    let mut c = setup(prefix, backend);
    // The node's address in the range exists before the agent starts.
    let node_ns = NetNs::borrow(&c.node().node.name);
    node_ns
        .ip(&["addr", "add", "10.244.9.1/32", "dev", "lo"])
        .unwrap();
    node_ns
        .ip(&["-6", "addr", "add", "fd00:244:9::1/128", "dev", "lo"])
        .unwrap();
    let dir = c.dir.to_str().unwrap().to_owned();
    c.start_daemon_with(
        19440,
        &[
            "--manifests",
            &dir,
            "--pod-cidr",
            "10.244.9.0/24",
            "--pod-cidr",
            "fd00:244:9::/64",
        ],
        &[],
    );
    // The enforced pods talk to each other.
    c.check("known pods, no policy", |_, _, _, _| true);

    let fresh = add_unknown_pod(&mut c);
    if matches!(backend, Backend::Bpf) {
        // `dump` shows the ranges and whose addresses are enforced.
        let d = c.dump();
        assert_eq!(d["catchall_on"], true);
        let ranges = dumped_ranges(&d);
        assert!(
            ranges.contains(&"10.244.9.0/24") && ranges.contains(&"fd00:244:9::/64"),
            "{ranges:?}"
        );
        let owner = |ip: &str| {
            d["enforced"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["address"] == ip)
                .map(|e| e["endpoint"].as_str().unwrap().to_owned())
        };
        assert_eq!(owner("10.244.9.11").as_deref(), Some("t/known"));
        assert_eq!(owner("fd00:244:9::12").as_deref(), Some("t/peer"));
        assert_eq!(owner("10.244.9.1").as_deref(), Some("(node)"));
        assert_eq!(
            owner("10.244.9.20"),
            None,
            "the unknown pod is not enforced"
        );
    }

    // The node's address inside the range answers the enforced pod.
    let known_ns = &c.node().pod("t/known").unwrap().netns;
    for (i, node_ip) in NODE_IN_RANGE.iter().enumerate() {
        let node_ip: IpAddr = node_ip.parse().unwrap();
        let me = c.pods[0].ips[i];
        assert_eq!(
            udp_round_trip(known_ns, &node_ns, me, node_ip),
            (true, true),
            "{me} <-> the node's {node_ip}"
        );
    }

    // The agent learns the pod; a policy lets only the peer in.
    c.pods.push(fresh);
    c.write_cluster();
    c.write_policies(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: fresh, namespace: t}\nspec:\n  podSelector: {matchLabels: {app: fresh}}\n  ingress:\n    - from: [{podSelector: {matchLabels: {app: peer}}}]\n",
    );
    c.eventually("the pod enforced", Duration::from_secs(20), |f, t, _, _| {
        t != FRESH || f == PEER || f == NODE_ROW || f == t
    });
    if matches!(backend, Backend::Bpf) {
        an_address_withdrawn_moves_every_revision(&mut c);
    }
}

/// The classifier lets a flow tracked at its endpoint's current revision
/// skip the guard, so an address leaving ENFORCED must move every
/// endpoint's revision (each flow is then judged again, its peer first).
/// Here the peer's interface goes while its pod object stays: no ipcache
/// or policy change moves a revision, only the withdrawal.
fn an_address_withdrawn_moves_every_revision(c: &mut Conformance) {
    let revision = |d: &serde_json::Value, pod: &str| {
        d["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["pod"] == pod)
            .and_then(|e| e["revision"].as_u64())
    };
    let enforced = |d: &serde_json::Value, ip: &str| {
        d["enforced"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["address"] == ip)
    };
    let before = c.dump();
    let known = revision(&before, "t/known").expect("t/known has an endpoint");
    assert!(enforced(&before, "10.244.9.12"));
    c.node
        .as_mut()
        .unwrap()
        .remove_pod(PEER)
        .expect("the peer pod");
    let deadline = std::time::Instant::now()
        + policy_testbed::fixtures::deadline::scaled(Duration::from_secs(10));
    loop {
        let d = c.dump();
        let withdrawn = !enforced(&d, "10.244.9.12") && !enforced(&d, "fd00:244:9::12");
        let moved = revision(&d, "t/known").is_some_and(|r| r != known);
        if withdrawn && moved {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the peer's addresses withdrawn: {withdrawn}; t/known's revision moved from {known}: {moved}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sets up a new pod outside the agent's knowledge (as the node's CNI
/// plugin does before anyone tells the agent) and checks that nothing but
/// its node reaches it or hears from it, while the others talk on.
/// Returns its spec.
fn add_unknown_pod(c: &mut Conformance) -> PodSpec {
    let fresh = pod("fresh", 20);
    let sim = SimPod {
        namespace: fresh.namespace.clone(),
        name: fresh.name.clone(),
        ips: fresh.ips.clone(),
        tcp_ports: vec![80, 8080],
        udp_ports: vec![53, 5353],
    };
    c.node.as_mut().unwrap().add(&sim).unwrap();
    let fresh_ns = &c.node.as_ref().unwrap().pod(FRESH).unwrap().netns;
    c.servers.as_mut().unwrap().add(fresh_ns, &sim).unwrap();
    check_unknown(c, "an unenforced pod");
    // Given time (the agent resyncs on the new link), still nothing.
    std::thread::sleep(Duration::from_secs(1));
    check_unknown(c, "an unenforced pod, later");
    fresh
}

/// Nothing reaches the unknown pod or comes from it but its node (and
/// itself); the others still talk to each other.
fn check_unknown(c: &Conformance, what: &str) {
    let unknown = |from: &str, to: &str| {
        let ends = [from, to];
        // A pod's traffic to itself stays inside it.
        if ends.contains(&FRESH) && from != to {
            ends.contains(&NODE_ROW)
        } else {
            true
        }
    };
    c.check(what, |f, t, _, _| unknown(f, t));
}

fn setup(prefix: &'static str, backend: Backend) -> Conformance {
    Conformance::with_cluster(
        prefix,
        backend,
        vec![NsSpec {
            name: "t".into(),
            labels: labels(&[("team", "t")]),
        }],
        vec![pod("known", 11), pod("peer", 12)],
    )
}

/// Cluster mode without `--pod-cidr`: the ranges come from the agent's
/// own Node object (`spec.podCIDRs`).
#[test]
fn in_cluster_mode_the_ranges_come_from_the_node_object() {
    let mut c = setup("cak", Backend::Bpf);
    let objects = cluster_objects(&c);
    let api = FakeApi::start(&c.node().node, objects);
    let kubeconfig = c.dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kc = kubeconfig.to_str().unwrap().to_owned();
    c.start_daemon_with(19441, &[], &[("KUBECONFIG", &kc)]);
    assert!(
        api.requests()
            .iter()
            .any(|r| r.starts_with(&format!("GET /api/v1/nodes/{NODE}"))),
        "the agent reads its Node: {:?}",
        api.requests()
    );
    c.check("known pods, no policy", |_, _, _, _| true);
    add_unknown_pod(&mut c);
}

/// The cluster's objects and this node's Node (with its pod ranges).
fn cluster_objects(c: &Conformance) -> Vec<serde_json::Value> {
    let yaml = cluster_yaml(&c.namespaces, &c.pods);
    let mut objects: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&yaml)
        .filter_map(|doc| {
            let v = <serde_json::Value as serde::Deserialize>::deserialize(doc).unwrap();
            (!v.is_null()).then_some(v)
        })
        .collect();
    objects.push(node(NODE, &POD_CIDRS));
    objects
}

/// `metric` as `/metrics` says it.
fn metric(c: &Conformance, port: u16, metric: &str) -> Option<String> {
    c.http_get(port, "/metrics")
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{metric} ")).map(str::to_owned))
}

/// A Node read that fails at start. With nothing pinned the guard cannot
/// be on; it arms once the Node answers. After a restart whose Node read
/// fails, the guard the previous run armed stays armed (the pins on BPF,
/// the installed rules on iptables): the unknown pod still gets nothing.
/// Meanwhile the agent enforces everything else, is not ready, and says
/// why (`/readyz`, `policy_agent_pod_ranges_known` 0); once the Node
/// answers it is ready.
fn node_read_fails_at_start(prefix: &'static str, backend: Backend) {
    let mut c = setup(prefix, backend);
    let api = FakeApi::start(&c.node().node, cluster_objects(&c));
    let kubeconfig = c.dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kc = kubeconfig.to_str().unwrap().to_owned();
    let env = [("KUBECONFIG", kc.as_str())];
    let port = 19442;

    // A fresh node, its Node not readable: enforcing, not ready.
    api.set_nodes_failing(true);
    let why = c.start_daemon_unready(port, &[], &env);
    assert!(why.contains("pod ranges are not known"), "{why}");
    assert_eq!(
        metric(&c, port, "policy_agent_pod_ranges_known").as_deref(),
        Some("0")
    );
    c.check("known pods, no policy", |_, _, _, _| true);
    // The Node answers: the ranges apply, the guard is on.
    api.set_nodes_failing(false);
    let within = Duration::from_secs(45);
    let start = std::time::Instant::now();
    while !c.http_get(port, "/readyz").starts_with("HTTP/1.1 200") {
        assert!(start.elapsed() < within, "not ready once the Node answers");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        metric(&c, port, "policy_agent_pod_ranges_known").as_deref(),
        Some("1")
    );
    add_unknown_pod(&mut c);

    // Restarted while the Node cannot be read: the guard stays armed.
    c.stop_daemon();
    api.set_nodes_failing(true);
    let why = c.start_daemon_unready(port, &[], &env);
    assert!(why.contains("pod ranges are not known"), "{why}");
    if matches!(backend, Backend::Bpf) {
        let d = c.dump();
        assert_eq!(d["catchall_on"], true, "the guard stays armed");
        let ranges = dumped_ranges(&d);
        assert_eq!(ranges, POD_CIDRS, "the pinned ranges stay");
    }
    check_unknown(&c, "restarted, the Node unreadable");
    std::thread::sleep(Duration::from_secs(1));
    check_unknown(&c, "restarted, the Node unreadable, later");
    api.set_nodes_failing(false);
    let start = std::time::Instant::now();
    while !c.http_get(port, "/readyz").starts_with("HTTP/1.1 200") {
        assert!(start.elapsed() < within, "not ready once the Node answers");
        std::thread::sleep(Duration::from_millis(200));
    }
    check_unknown(&c, "the Node read again");
}

#[test]
fn a_failed_node_read_keeps_the_guard_armed_bpf() {
    node_read_fails_at_start("cakeepb", Backend::Bpf);
}

#[test]
fn a_failed_node_read_keeps_the_guard_armed_iptables() {
    node_read_fails_at_start("cakeepi", Backend::Iptables);
}

#[test]
fn an_unenforced_pod_gets_nothing_in_or_out_bpf() {
    suite("cab", Backend::Bpf);
}

#[test]
fn an_unenforced_pod_gets_nothing_in_or_out_iptables() {
    suite("cai", Backend::Iptables);
}

/// The pod ranges `dump` shows.
fn dumped_ranges(dump: &serde_json::Value) -> Vec<&str> {
    dump["pod_ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect()
}
