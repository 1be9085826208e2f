//! The node as the agent reads it. Its own addresses (always allowed to
//! reach its pods): kube-proxy's IPVS mode binds every Service address to
//! the `kube-ipvs0` dummy device, and those must never be taken for the
//! node's (every Service would then be reachable despite egress
//! isolation). And each pod's interface: found by the pod's own route,
//! never by a route the uplink shares. Needs root: network namespaces of
//! its own.
use std::{collections::BTreeMap, net::IpAddr};

use policy_agent::{
    cluster::PodRef,
    datapath::{Interface, resolve_interfaces},
    netlink,
};
use policy_testbed::NetNs;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn service_addresses_on_kube_ipvs0_are_not_the_nodes() {
    let ns = NetNs::create("pa-nodeaddr").unwrap();
    for (dev, addrs) in [
        ("uplink0", ["192.168.77.1/24", "fd00:77::1/64"]),
        (netlink::IPVS_DUMMY, ["10.96.0.10/32", "fd00:96::10/128"]),
    ] {
        // A veth stands in for the dummy device (no dummy module here).
        let peer = format!("{}-p", &dev[..6]);
        ns.ip(&["link", "add", dev, "type", "veth", "peer", "name", &peer])
            .unwrap();
        ns.ip(&["link", "set", &peer, "up"]).unwrap();
        for a in addrs {
            ns.ip(&["addr", "add", a, "dev", dev, "nodad"]).unwrap();
        }
        ns.ip(&["link", "set", dev, "up"]).unwrap();
    }
    // The node's addresses as the agent reads them inside `ns`.
    let local_addresses = || {
        ns.spawn(netlink::local_addresses)
            .unwrap()
            .join()
            .unwrap()
            .unwrap()
            .unwrap()
    };
    let found = local_addresses();
    assert_eq!(
        found,
        vec![ip("192.168.77.1"), ip("fd00:77::1")],
        "the uplink's addresses, not the Service addresses on {}",
        netlink::IPVS_DUMMY
    );
    // The same interface under another name is the node's: the exclusion is
    // by kube-proxy's name for it, nothing wider.
    ns.ip(&["link", "set", netlink::IPVS_DUMMY, "down"])
        .unwrap();
    ns.ip(&["link", "set", netlink::IPVS_DUMMY, "name", "dummy-other"])
        .unwrap();
    ns.ip(&["link", "set", "dummy-other", "up"]).unwrap();
    let found = local_addresses();
    assert!(found.contains(&ip("10.96.0.10")), "{found:?}");
}

/// Before a pod's own route exists, its address matches the node's
/// on-link default route out of the uplink (a kind node's eth0 is a veth
/// too): attaching the pod's programs there would judge the whole node's
/// traffic as that pod's. Only a host route of the pod's own counts.
#[test]
fn a_pod_interface_is_found_by_its_own_route_only() {
    let ns = NetNs::create("pa-podif").unwrap();
    for (dev, peer) in [("uplink0", "uplink1"), ("pod-a", "pod-a-p")] {
        ns.ip(&["link", "add", dev, "type", "veth", "peer", "name", peer])
            .unwrap();
        ns.ip(&["link", "set", peer, "up"]).unwrap();
        ns.ip(&["link", "set", dev, "up"]).unwrap();
    }
    for cmd in [
        "addr add 192.168.77.1/32 dev uplink0",
        "addr add fd00:77::1/128 dev uplink0 nodad",
        "route add 0.0.0.0/0 dev uplink0",
        "route add ::/0 dev uplink0",
    ] {
        ns.ip(&cmd.split(' ').collect::<Vec<_>>()).unwrap();
    }
    let pod = PodRef::new("alpha", "a");
    let pods: BTreeMap<PodRef, Vec<IpAddr>> =
        [(pod.clone(), vec![ip("10.244.9.10"), ip("fd00:244:9::10")])].into();
    let resolve = |pods: &BTreeMap<PodRef, Vec<IpAddr>>| {
        let pods = pods.clone();
        ns.spawn(move || resolve_interfaces(&pods))
            .unwrap()
            .join()
            .unwrap()
            .unwrap()
    };

    // Only the default route (and then a subnet route on the pod's own
    // veth, which other addresses share too): not found, and said why.
    for routes in [
        vec![],
        vec![
            "route add 10.244.9.0/24 dev pod-a",
            "route add fd00:244:9::/64 dev pod-a",
        ],
    ] {
        for cmd in routes {
            ns.ip(&cmd.split(' ').collect::<Vec<_>>()).unwrap();
        }
        let (found, problems) = resolve(&pods);
        assert!(found.is_empty(), "attached to {found:?}");
        assert!(
            problems
                .iter()
                .any(|p| p.to_string().contains("no route of its own")),
            "{problems:?}"
        );
    }

    // Its own host routes: found on its veth.
    for cmd in [
        "route add 10.244.9.10/32 dev pod-a",
        "route add fd00:244:9::10/128 dev pod-a",
    ] {
        ns.ip(&cmd.split(' ').collect::<Vec<_>>()).unwrap();
    }
    let (found, problems) = resolve(&pods);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        found.get(&pod).map(|i: &Interface| i.name.as_str()),
        Some("pod-a")
    );
}
