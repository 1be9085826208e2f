//! The stand-in's rules against kube-proxy's own output for the same
//! Services, once loaded into a kernel (`testdata/`), and the
//! traffic-policy cases against upstream's rule grammar.
use std::collections::{BTreeMap, BTreeSet};

use policy_common::proto::TCP;

use super::*;
use policy_agent::cluster::{
    Endpoint, EndpointSliceInfo, ObjectRef, ServiceInfo, ServicePort, SlicePort,
};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn endpoint(addr: &str, node: &str) -> Endpoint {
    Endpoint {
        address: ip(addr),
        ready: true,
        serving: true,
        terminating: false,
        node: Some(node.into()),
        pod: None,
    }
}

/// `default/web` (http TCP 80, NodePort 30080) with `endpoints`, and
/// `default/empty` (http TCP 80) without any.
fn state(endpoints: &[(&str, &str)]) -> ClusterState {
    let mut s = ClusterState::default();
    let port = ServicePort {
        name: "http".into(),
        protocol: TCP,
        port: 80,
        node_port: Some(30080),
    };
    s.services.insert(
        ObjectRef::new("default", "web"),
        ServiceInfo {
            cluster_ips: vec![ip("10.96.0.50")],
            ports: vec![port.clone()],
            ..Default::default()
        },
    );
    s.services.insert(
        ObjectRef::new("default", "empty"),
        ServiceInfo {
            cluster_ips: vec![ip("10.96.0.60")],
            ports: vec![ServicePort {
                node_port: None,
                ..port
            }],
            ..Default::default()
        },
    );
    s.endpoint_slices.insert(
        ObjectRef::new("default", "web-abc"),
        EndpointSliceInfo {
            service: Some(ObjectRef::new("default", "web")),
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: TCP,
                port: 8080,
            }],
            endpoints: endpoints.iter().map(|(a, n)| endpoint(a, n)).collect(),
            unreadable: Vec::new(),
        },
    );
    s
}

fn config() -> ProxyConfig {
    ProxyConfig {
        node_name: "node-1".into(),
        node_ips: vec![ip("192.168.200.1")],
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
    }
}

/// table → (chain declarations, rules per chain in order).
type Tables = BTreeMap<String, (BTreeSet<String>, BTreeMap<String, Vec<String>>)>;

fn restore_tables(text: &str) -> Tables {
    let mut out = Tables::new();
    let mut table = String::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_owned();
            out.entry(table.clone()).or_default();
        } else if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap().to_owned();
            out.get_mut(&table).unwrap().0.insert(name);
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, rest) = rule.split_once(' ').unwrap();
            out.get_mut(&table)
                .unwrap()
                .1
                .entry(chain.to_owned())
                .or_default()
                .push(rest.to_owned());
        } else {
            assert_eq!(line, "COMMIT", "unexpected line {line:?}");
        }
    }
    out
}

#[test]
fn iptables_rules_are_upstreams_own() {
    let s = state(&[
        ("10.244.1.2", "node-1"),
        ("10.244.2.7", "node-2"),
        ("10.244.1.10", "node-1"),
    ]);
    let ours = render(ProxyMode::Iptables, &config(), &s, Family::V4)
        // upstream formats the mark with %#08x; the upstream file has 0x4000.
        .replace("0x004000", "0x4000")
        // The stand-in runs with --iptables-localhost-nodeports=false;
        // the upstream file is the default without nfacct.
        .replace(" ! -d 127.0.0.0/8 -j KUBE-NODEPORTS", " -j KUBE-NODEPORTS");
    let upstream = include_str!("testdata/upstream_iptables.txt");
    assert_eq!(restore_tables(&ours), restore_tables(upstream), "\n{ours}");
}

