//! prevResult shapes, taken from what Debian 12's ptp 1.1.1 prints, and
//! the spec's other shapes.
use serde_json::{Value, json};

use super::*;

/// ptp, `"cniVersion":"1.0.0"`, dual stack.
const PTP_1_0_0: &str = r#"{
    "cniVersion": "1.0.0",
    "interfaces": [
        { "name": "veth88e6c2fe", "mac": "2a:2f:78:d2:16:3b" },
        { "name": "eth0", "mac": "be:0d:80:98:52:90", "sandbox": "/var/run/netns/probe-c" }
    ],
    "ips": [
        { "interface": 1, "address": "10.244.1.2/24", "gateway": "10.244.1.1" },
        { "interface": 1, "address": "fd00:10:244:1::2/64", "gateway": "fd00:10:244:1::1" }
    ],
    "routes": [ { "dst": "0.0.0.0/0" }, { "dst": "::/0" } ],
    "dns": {}
}"#;

/// The same plugin with `"cniVersion":"0.4.0"`: `version` before `interface`.
const PTP_0_4_0: &str = r#"{
    "cniVersion": "0.4.0",
    "interfaces": [
        { "name": "veth88e6c2fe", "mac": "2a:2f:78:d2:16:3b" },
        { "name": "eth0", "mac": "be:0d:80:98:52:90", "sandbox": "/var/run/netns/probe-c" }
    ],
    "ips": [
        { "version": "4", "interface": 1, "address": "10.244.1.2/24", "gateway": "10.244.1.1" },
        { "version": "6", "interface": 1, "address": "fd00:10:244:1::2/64", "gateway": "fd00:10:244:1::1" }
    ],
    "routes": [ { "dst": "0.0.0.0/0" }, { "dst": "::/0" } ],
    "dns": {}
}"#;

/// kindnet's list (0.3.1): ptp then portmap, single stack; portmap passes
/// ptp's result through.
const KINDNET_0_3_1: &str = r#"{"cniVersion":"0.3.1","interfaces":[{"name":"veth1a2b3c4d","mac":"6e:0a:11:22:33:44"},
 {"name":"eth0","mac":"aa:0a:11:22:33:55","sandbox":"/var/run/netns/cni-0b1d"}],
 "ips":[{"version":"4","interface":1,"address":"10.244.0.5/24","gateway":"10.244.0.1"}],
 "routes":[{"dst":"0.0.0.0/0"}],"dns":{}}"#;

/// A delegated IPAM result: no interfaces, no `ips[].interface`.
const IPAM_ONLY: &str =
    r#"{"cniVersion":"1.0.0","ips":[{"address":"10.1.2.3/16","gateway":"10.1.0.1"}],"dns":{}}"#;

/// bridge: the bridge and the host veth both lack a sandbox.
const BRIDGE: &str = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"cni0","mac":"01:02:03:04:05:06"},
 {"name":"veth0badc0de","mac":"01:02:03:04:05:07"},
 {"name":"eth0","mac":"01:02:03:04:05:08","sandbox":"/var/run/netns/b"}],
 "ips":[{"interface":2,"address":"10.22.0.7/16","gateway":"10.22.0.1"}]}"#;

/// 1.1.0's additions (mtu, socketPath, route attributes) and a second
/// container interface (Multus-like) whose address is not ours.
const V1_1_0: &str = r#"{"cniVersion":"1.1.0","interfaces":[{"name":"vethX","mtu":1450,"sandbox":""},
 {"name":"eth0","sandbox":"/run/netns/c","mtu":1450,"socketPath":"/x"},
 {"name":"net1","sandbox":"/run/netns/c"}],
 "ips":[{"interface":1,"address":"10.9.0.2/24"},{"interface":2,"address":"192.168.77.2/24"}],
 "routes":[{"dst":"0.0.0.0/0","mtu":1400,"table":100,"scope":0}]}"#;

