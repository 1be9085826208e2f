//! The iptables fallback's golden renderings of the tricky cases, each
//! also evaluated (the rendered sets and chains, read as netfilter reads
//! them) on every flow against the independent spec evaluator, so a golden
//! file cannot bless a wrong rule. Set UPDATE_GOLDEN=1 to rewrite the
//! golden files after a reviewed change (refused under CI).
use std::{collections::BTreeMap, net::IpAddr, path::Path};

use policy_agent::{
    cluster::PodRef,
    datapath::iptables::{DEFAULT_MARK, NAME_BITS, RenderInput, render},
    identity::IdentityAllocator,
    policy,
    source::manifests::{LoadedManifests, load_text},
};
use policy_common::proto;

use crate::support::{
    ci::local_switch,
    netfilter::{Netfilter, Packet},
    oracle,
};

const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/unprivileged/golden/iptables"
);

/// The node's own addresses.
const NODE_IPS: [&str; 2] = ["192.168.0.1", "fd00:ffff::1"];

fn golden(case: &str) {
    let dir = Path::new(GOLDEN);
    let mut loaded = LoadedManifests::default();
    for file in ["cluster.yaml", &format!("{case}.yaml")] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        load_text(&dir.join(file), &text, &mut loaded);
    }
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    let state = loaded.cluster_state("n1", NODE_IPS.map(|a| a.parse().unwrap()).to_vec());
    let compiled = policy::compile(&state, &mut IdentityAllocator::new());
    assert!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    let interfaces: BTreeMap<PodRef, String> = compiled
        .local_pods
        .keys()
        .map(|p| (p.clone(), format!("veth-{}", p.name)))
        .collect();
    let ruleset = render(&RenderInput {
        maps: &compiled.maps,
        local_pods: &compiled.local_pods,
        interfaces: &interfaces,
        rules: &compiled.rules,
        mark: DEFAULT_MARK,
        name_bits: NAME_BITS,
    });
    let text = ruleset.render_text();
    let path = dir.join(format!("{case}.expected"));
    if local_switch("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    // What the text does, flow by flow, whatever the golden file says.
    rules_agree_with_the_spec(case, &text, &state, &interfaces);
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("missing {}; run with UPDATE_GOLDEN=1", path.display()));
    assert_eq!(
        text, want,
        "rendering of {case} changed (UPDATE_GOLDEN=1 to accept after review)"
    );
}