#[test]
fn nft_rules_are_upstreams_own() {
    let s = state(&[("10.244.2.7", "node-2"), ("10.244.1.2", "node-1")]);
    let ours = render(ProxyMode::Nftables, &config(), &s, Family::V4).replace("0x004000", "0x4000");
    let upstream = include_str!("testdata/upstream_nft.txt");
    let lines = |t: &str, pred: &dyn Fn(&str) -> bool| -> Vec<String> {
        t.lines()
            .map(str::trim)
            .filter(|l| pred(l))
            .map(str::to_owned)
            .collect()
    };
    let ours_all: BTreeSet<String> = lines(&ours, &|l| !l.is_empty()).into_iter().collect();
    // Every table, chain, set and map upstream declares, as declared.
    for l in lines(upstream, &|l| l.starts_with("add ")) {
        assert!(ours_all.contains(&l), "missing {l:?} in\n{ours}");
    }
    // The same rules and elements, in the same order per chain.
    let rules = |t: &str| {
        let mut per_chain: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for l in lines(t, &|l| {
            l.starts_with("add rule ") || l.starts_with("add element ")
        }) {
            let words: Vec<&str> = l.split_whitespace().collect();
            per_chain
                .entry(format!("{} {}", words[1], words[4]))
                .or_default()
                .push(l.clone());
        }
        // Elements of a set have no order.
        for (k, v) in per_chain.iter_mut() {
            if k.starts_with("element ") {
                v.sort();
            }
        }
        per_chain
    };
    assert_eq!(rules(&ours), rules(upstream), "\n{ours}");
    // Every chain exists before anything names it.
    let mut declared = BTreeSet::new();
    for l in ours.lines() {
        let words: Vec<&str> = l.split_whitespace().collect();
        if words.len() > 4 && words[0] == "add" && words[1] == "chain" {
            declared.insert(words[4].to_owned());
        }
        for (i, w) in words.iter().enumerate() {
            if (*w == "goto" || *w == "jump") && i + 1 < words.len() {
                assert!(
                    declared.contains(words[i + 1]),
                    "{l}: {} not declared yet",
                    words[i + 1]
                );
            }
        }
    }
}

fn local_service(internal_local: bool, external_local: bool, eps: &[(&str, &str)]) -> ClusterState {
    let mut s = state(eps);
    let web = s
        .services
        .get_mut(&ObjectRef::new("default", "web"))
        .unwrap();
    web.internal_local = internal_local;
    web.external_local = external_local;
    web.external_ips = vec![ip("192.0.2.10")];
    s
}

#[test]
fn traffic_policies_and_missing_endpoints_follow_upstream() {
    // externalTrafficPolicy Local with a local endpoint: pod traffic
    // short-circuits to the cluster chain, host traffic is masqueraded,
    // the rest goes to the local chain (no SNAT).
    let s = local_service(
        false,
        true,
        &[("10.244.1.2", "node-1"), ("10.244.2.7", "node-2")],
    );
    let ours = render(ProxyMode::Iptables, &config(), &s, Family::V4);
    let t = restore_tables(&ours);
    let nat = &t["nat"].1;
    let svc = format!("KUBE-SVC-{}", port_proto_hash("default/web:http", "tcp"));
    let svl = format!("KUBE-SVL-{}", port_proto_hash("default/web:http", "tcp"));
    let ext = format!("KUBE-EXT-{}", port_proto_hash("default/web:http", "tcp"));
    assert_eq!(
        nat[&ext],
        [
            format!("-m comment --comment \"pod traffic for default/web:http external destinations\" -s 10.244.0.0/16 -j {svc}"),
            "-m comment --comment \"masquerade LOCAL traffic for default/web:http external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ".to_owned(),
            format!("-m comment --comment \"route LOCAL traffic for default/web:http external destinations\" -m addrtype --src-type LOCAL -j {svc}"),
            format!("-j {svl}"),
        ]
    );
    assert_eq!(nat[&svl].len(), 1, "one local endpoint: {:?}", nat[&svl]);
    assert_eq!(
        nat[&svc].len(),
        3,
        "masq rule and two endpoints: {:?}",
        nat[&svc]
    );
    assert!(nat["KUBE-SERVICES"].iter().any(
        |r| r.contains("\"default/web:http external IP\"") && r.ends_with(&format!("-j {ext}"))
    ));

    // Local without local endpoints: external traffic dropped in filter,
    // the EXT chain keeps its short circuits and no fall-through.
    let s = local_service(false, true, &[("10.244.2.7", "node-2")]);
    let t = restore_tables(&render(ProxyMode::Iptables, &config(), &s, Family::V4));
    let filter = &t["filter"].1;
    assert!(
        filter["KUBE-EXTERNAL-SERVICES"]
            .iter()
            .any(|r| r.contains("has no local endpoints")
                && r.contains("--dport 30080")
                && r.ends_with("-j DROP"))
    );
    assert!(
        filter["KUBE-EXTERNAL-SERVICES"]
            .iter()
            .any(|r| r.contains("-d 192.0.2.10") && r.ends_with("-j DROP"))
    );
    assert_eq!(t["nat"].1[&ext].len(), 3);
    assert!(!t["nat"].0.contains(&svl));

    // internalTrafficPolicy Local without local endpoints: the ClusterIP
    // is dropped; with no endpoints at all everything is rejected.
    let s = local_service(true, false, &[("10.244.2.7", "node-2")]);
    let t = restore_tables(&render(ProxyMode::Iptables, &config(), &s, Family::V4));
    assert!(t["filter"].1["KUBE-SERVICES"].iter().any(|r| {
        r.contains("\"default/web:http has no local endpoints\"")
            && r.contains("-d 10.96.0.50")
            && r.ends_with("-j DROP")
    }));
    let s = local_service(false, false, &[]);
    let t = restore_tables(&render(ProxyMode::Iptables, &config(), &s, Family::V4));
    let filter = &t["filter"].1;
    assert!(
        filter["KUBE-SERVICES"].iter().any(
            |r| r.contains("\"default/web:http has no endpoints\"") && r.ends_with("-j REJECT")
        )
    );
    assert!(
        filter["KUBE-EXTERNAL-SERVICES"]
            .iter()
            .any(|r| r
                .contains("-m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j REJECT"))
    );
    assert!(!t["nat"].1.contains_key(&ext));

    // The same cases in nftables mode.
    let s = local_service(
        false,
        true,
        &[("10.244.1.2", "node-1"), ("10.244.2.7", "node-2")],
    );
    let nft = render(ProxyMode::Nftables, &config(), &s, Family::V4);
    let base = nft_service_base("default", "web", "tcp", "http");
    assert!(nft.contains(&format!("add rule ip kube-proxy external-{base} ip saddr 10.244.0.0/16 goto service-{base} comment \"short-circuit pod traffic\"")));
    assert!(nft.contains(&format!(
        "add rule ip kube-proxy external-{base} goto local-{base}"
    )));
    assert!(nft.contains(&format!(
        "add element ip kube-proxy service-ips {{ 192.0.2.10 . tcp . 80 : goto external-{base} }}"
    )));
    let s = local_service(true, false, &[("10.244.2.7", "node-2")]);
    let nft = render(ProxyMode::Nftables, &config(), &s, Family::V4);
    assert!(nft.contains("add element ip kube-proxy no-endpoint-services { 10.96.0.50 . tcp . 80 comment \"default/web:http\" : drop }"));
}