fn v(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter()
        .map(|s| s.parse().unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

#[test]
fn ptp_results_of_every_version_give_the_veth_and_both_addresses() {
    for text in [PTP_1_0_0, PTP_0_4_0] {
        let prev = v(text);
        let c = container_interface(&prev, "eth0", Some("/var/run/netns/probe-c"));
        assert_eq!(c, Some(1));
        assert_eq!(host_candidates(&prev), ["veth88e6c2fe"]);
        assert_eq!(
            pod_ips(&prev, c),
            Ok(ips(&["10.244.1.2", "fd00:10:244:1::2"]))
        );
    }
    let prev = v(KINDNET_0_3_1);
    let c = container_interface(&prev, "eth0", Some("/var/run/netns/cni-0b1d"));
    assert_eq!(host_candidates(&prev), ["veth1a2b3c4d"]);
    assert_eq!(pod_ips(&prev, c), Ok(ips(&["10.244.0.5"])));
}

#[test]
fn the_container_entry_is_found_when_the_netns_path_is_spelled_differently() {
    let prev = v(PTP_1_0_0);
    assert_eq!(
        container_interface(&prev, "eth0", Some("/run/netns/probe-c")),
        Some(1)
    );
    assert_eq!(
        container_interface(&prev, "eth1", Some("/var/run/netns/probe-c")),
        None
    );
    // A host-side interface named like the container's is never it.
    let odd = json!({"interfaces":[{"name":"eth0"}]});
    assert_eq!(container_interface(&odd, "eth0", None), None);
}

#[test]
fn ipam_only_results_give_every_address_and_no_host_candidate() {
    let prev = v(IPAM_ONLY);
    let c = container_interface(&prev, "eth0", Some("/run/netns/x"));
    assert_eq!(c, None);
    assert!(host_candidates(&prev).is_empty());
    assert_eq!(pod_ips(&prev, c), Ok(ips(&["10.1.2.3"])));
}

#[test]
fn bridge_results_have_two_host_candidates() {
    let prev = v(BRIDGE);
    let c = container_interface(&prev, "eth0", Some("/var/run/netns/b"));
    assert_eq!(c, Some(2));
    assert_eq!(host_candidates(&prev), ["cni0", "veth0badc0de"]);
    assert_eq!(pod_ips(&prev, c), Ok(ips(&["10.22.0.7"])));
}

#[test]
fn only_the_container_interfaces_addresses_are_the_pods() {
    let prev = v(V1_1_0);
    let c = container_interface(&prev, "eth0", Some("/run/netns/c"));
    assert_eq!(c, Some(1));
    assert_eq!(
        host_candidates(&prev),
        ["vethX"],
        "an empty sandbox is the host"
    );
    assert_eq!(pod_ips(&prev, c), Ok(ips(&["10.9.0.2"])));
    // Not knowing the container entry: every sandboxed interface's.
    assert_eq!(pod_ips(&prev, None), Ok(ips(&["10.9.0.2", "192.168.77.2"])));
}

#[test]
fn a_bad_address_is_an_invalid_result() {
    let prev = json!({"ips":[{"address":"10.0.0.300/24"}]});
    assert_eq!(pod_ips(&prev, None).map_err(|e| e.code), Err(7));
    assert_eq!(pod_ips(&json!({}), None), Ok(vec![]));
}

#[test]
fn converting_to_the_same_version_changes_nothing() {
    for (text, version) in [
        (PTP_1_0_0, "1.0.0"),
        (PTP_0_4_0, "0.4.0"),
        (KINDNET_0_3_1, "0.3.1"),
        (V1_1_0, "1.1.0"),
    ] {
        assert_eq!(convert(&v(text), version), Ok(v(text)), "{version}");
    }
}

#[test]
fn converting_between_shapes_adds_or_drops_ip_versions() {
    let down = convert(&v(PTP_1_0_0), "0.4.0").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down, v(PTP_0_4_0));
    let up = convert(&v(PTP_0_4_0), "1.0.0").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(up, v(PTP_1_0_0));
    // Same shape, other label: only cniVersion changes.
    let relabel = convert(&v(PTP_0_4_0), "0.3.1").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(relabel["cniVersion"], "0.3.1");
    assert_eq!(relabel["ips"], v(PTP_0_4_0)["ips"]);
    // No cniVersion in prevResult: taken to be the config's.
    let bare = json!({"ips":[{"address":"10.0.0.1/8"}]});
    assert_eq!(
        convert(&bare, "1.0.0"),
        Ok(json!({"cniVersion":"1.0.0","ips":[{"address":"10.0.0.1/8"}]}))
    );
}

#[test]
fn results_of_versions_without_chaining_are_refused() {
    let old = json!({"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.2/24"}});
    let e = convert(&old, "1.0.0").unwrap_err();
    assert_eq!(e.code, 1);
    assert!(e.details.starts_with("prevResult"), "{e}");
}
