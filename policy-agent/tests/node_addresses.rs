//! The node's own addresses as the agent reads them (always allowed to
//! reach its pods): kube-proxy's IPVS mode binds every Service address to
//! the `kube-ipvs0` dummy device, and those must never be taken for the
//! node's (every Service would then be reachable despite egress
//! isolation). Needs root: a network namespace of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::IpAddr;

use policy_agent::{netlink, sim::NetNs};

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
    let found = ns
        .spawn(netlink::local_addresses)
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
        .unwrap();
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
    let found = ns
        .spawn(netlink::local_addresses)
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(found.contains(&ip("10.96.0.10")), "{found:?}");
}
