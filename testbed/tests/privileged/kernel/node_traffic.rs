//! What counts as node traffic, and who sent a packet reaching a pod, on
//! the real kernel through BPF_PROG_TEST_RUN: a pod's packet something
//! masqueraded on the way is still that pod's; a node address that entered
//! the node at an uplink or a tunnel is not the node's; a local pod's
//! address enters the node only at its own interface; an encapsulation a
//! pod sends to its node is not node traffic; neighbour-discovery types
//! pass a pod's egress only where they cannot leave the link. Every case
//! marked so passed the classifier before (the hole it closes).

use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction::{EGRESS, INGRESS},
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    identity::{FIRST_CIDR, NODE, WORLD},
    policy::PolicyKey,
    proto::{ANY as ANY_PROTO, TCP},
    verdict::Reason::{self, *},
};
use policy_testbed::fixtures::harness::{
    Harness, TEST_IFINDEX,
    Verdict::{self, Drop, Pass},
    ip,
};
use policy_testbed::packet::{L4, Packet, TCP_ACK, TCP_SYN};

const POD: u32 = 300;
const CLIENT: u32 = 301;
const TRUSTED: u32 = 302;
/// Another local pod's interface (the client's).
const CLIENT_IF: u32 = 7;
/// The trusted pod's interface (it holds 10.0.2.30 there).
const TRUSTED_IF: u32 = 9;
/// An interface that is no pod's: an uplink, a tunnel.
const UPLINK_IF: u32 = 30;
/// The class of 192.168.0.0/16, the node's network.
const NODE_NET: u32 = FIRST_CIDR + 5;
const BOTH: u32 = ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED;

/// The pod (10.0.0.10, fd00::10, isolated both ways, reachable on TCP 80
/// from the trusted pod only), a client pod at another interface
/// (10.0.1.20, fd00::20), the trusted pod (10.0.2.30), the node
/// (192.168.0.1, fd00:ff::1).
fn node(flags: u32) -> Harness {
    let mut h = Harness::new();
    h.endpoint(POD, flags, 1);
    h.endpoint_at(CLIENT_IF, CLIENT, 0, 1, &[ip("10.0.1.20"), ip("fd00::20")]);
    h.ipcache("10.0.0.10/32", POD, WORLD);
    h.ipcache("fd00::10/128", POD, WORLD);
    h.ipcache("10.0.1.20/32", CLIENT, WORLD);
    h.ipcache("fd00::20/128", CLIENT, WORLD);
    h.ipcache("10.0.2.30/32", TRUSTED, WORLD);
    h.ipcache("192.168.0.0/16", 0, NODE_NET);
    h.ipcache("192.168.0.1/32", NODE, NODE_NET);
    h.ipcache("fd00:ff::1/128", NODE, WORLD);
    h.allow(PolicyKey::new(POD, INGRESS, TRUSTED, TCP, 16, 80));
    h.sync();
    h.enforce("10.0.2.30", Some(TRUSTED_IF));
    h.enforce("10.0.1.20", Some(CLIENT_IF));
    h
}

fn syn(src: &str, dst: &str) -> Vec<u8> {
    Packet::tcp(ip(src), 40000, ip(dst), 80, TCP_SYN).frame()
}

/// A row of [`check_arrivals`]: label, frame, the interface it entered
/// the node at, the expected verdict and reason.
type ArrivalRow<'a> = (&'a str, &'a [u8], u32, (Verdict, Reason));