/// Every new flow between the cluster's addresses (and a few others),
/// through the rendered rules as netfilter would run them, equals the spec
/// evaluator's verdict. Node traffic never crosses FORWARD (INPUT/OUTPUT),
/// nor does a pod's traffic to itself. Then what local pods send to the
/// node (INPUT): node traffic, but for encapsulations, judged by the
/// node address's class ([`oracle::World::to_node`]); and a local pod's
/// address from anywhere but its own interface (a tunnel device's inner
/// packet), never let in or through.
fn rules_agree_with_the_spec(
    case: &str,
    text: &str,
    state: &policy_agent::cluster::ClusterState,
    interfaces: &BTreeMap<PodRef, String>,
) {
    let nf = Netfilter::parse(text);
    let world = oracle::World::new(state, false);
    let iface: BTreeMap<IpAddr, &String> = state
        .pods
        .iter()
        .filter_map(|(p, info)| interfaces.get(p).map(|i| (info, i)))
        .flat_map(|(info, i)| info.ips.iter().map(move |ip| (*ip, i)))
        .collect();
    let mut addrs: Vec<IpAddr> = state.pods.values().flat_map(|p| p.ips.to_vec()).collect();
    addrs.extend(
        [
            "10.1.0.99",
            "10.1.5.5",
            "10.3.0.1",
            "10.200.0.1",
            "8.8.8.8",
            "fd00::99",
            "2001:db8::1",
        ]
        .map(|a| a.parse::<IpAddr>().unwrap()),
    );
    let mut flows: Vec<(u8, u16)> = [
        53, 79, 80, 81, 7999, 8000, 8063, 8064, 8095, 8096, 8099, 8100, 8101, 8080, 9000,
    ]
    .iter()
    .map(|p| (proto::TCP, *p))
    .collect();
    flows.extend([
        (proto::UDP, 53),
        (proto::UDP, 80),
        (proto::SCTP, 9000),
        (proto::SCTP, 9001),
        (proto::ICMP, 0),
    ]);
    let uplink = "uplink0".to_owned();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for s in &addrs {
        for d in addrs
            .iter()
            .filter(|d| d.is_ipv4() == s.is_ipv4() && *d != s)
        {
            for (p, port) in &flows {
                let protocol = if *p == proto::ICMP && s.is_ipv6() {
                    proto::ICMPV6
                } else {
                    *p
                };
                let packet = Packet {
                    in_if: iface.get(s).copied().unwrap_or(&uplink).clone(),
                    out_if: iface.get(d).copied().unwrap_or(&uplink).clone(),
                    src: *s,
                    dst: *d,
                    protocol,
                    dport: if proto::has_ports(*p) { *port } else { 0 },
                };
                let got = nf.forward(&packet);
                let want = world.allows(*s, *d, *p, *port);
                checked += 1;
                if got != want {
                    wrong.push(format!(
                        "  {s} -> {d} proto {p} port {port}: rules {got}, spec {want}"
                    ));
                }
            }
        }
    }
    let forward_checked = checked;

    // A local pod's address entering at another interface (a tunnel
    // device's decapsulated inner packet), to every address: through
    // FORWARD and into the node, nothing.
    let tunnel = "tunnel0".to_owned();
    let node_ips: Vec<IpAddr> = state.node_ips.clone();
    for s in iface.keys() {
        for d in addrs
            .iter()
            .chain(&node_ips)
            .filter(|d| d.is_ipv4() == s.is_ipv4() && *d != s)
        {
            let to_node = node_ips.contains(d);
            let packet = Packet {
                in_if: tunnel.clone(),
                out_if: if to_node {
                    String::new()
                } else {
                    iface.get(d).copied().unwrap_or(&uplink).clone()
                },
                src: *s,
                dst: *d,
                protocol: proto::UDP,
                dport: 53,
            };
            let got = if to_node {
                nf.input(&packet)
            } else {
                nf.forward(&packet)
            };
            checked += 1;
            if got {
                wrong.push(format!(
                    "  {s} -> {d} from {tunnel}: let through, a local pod's address from elsewhere"
                ));
            }
        }
    }

    // What local pods send to the node's addresses (INPUT), from their
    // own interface: encapsulations by the spec's choice, the rest
    // always; with another local pod's address: never.
    let mut to_node: Vec<(u8, u16)> = [4, 41, 47, 97, 137].map(|p| (p, 0)).to_vec();
    to_node.extend([
        (proto::UDP, 4789),
        (proto::UDP, 8472),
        (proto::UDP, 6081),
        (proto::UDP, 53),
        (proto::UDP, 4790),
        (proto::TCP, 4789),
        (proto::TCP, 10250),
        (proto::ICMP, 0),
    ]);
    for (s, in_if) in &iface {
        for d in node_ips.iter().filter(|d| d.is_ipv4() == s.is_ipv4()) {
            for (p, port) in &to_node {
                let protocol = if *p == proto::ICMP && s.is_ipv6() {
                    proto::ICMPV6
                } else {
                    *p
                };
                let packet = Packet {
                    in_if: (*in_if).clone(),
                    out_if: String::new(),
                    src: *s,
                    dst: *d,
                    protocol,
                    dport: *port,
                };
                let got = nf.input(&packet);
                let want = world.to_node(*s, *d, *p, *port);
                checked += 1;
                if got != want {
                    wrong.push(format!(
                        "  {s} -> node {d} proto {p} port {port}: rules {got}, spec {want}"
                    ));
                }
                for (other, _) in iface
                    .iter()
                    .filter(|(o, i)| o.is_ipv4() == s.is_ipv4() && *i != in_if)
                {
                    let forged = Packet {
                        src: *other,
                        ..packet.clone()
                    };
                    checked += 1;
                    if nf.input(&forged) {
                        wrong.push(format!(
                            "  {other} (forged) from {in_if} -> node {d} proto {p} port {port}: let in"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{case}: the rendered rules disagree with the spec on {} of {checked} flows:\n{}\n{text}",
        wrong.len(),
        wrong.join("\n")
    );
    assert!(
        forward_checked > 1000,
        "{case}: only {forward_checked} flows"
    );
}

#[test]
fn golden_and_or_peers() {
    golden("and_or_peers");
}

#[test]
fn golden_ipblock_except() {
    golden("ipblock_except");
}

#[test]
fn golden_named_ports() {
    golden("named_ports");
}

#[test]
fn golden_endport() {
    golden("endport");
}

#[test]
fn golden_empty_vs_absent() {
    golden("empty_vs_absent");
}

#[test]
fn golden_node_tunnels() {
    golden("node_tunnels");
}