#[test]
fn families_are_kept_apart() {
    let mut s = state(&[("10.244.1.2", "node-1"), ("fd00:244:1::2", "node-1")]);
    let web = s
        .services
        .get_mut(&ObjectRef::new("default", "web"))
        .unwrap();
    web.cluster_ips.push(ip("fd00:96::50"));
    let mut c = config();
    c.node_ips.push(ip("fd00:ffff::1"));
    c.cluster_cidrs.push("fd00:244::/32".parse().unwrap());
    let v6 = render(ProxyMode::Iptables, &c, &s, Family::V6);
    assert!(v6.contains("-d fd00:96::50 --dport 80"), "{v6}");
    assert!(v6.contains("--to-destination [fd00:244:1::2]:8080"), "{v6}");
    assert!(v6.contains("! -s fd00:244::/32 -j KUBE-MARK-MASQ"), "{v6}");
    assert!(v6.contains("! -d ::1/128 -j KUBE-NODEPORTS"), "{v6}");
    assert!(!v6.contains("10.244.1.2"), "{v6}");
    // default/empty has no IPv6 ClusterIP: not in the IPv6 proxier.
    assert!(!v6.contains("default/empty"), "{v6}");
    let sep = endpoint_hash("default/web:http", "tcp", "[fd00:244:1::2]:8080");
    assert!(v6.contains(&format!("KUBE-SEP-{sep}")));
    let nft6 = render(ProxyMode::Nftables, &c, &s, Family::V6);
    assert!(nft6.contains("add table ip6 kube-proxy"));
    assert!(
        nft6.contains(
            "ip6 daddr fd00:96::50 tcp dport 80 ip6 saddr != fd00:244::/32 jump mark-for-masquerade"
        ),
        "{nft6}"
    );
    assert!(
        nft6.contains("meta l4proto tcp dnat to [fd00:244:1::2]:8080"),
        "{nft6}"
    );
    assert!(nft6.contains("__fd00.244.1..2/8080"), "{nft6}");
    assert!(!nft6.contains("10.96.0.0/12"), "{nft6}");
}