/// Runs `rows` at the pod's ingress hook, and asserts once, naming every
/// wrong row.
#[track_caller]
fn check_arrivals(h: &mut Harness, rows: &[ArrivalRow<'_>]) {
    let wrong: Vec<String> = rows
        .iter()
        .filter_map(|(label, frame, iif, want)| {
            let got = h.run_reason_from(Hook::Egress, frame, *iif);
            (got != *want)
                .then(|| format!("{label} (entered at {iif}): want {want:?}, got {got:?}"))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} rows differ:\n{}",
        wrong.len(),
        rows.len(),
        wrong.join("\n")
    );
}

#[test]
fn a_masqueraded_pod_is_judged_as_itself_and_a_forwarded_node_address_is_no_node() {
    let mut h = node(BOTH);
    let from_node = syn("192.168.0.1", "10.0.0.10");
    check_arrivals(
        &mut h,
        &[
            // Kubelet's probe: the node itself sent it.
            ("the node", &from_node, 0, (Pass, AllowNode)),
            // Was AllowNode: kube-proxy's mark-and-masquerade for a
            // NodePort made the client look like the node.
            (
                "the client, masqueraded",
                &from_node,
                CLIENT_IF,
                (Drop, DropPolicy),
            ),
            // Was AllowNode: the node's address arriving from outside.
            (
                "a node address through the uplink",
                &from_node,
                UPLINK_IF,
                (Drop, DropPolicy),
            ),
            // Its own packet back through its Service.
            (
                "itself, hairpinned",
                &from_node,
                TEST_IFINDEX,
                (Pass, AllowSelf),
            ),
        ],
    );
    // The trusted pod, masqueraded: admitted as itself.
    h.endpoint_at(TRUSTED_IF, TRUSTED, 0, 1, &[ip("10.0.2.30")]);
    h.sync();
    check_arrivals(
        &mut h,
        &[(
            "the trusted pod, masqueraded",
            &syn("192.168.0.1", "10.0.0.10"),
            TRUSTED_IF,
            (Pass, AllowPolicy),
        )],
    );
}

#[test]
fn a_masqueraded_flow_is_judged_again_as_its_pod_when_the_policy_changes() {
    let mut h = node(BOTH);
    h.endpoint_at(TRUSTED_IF, TRUSTED, 0, 1, &[ip("10.0.2.30")]);
    h.sync();
    let syn = Packet::tcp(ip("192.168.0.1"), 40001, ip("10.0.0.10"), 80, TCP_SYN).frame();
    let ack = Packet::tcp(ip("192.168.0.1"), 40001, ip("10.0.0.10"), 80, TCP_ACK).frame();
    check_arrivals(
        &mut h,
        &[
            ("opened", &syn, TRUSTED_IF, (Pass, AllowPolicy)),
            ("continued", &ack, TRUSTED_IF, (Pass, AllowEstablished)),
        ],
    );
    // The trusted pod is no longer admitted: the flow is cut, though its
    // packets wear the node's address (was: judged again as the node's).
    h.state.policy.clear();
    let mut ep = h.state.endpoints[&TEST_IFINDEX];
    ep.revision += 1;
    h.state.endpoints.insert(TEST_IFINDEX, ep);
    h.sync();
    check_arrivals(
        &mut h,
        &[(
            "after the change",
            &ack,
            TRUSTED_IF,
            (Drop, DropPolicyChanged),
        )],
    );
}

#[test]
fn a_local_pods_address_enters_the_node_only_at_its_own_interface() {
    let mut h = node(BOTH);
    let forged = syn("10.0.2.30", "10.0.0.10");
    check_arrivals(
        &mut h,
        &[
            // Was AllowPolicy: an inner packet a tunnel device
            // decapsulated, wearing the trusted pod's address.
            ("from a tunnel", &forged, UPLINK_IF, (Drop, DropSpoofed)),
            (
                "from the trusted pod",
                &forged,
                TRUSTED_IF,
                (Pass, AllowPolicy),
            ),
        ],
    );
}

#[test]
fn an_encapsulation_a_pod_sends_its_node_is_not_node_traffic() {
    let inner = || Box::new(Packet::udp(ip("10.0.2.30"), 40000, ip("10.0.0.11"), 9000));
    let pod = ip("10.0.0.10");
    let node_ip = ip("192.168.0.1");
    let to_node = |l4: L4| Packet::new(pod, node_ip, l4).frame();
    let ipip = to_node(L4::Tunnel {
        gre: false,
        inner: inner(),
    });
    let gre = to_node(L4::Tunnel {
        gre: true,
        inner: inner(),
    });
    let vxlan = |dport| {
        to_node(L4::Vxlan {
            sport: 41000,
            dport,
            vni: 1,
            inner: inner(),
        })
    };
    let (vxlan_iana, vxlan_linux, geneve, other_udp) =
        (vxlan(4789), vxlan(8472), vxlan(6081), vxlan(4790));
    let tcp = Packet::tcp(pod, 40000, node_ip, 10250, TCP_SYN).frame();
    let mut h = node(BOTH);
    // Was AllowNode for each: decapsulated, the inner packet travels on
    // with a source the pod chose.
    h.check(&[
        ("IP-in-IP", Hook::Ingress, &ipip, (Drop, DropPolicy)),
        ("GRE", Hook::Ingress, &gre, (Drop, DropPolicy)),
        ("VXLAN", Hook::Ingress, &vxlan_iana, (Drop, DropPolicy)),
        (
            "VXLAN, Linux port",
            Hook::Ingress,
            &vxlan_linux,
            (Drop, DropPolicy),
        ),
        ("GENEVE", Hook::Ingress, &geneve, (Drop, DropPolicy)),
        (
            "another UDP port",
            Hook::Ingress,
            &other_udp,
            (Pass, AllowNode),
        ),
        ("TCP to the node", Hook::Ingress, &tcp, (Pass, AllowNode)),
    ]);
    // Judged as any peer: an ipBlock over the node's network admits it.
    h.allow(PolicyKey::new(POD, EGRESS, NODE_NET, ANY_PROTO, 0, 0));
    h.sync();
    h.check(&[(
        "IP-in-IP, allowed",
        Hook::Ingress,
        &ipip,
        (Pass, AllowPolicy),
    )]);
    // A pod no policy isolates may send it (judged, not node traffic).
    let mut h = node(0);
    h.check(&[(
        "IP-in-IP, not isolated",
        Hook::Ingress,
        &ipip,
        (Pass, AllowNotIsolated),
    )]);
}

#[test]
fn neighbour_discovery_types_pass_a_pods_egress_only_on_the_link() {
    let nd = |src: &str, dst: &str, kind: u8, hop_limit: u8| {
        let mut p = Packet::new(ip(src), ip(dst), L4::Icmp { kind });
        p.hop_limit = hop_limit;
        p.frame()
    };
    let mut h = node(BOTH);
    let own = "fd00::10";
    let solicited = nd(own, "ff02::1:ff00:20", 135, 255);
    let router = nd("fe80::10", "ff02::2", 133, 255);
    let dad = nd("::", "ff02::1:ff00:10", 135, 255);
    let unreachability = nd(own, "fe80::1", 135, 255);
    let to_global = nd(own, "fd00::20", 135, 255);
    let spoofed = nd("fd00::99", "fd00::20", 136, 255);
    let wide_multicast = nd(own, "ff0e::1", 136, 255);
    let from_node = nd("fd00:ff::1", own, 135, 255);
    let routed = nd("fd00::20", own, 135, 64);
    h.check(&[
        (
            "to its solicited-node group",
            Hook::Ingress,
            &solicited,
            (Pass, AllowNeighborDiscovery),
        ),
        (
            "a router solicitation",
            Hook::Ingress,
            &router,
            (Pass, AllowNeighborDiscovery),
        ),
        (
            "duplicate address detection",
            Hook::Ingress,
            &dad,
            (Pass, AllowNeighborDiscovery),
        ),
        (
            "to its gateway",
            Hook::Ingress,
            &unreachability,
            (Pass, AllowNeighborDiscovery),
        ),
        // Was AllowNeighborDiscovery: the node forwards these.
        (
            "to a global address",
            Hook::Ingress,
            &to_global,
            (Drop, DropPolicy),
        ),
        (
            "with another's source",
            Hook::Ingress,
            &spoofed,
            (Drop, DropSpoofed),
        ),
        (
            "to global-scope multicast",
            Hook::Ingress,
            &wide_multicast,
            (Drop, DropPolicy),
        ),
        // At the pod's ingress hop limit 255 proves the node sent it.
        (
            "the node's probe",
            Hook::Egress,
            &from_node,
            (Pass, AllowNeighborDiscovery),
        ),
        ("routed", Hook::Egress, &routed, (Drop, DropPolicy)),
    ]);
}
