//! The classifier on the real kernel through BPF_PROG_TEST_RUN, with
//! crafted packets for every branch. Needs root (CAP_BPF, CAP_NET_ADMIN).

use aya::maps::RingBuf;
use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction::{EGRESS, INGRESS},
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    event::FlowRecord,
    identity::{ANY, FIRST_CIDR, WORLD},
    policy::PolicyKey,
    proto::{ANY as ANY_PROTO, SCTP, TCP, UDP},
    verdict::Reason::{self, *},
};
use policy_testbed::fixtures::harness::{
    Harness, OTHER, PEER, POD, TEST_IFINDEX,
    Verdict::{self, Drop, Pass},
    ip,
};
use policy_testbed::packet::{Fragment, L4, Packet, TCP_ACK, TCP_FIN, TCP_SYN, ethernet};

const CLASS_A: u32 = FIRST_CIDR;
const CLASS_B: u32 = FIRST_CIDR + 1;
const BOTH: u32 = ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED;

/// A new harness holding [`Harness::cluster`].
fn cluster(flags: u32) -> Harness {
    let mut h = Harness::new();
    h.cluster(flags);
    h
}

fn to_pod(src: &str, sport: u16, dport: u16) -> Vec<u8> {
    Packet::tcp(ip(src), sport, ip("10.0.0.10"), dport, TCP_SYN).frame()
}

fn ingress_key(peer: u32, protocol: u8, len: u8, port: u16) -> PolicyKey {
    PolicyKey::new(POD, INGRESS, peer, protocol, len, port)
}

#[test]
fn allows_and_denies_by_peer_identity() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.sync();
    let peer = to_pod("10.0.1.20", 40000, 80);
    let other = to_pod("10.0.2.30", 40000, 80);
    // Unknown addresses are "world" and not allowed either.
    let world = to_pod("203.0.113.9", 40000, 80);
    h.check(&[
        ("the peer", Hook::Egress, &peer, (Pass, AllowPolicy)),
        ("another pod", Hook::Egress, &other, (Drop, DropPolicy)),
        ("world", Hook::Egress, &world, (Drop, DropPolicy)),
    ]);
}

#[test]
fn allows_only_the_listed_port() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.sync();
    let to = |port| to_pod("10.0.1.20", 40001, port);
    h.check(&[
        ("the port", Hook::Egress, &to(80), Pass),
        ("the port above", Hook::Egress, &to(81), Drop),
        ("the port below", Hook::Egress, &to(79), Drop),
    ]);
}

#[test]
fn port_range_prefixes_cover_exactly_the_range() {
    // 8000-8011 = 8000/14 (8000-8003) + 8004/14 (8004-8007) + 8008/14 (8008-8011)
    let mut h = cluster(BOTH);
    for start in [8000, 8004, 8008] {
        h.allow(ingress_key(PEER, TCP, 14, start));
    }
    h.sync();
    for (port, want) in [
        (7999, Verdict::Drop),
        (8000, Verdict::Pass),
        (8005, Verdict::Pass),
        (8011, Verdict::Pass),
        (8012, Verdict::Drop),
    ] {
        assert_eq!(
            h.run(Hook::Egress, &to_pod("10.0.1.20", 40000 + port, port)),
            want,
            "port {port}"
        );
    }
}

#[test]
fn a_tcp_rule_opens_neither_udp_nor_sctp() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 53));
    h.allow(ingress_key(PEER, SCTP, 16, 9000));
    h.sync();
    let peer = ip("10.0.1.20");
    let pod = ip("10.0.0.10");
    let tcp = |dport| Packet::tcp(peer, 1000, pod, dport, TCP_SYN).frame();
    let udp = |dport| Packet::udp(peer, 1000, pod, dport).frame();
    let sctp = |dport| Packet::new(peer, pod, L4::Sctp { sport: 1000, dport }).frame();
    h.check(&[
        ("TCP 53", Hook::Egress, &tcp(53), Pass),
        ("UDP 53", Hook::Egress, &udp(53), Drop),
        ("SCTP 53", Hook::Egress, &sctp(53), Drop),
        // SCTP is parsed (the kernel here has no SCTP: crafted packets only).
        ("SCTP 9000", Hook::Egress, &sctp(9000), Pass),
        ("SCTP 9001", Hook::Egress, &sctp(9001), Drop),
        ("TCP 9000", Hook::Egress, &tcp(9000), Drop),
    ]);
}

#[test]
fn any_protocol_entry_allows_icmp_and_every_port() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, ANY_PROTO, 0, 0));
    h.sync();
    let echo_from = |src| {
        Packet::new(
            ip(src),
            ip("10.0.0.10"),
            L4::Echo {
                id: 7,
                reply: false,
            },
        )
        .frame()
    };
    assert_eq!(
        h.run_reason(Hook::Egress, &echo_from("10.0.1.20")),
        (Verdict::Pass, Reason::AllowPolicy)
    );
    let udp = Packet::udp(ip("10.0.1.20"), 1, ip("10.0.0.10"), 65535).frame();
    let other = echo_from("10.0.2.30");
    h.check(&[
        ("the peer, UDP 65535", Hook::Egress, &udp, Pass),
        ("another pod's echo", Hook::Egress, &other, Drop),
    ]);
}

#[test]
fn wildcard_peer_and_wildcard_port_entries_match() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(ANY, TCP, 16, 443)); // anyone on 443
    h.allow(ingress_key(OTHER, UDP, 0, 0)); // OTHER on any UDP port
    h.sync();
    let other = |port| to_pod("10.0.2.30", 5000, port);
    let udp = |src, port| Packet::udp(ip(src), 5000, ip("10.0.0.10"), port).frame();
    let world = to_pod("203.0.113.1", 5000, 443);
    h.check(&[
        ("world on 443", Hook::Egress, &world, Pass),
        ("OTHER on 443", Hook::Egress, &other(443), Pass),
        ("OTHER on 444", Hook::Egress, &other(444), Drop),
        ("OTHER, UDP 1", Hook::Egress, &udp("10.0.2.30", 1), Pass),
        ("OTHER, 65000", Hook::Egress, &udp("10.0.2.30", 65000), Pass),
        ("PEER, UDP 1", Hook::Egress, &udp("10.0.1.20", 1), Drop),
    ]);
}

#[test]
fn longest_cidr_prefix_decides_the_address_class() {
    // 172.16.0.0/12 is class A, its carved-out 172.16.5.0/24 is class B:
    // an ipBlock {cidr: 172.16.0.0/12, except: [172.16.5.0/24]} allows A only.
    let mut h = cluster(BOTH);
    h.ipcache("172.16.0.0/12", ANY, CLASS_A);
    h.ipcache("172.16.5.0/24", ANY, CLASS_B);
    h.allow(ingress_key(CLASS_A, TCP, 16, 80));
    h.sync();
    let from = |src| to_pod(src, 1000, 80);
    h.check(&[
        ("in A", Hook::Egress, &from("172.16.4.1"), Pass),
        ("end of A", Hook::Egress, &from("172.31.255.255"), Pass),
        ("in B", Hook::Egress, &from("172.16.5.9"), Drop),
        ("past A", Hook::Egress, &from("172.32.0.1"), Drop),
    ]);
}

#[test]
fn a_pod_ip_matches_both_its_pod_identity_and_its_cidr_class() {
    let mut h = cluster(BOTH);
    // 10.0.2.30 is pod OTHER, inside a carved 10.0.2.0/24 (class A).
    h.ipcache("10.0.2.0/24", ANY, CLASS_A);
    h.ipcache("10.0.2.30/32", OTHER, CLASS_A);
    h.allow(ingress_key(CLASS_A, TCP, 16, 80));
    h.sync();
    assert_eq!(
        h.run(Hook::Egress, &to_pod("10.0.2.30", 1000, 80)),
        Verdict::Pass
    );
}

#[test]
fn ipv6_is_judged_like_ipv4() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.ipcache("2001:db8::/32", ANY, CLASS_A);
    h.allow(ingress_key(CLASS_A, UDP, 16, 53));
    h.sync();
    let pod = ip("fd00::10");
    let tcp = |dport| Packet::tcp(ip("fd00::20"), 1000, pod, dport, TCP_SYN).frame();
    let udp = |src| Packet::udp(ip(src), 1000, pod, 53).frame();
    h.check(&[
        ("the peer on 80", Hook::Egress, &tcp(80), Pass),
        ("the peer on 81", Hook::Egress, &tcp(81), Drop),
        ("class A", Hook::Egress, &udp("2001:db8::1"), Pass),
        ("outside class A", Hook::Egress, &udp("2001:db9::1"), Drop),
    ]);
}

#[test]
fn ipv4_options_and_ipv6_extension_headers_are_skipped() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.sync();
    let mut p = Packet::tcp(ip("10.0.1.20"), 1000, ip("10.0.0.10"), 80, TCP_SYN);
    p.ipv4_options = vec![1, 1, 1, 0, 1, 1, 1, 0]; // NOPs and EOL: 8 bytes
    let on_80 = p.frame();
    p.l4 = L4::Tcp {
        sport: 1000,
        dport: 81,
        flags: TCP_SYN,
    };
    let on_81 = p.frame();
    let mut p6 = Packet::tcp(ip("fd00::20"), 1000, ip("fd00::10"), 80, TCP_SYN);
    p6.ipv6_ext_headers = 3;
    let three = p6.frame();
    h.check(&[
        ("IPv4 options, port 80", Hook::Egress, &on_80, Pass),
        ("IPv4 options, port 81", Hook::Egress, &on_81, Drop),
        ("3 extension headers", Hook::Egress, &three, Pass),
    ]);
    // More extension headers than the parser walks: dropped as malformed.
    p6.ipv6_ext_headers = 7;
    assert_eq!(
        h.run_reason(Hook::Egress, &p6.frame()),
        (Verdict::Drop, Reason::DropMalformed)
    );
}

#[test]
fn later_fragments_follow_their_first_fragment() {
    for (src, dst) in [("10.0.1.20", "10.0.0.10"), ("fd00::20", "fd00::10")] {
        let mut h = cluster(BOTH);
        h.allow(ingress_key(PEER, UDP, 16, 53));
        h.sync();
        let frag = |id, offset, more, dport| {
            let mut p = Packet::udp(ip(src), 1000, ip(dst), dport);
            p.fragment = Some(Fragment { id, offset, more });
            p.frame()
        };
        let row = |what| format!("{src}: {what}");
        h.check(&[
            // A later fragment with no first fragment seen: dropped.
            (
                row("a later fragment alone"),
                Hook::Egress,
                &frag(7, 185, false, 53),
                (Drop, DropFragmentUnknown),
            ),
            // First fragment allowed, then its later fragments pass.
            (
                row("an allowed first fragment"),
                Hook::Egress,
                &frag(8, 0, true, 53),
                (Pass, AllowPolicy),
            ),
            (
                row("its later fragment"),
                Hook::Egress,
                &frag(8, 185, false, 53),
                (Pass, AllowFragment),
            ),
        ]);
        // A denied first fragment does not open its datagram.
        h.check(&[
            (
                row("a denied first fragment"),
                Hook::Egress,
                &frag(9, 0, true, 54),
                Drop,
            ),
            (
                row("its later fragment"),
                Hook::Egress,
                &frag(9, 185, false, 54),
                Drop,
            ),
        ]);
    }
}

#[test]
fn malformed_and_truncated_packets_are_dropped_and_non_ip_passes() {
    let mut h = cluster(0); // even an unisolated pod: malformed packets cannot be judged
    h.sync();
    let good = Packet::tcp(ip("10.0.1.20"), 1000, ip("10.0.0.10"), 80, TCP_SYN).frame();
    assert_eq!(h.run(Hook::Egress, &good), Verdict::Pass);
    // Truncated TCP header (cut 4 bytes into it).
    let cut_tcp = &good[..14 + 20 + 4];
    // (BPF_PROG_TEST_RUN itself refuses frames shorter than an IPv4 header,
    // so a truncated header is shown by an IHL reaching past the end.)
    let mut short = good[..14 + 20].to_vec();
    short[14] = 0x46;
    // `good` with another first byte of its IPv4 header (version, IHL).
    let v_ihl = |b| {
        let mut bad = good.clone();
        bad[14] = b;
        bad
    };
    // VLAN-tagged frames are not expected on a pod veth.
    let mut vlan = ethernet(0x8100, &[0, 5, 0x08, 0x00]);
    vlan.extend_from_slice(&good[14..]);
    // ARP passes: no policy governs it.
    let arp = ethernet(0x0806, &[0u8; 28]);
    // Truncated UDP and SCTP headers.
    let udp = Packet::udp(ip("10.0.1.20"), 1, ip("10.0.0.10"), 2).frame();
    let sctp = Packet::new(
        ip("10.0.1.20"),
        ip("10.0.0.10"),
        L4::Sctp { sport: 1, dport: 2 },
    )
    .frame();
    let (cut_udp, cut_sctp) = (&udp[..udp.len() - 2], &sctp[..14 + 20 + 10]);
    let malformed = (Drop, DropMalformed);
    h.check(&[
        ("TCP header cut", Hook::Egress, cut_tcp, malformed),
        ("IHL past a cut header", Hook::Egress, &short, malformed),
        ("IHL below 5", Hook::Egress, &v_ihl(0x44), malformed),
        ("IHL past the end", Hook::Egress, &v_ihl(0x4f), malformed),
        ("version 6 in IPv4", Hook::Egress, &v_ihl(0x65), malformed),
        ("VLAN-tagged", Hook::Egress, &vlan, malformed),
        ("ARP", Hook::Egress, &arp, (Pass, AllowNonIp)),
        ("UDP header cut", Hook::Egress, cut_udp, malformed),
        ("SCTP header cut", Hook::Egress, cut_sctp, malformed),
    ]);
}

#[test]
fn replies_of_an_allowed_flow_pass_both_ways() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.sync();
    let (peer, pod) = (ip("10.0.1.20"), ip("10.0.0.10"));
    let syn = Packet::tcp(peer, 41000, pod, 80, TCP_SYN).frame();
    let syn_ack = Packet::tcp(pod, 80, peer, 41000, TCP_SYN | TCP_ACK).frame();
    let ack = Packet::tcp(peer, 41000, pod, 80, TCP_ACK).frame();
    let to_41001 = Packet::tcp(pod, 80, peer, 41001, TCP_SYN | TCP_ACK).frame();
    let from_81 = Packet::tcp(pod, 81, peer, 41000, TCP_ACK).frame();
    h.check(&[
        ("SYN", Hook::Egress, &syn, (Pass, AllowPolicy)),
        // The pod is egress-isolated with no egress rules: only the reply passes.
        ("SYN-ACK", Hook::Ingress, &syn_ack, (Pass, AllowReply)),
        ("ACK", Hook::Egress, &ack, (Pass, AllowEstablished)),
        (
            "SYN-ACK to 41001",
            Hook::Ingress,
            &to_41001,
            (Drop, DropPolicy),
        ),
        ("ACK from 81", Hook::Ingress, &from_81, (Drop, DropPolicy)),
    ]);
    // Echo replies follow their request (ICMP by id).
    h.allow(PolicyKey::new(POD, EGRESS, PEER, ANY_PROTO, 0, 0));
    h.sync();
    let req = Packet::new(
        pod,
        peer,
        L4::Echo {
            id: 99,
            reply: false,
        },
    )
    .frame();
    let rep = Packet::new(
        peer,
        pod,
        L4::Echo {
            id: 99,
            reply: true,
        },
    )
    .frame();
    let other = Packet::new(
        peer,
        pod,
        L4::Echo {
            id: 98,
            reply: true,
        },
    )
    .frame();
    assert_eq!(h.run(Hook::Ingress, &req), Verdict::Pass);
    h.check(&[
        ("the echo reply", Hook::Egress, &rep, (Pass, AllowReply)),
        ("id 98's reply", Hook::Egress, &other, (Drop, DropPolicy)),
    ]);
}

/// One conntrack entry holds both ways of a tuple: a connection the pod
/// opens on the tuple of a closing one the peer opened replaces it, and
/// the peer's packets are then answers to the pod's connection.
#[test]
fn a_connection_opened_the_other_way_replaces_a_closing_one() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.allow(PolicyKey::new(POD, EGRESS, PEER, ANY_PROTO, 0, 0));
    h.sync();
    let (peer, pod) = (ip("10.0.1.20"), ip("10.0.0.10"));
    let syn = Packet::tcp(peer, 41000, pod, 80, TCP_SYN).frame();
    let fin = Packet::tcp(peer, 41000, pod, 80, TCP_FIN | TCP_ACK).frame();
    let pods_syn = Packet::tcp(pod, 80, peer, 41000, TCP_SYN).frame();
    let ack = Packet::tcp(peer, 41000, pod, 80, TCP_ACK).frame();
    h.check(&[
        ("the peer's SYN", Hook::Egress, &syn, (Pass, AllowPolicy)),
        ("its FIN", Hook::Egress, &fin, (Pass, AllowEstablished)),
        (
            "the pod's SYN",
            Hook::Ingress,
            &pods_syn,
            (Pass, AllowPolicy),
        ),
        ("the peer's ACK", Hook::Egress, &ack, (Pass, AllowReply)),
    ]);
}

#[test]
fn icmp_errors_about_a_tracked_flow_are_related() {
    let mut h = cluster(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, UDP, 16, 5000));
    h.sync();
    let (peer, pod) = (ip("10.0.1.20"), ip("10.0.0.10"));
    let out = Packet::udp(pod, 33000, peer, 5000);
    assert_eq!(h.run(Hook::Ingress, &out.frame()), Verdict::Pass);
    let err = Packet::new(
        peer,
        pod,
        L4::Unreachable {
            quoted: Box::new(out.clone()),
        },
    )
    .frame();
    // An error about a flow that never passed is judged as plain ICMP.
    let never = Packet::udp(pod, 33001, peer, 5001);
    let err_never = Packet::new(
        peer,
        pod,
        L4::Unreachable {
            quoted: Box::new(never),
        },
    )
    .frame();
    h.check(&[
        ("about the flow", Hook::Egress, &err, (Pass, AllowRelated)),
        ("no flow", Hook::Egress, &err_never, (Drop, DropPolicy)),
    ]);
}

#[test]
fn a_policy_change_cuts_established_flows_once_the_revision_moves() {
    let mut h = cluster(BOTH);
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.sync();
    let (peer, pod) = (ip("10.0.1.20"), ip("10.0.0.10"));
    let syn = Packet::tcp(peer, 42000, pod, 80, TCP_SYN).frame();
    let reply = Packet::tcp(pod, 80, peer, 42000, TCP_ACK).frame();
    h.check(&[
        ("the SYN", Hook::Egress, &syn, Pass),
        ("the reply", Hook::Ingress, &reply, Pass),
    ]);
    // Remove the allow but keep the revision: the tracked flow survives.
    h.state.policy.clear();
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Ingress, &reply),
        (Verdict::Pass, Reason::AllowReply)
    );
    // Bump the revision: the flow is judged again and cut, both ways.
    h.endpoint(POD, BOTH, 2);
    h.sync();
    let ack = Packet::tcp(peer, 42000, pod, 80, TCP_ACK).frame();
    h.check(&[
        ("reply", Hook::Ingress, &reply, (Drop, DropPolicyChanged)),
        ("the peer's ACK", Hook::Egress, &ack, (Drop, DropPolicy)),
    ]);
    // Still allowed after a revision bump: the entry is refreshed, not cut.
    h.allow(ingress_key(PEER, TCP, 16, 80));
    h.sync();
    assert_eq!(h.run(Hook::Egress, &syn), Verdict::Pass);
    h.endpoint(POD, BOTH, 3);
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Ingress, &reply),
        (Verdict::Pass, Reason::AllowReply)
    );
}

#[test]
fn node_self_unisolated_nd_and_unknown_interfaces_pass_but_a_forged_self_or_routed_nd_does_not() {
    let mut h = cluster(BOTH);
    h.sync();
    let from_node = to_pod("192.168.0.1", 1000, 8080);
    let to_node = Packet::udp(ip("10.0.0.10"), 1, ip("192.168.0.1"), 53).frame();
    let to_self = Packet::tcp(ip("10.0.0.10"), 1000, ip("10.0.0.10"), 80, TCP_SYN).frame();
    let mut ns = Packet::new(ip("fe80::1"), ip("fd00::10"), L4::Icmp { kind: 135 });
    ns.hop_limit = 255;
    let ns_255 = ns.frame();
    ns.hop_limit = 64;
    let ns_64 = ns.frame();
    h.check(&[
        ("from the node", Hook::Egress, &from_node, (Pass, AllowNode)),
        ("to the node", Hook::Ingress, &to_node, (Pass, AllowNode)),
        // The pod to itself, as it sent it (its own source checked): self.
        ("self, sent", Hook::Ingress, &to_self, (Pass, AllowSelf)),
        // The same header arriving for the pod may come from anyone: judged.
        ("self, arriving", Hook::Egress, &to_self, (Drop, DropPolicy)),
        // Neighbour discovery passes only with hop limit 255 (never routed).
        (
            "ND, hop limit 255",
            Hook::Egress,
            &ns_255,
            (Pass, AllowNeighborDiscovery),
        ),
        ("ND, hop limit 64", Hook::Egress, &ns_64, (Drop, DropPolicy)),
    ]);
    // Egress isolation only: ingress stays open.
    h.endpoint(POD, ENDPOINT_EGRESS_ISOLATED, 2);
    h.sync();
    let from_other = to_pod("10.0.2.30", 1000, 80);
    let to_other = Packet::udp(ip("10.0.0.10"), 1, ip("10.0.2.30"), 53).frame();
    h.check(&[
        ("in", Hook::Egress, &from_other, (Pass, AllowNotIsolated)),
        ("out", Hook::Ingress, &to_other, (Drop, DropPolicy)),
    ]);
    // No endpoint for the interface: not ours to judge.
    h.state.endpoints.remove(&TEST_IFINDEX);
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Egress, &to_pod("10.0.2.30", 1000, 80)),
        (Verdict::Pass, Reason::PassNoEndpoint)
    );
}

#[test]
fn drops_are_reported_on_the_ring_buffer() {
    let mut h = cluster(BOTH);
    h.sync();
    let mut ring = RingBuf::try_from(h.dp.ebpf.take_map("DROP_EVENTS").unwrap()).unwrap();
    assert_eq!(
        h.run(Hook::Egress, &to_pod("10.0.2.30", 43000, 8443)),
        Verdict::Drop
    );
    let item = ring.next().expect("one drop event");
    let ev: FlowRecord = *bytemuck::from_bytes(&item[..std::mem::size_of::<FlowRecord>()]);
    assert_eq!(ev.ifindex, TEST_IFINDEX);
    assert_eq!(ev.endpoint_identity, POD);
    assert_eq!(ev.peer_identity, OTHER);
    assert_eq!(ev.direction, INGRESS);
    assert_eq!(ev.reason, Reason::DropPolicy as u8);
    assert_eq!((ev.sport, ev.dport, ev.protocol), (43000, 8443, TCP));
    assert_eq!(&ev.src[..4], &[10, 0, 2, 30]);
    assert_eq!(&ev.dst[..4], &[10, 0, 0, 10]);
    drop(item);
    assert!(ring.next().is_none());
}

/// Collects aya-log records.
#[derive(Clone, Default)]
struct Capture(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        self.0.lock().unwrap().push(record.args().to_string());
    }
    fn flush(&self) {}
}

#[test]
fn kernel_debug_log_is_off_by_default_and_switchable_at_run_time() {
    use policy_common::config::{CONFIG_DEBUG_LOG, Config};
    let mut h = cluster(BOTH);
    h.sync();
    let capture = Capture::default();
    let mut logger =
        aya_log::EbpfLogger::init_with_logger(&mut h.dp.ebpf, capture.clone()).unwrap();
    assert_eq!(
        h.run(Hook::Egress, &to_pod("10.0.2.30", 1000, 80)),
        Verdict::Drop
    );
    logger.flush();
    assert!(
        capture.0.lock().unwrap().is_empty(),
        "no log lines while the flag is off"
    );
    h.dp.maps
        .set_config(Config {
            flags: CONFIG_DEBUG_LOG,
            object_hash: 0,
        })
        .unwrap();
    assert_eq!(
        h.run(Hook::Egress, &to_pod("10.0.2.30", 1000, 80)),
        Verdict::Drop
    );
    logger.flush();
    let lines = capture.0.lock().unwrap().clone();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("dport=80")
            && lines[0].contains(&format!("reason={}", Reason::DropPolicy as u8)),
        "{}",
        lines[0]
    );
    h.dp.maps.set_config(Config::default()).unwrap();
    assert_eq!(
        h.run(Hook::Egress, &to_pod("10.0.2.30", 1000, 80)),
        Verdict::Drop
    );
    logger.flush();
    assert_eq!(capture.0.lock().unwrap().len(), 1, "off again");
}

/// Fill of the endpoint array and of the overflow hash, in that order.
fn endpoint_fill(h: &Harness) -> (usize, usize) {
    let fill = h.dp.maps.fill();
    let used = |name: &str| fill.iter().find(|(n, _, _)| *n == name).unwrap().1;
    (
        used(policy_common::maps::ENDPOINT_SLOTS),
        used(policy_common::maps::ENDPOINTS),
    )
}

#[test]
fn endpoints_are_found_in_the_array_slot_and_in_the_overflow_hash() {
    for (place, mut h, expect_fill) in [
        ("array slot", Harness::new(), (1, 0)),
        (
            "overflow hash",
            Harness::with_endpoints_in_overflow_hash(),
            (0, 1),
        ),
    ] {
        h.endpoint(POD, BOTH, 1);
        h.ipcache("10.0.1.20/32", PEER, WORLD);
        h.ipcache("10.0.2.30/32", OTHER, WORLD);
        h.allow(ingress_key(PEER, TCP, 16, 80));
        h.sync();
        assert_eq!(endpoint_fill(&h), expect_fill);
        assert_eq!(h.dp.maps.read_state().unwrap().endpoints, h.state.endpoints);
        let peer = to_pod("10.0.1.20", 40000, 80);
        let other = to_pod("10.0.2.30", 40000, 80);
        h.check(&[
            (
                format!("{place}: the peer"),
                Hook::Egress,
                &peer,
                (Pass, AllowPolicy),
            ),
            (
                format!("{place}: another pod"),
                Hook::Egress,
                &other,
                (Drop, DropPolicy),
            ),
        ]);
        // An update in place (ingress no longer isolated) is seen.
        h.endpoint(POD, ENDPOINT_EGRESS_ISOLATED, 2);
        h.sync();
        assert_eq!(
            h.run_reason(Hook::Egress, &to_pod("10.0.2.30", 40001, 80)),
            (Verdict::Pass, Reason::AllowNotIsolated)
        );
        // Removed: the slot or the hash entry is gone, the interface passes.
        h.state.endpoints.remove(&TEST_IFINDEX);
        h.sync();
        assert_eq!(endpoint_fill(&h), (0, 0));
        assert_eq!(h.dp.maps.endpoint(TEST_IFINDEX).unwrap(), None);
        assert_eq!(
            h.run_reason(Hook::Egress, &to_pod("10.0.2.30", 40002, 80)),
            (Verdict::Pass, Reason::PassNoEndpoint)
        );
    }
}

/// ICMP echo is tracked by identifier only: a request from the peer that
/// reuses the identifier of the pod's own ping is a new flow, judged by
/// policy, not a reply.
#[test]
fn an_echo_request_is_never_taken_for_a_reply() {
    let mut h = cluster(ENDPOINT_INGRESS_ISOLATED);
    h.sync();
    let (pod, peer) = (ip("10.0.0.10"), ip("10.0.1.20"));
    let echo = |src, dst, reply| Packet::new(src, dst, L4::Echo { id: 7, reply }).frame();
    let (pod6, peer6) = (ip("fd00::10"), ip("fd00::20"));
    h.check(&[
        (
            "pod's request",
            Hook::Ingress,
            &echo(pod, peer, false),
            (Pass, AllowNotIsolated),
        ),
        (
            "peer's request",
            Hook::Egress,
            &echo(peer, pod, false),
            (Drop, DropPolicy),
        ),
        (
            "peer's reply",
            Hook::Egress,
            &echo(peer, pod, true),
            (Pass, AllowReply),
        ),
        (
            "pod's request again",
            Hook::Ingress,
            &echo(pod, peer, false),
            (Pass, AllowEstablished),
        ),
        // The same for ICMPv6.
        (
            "pod's v6 request",
            Hook::Ingress,
            &echo(pod6, peer6, false),
            (Pass, AllowNotIsolated),
        ),
        (
            "peer's v6 request",
            Hook::Egress,
            &echo(peer6, pod6, false),
            (Drop, DropPolicy),
        ),
        (
            "peer's v6 reply",
            Hook::Egress,
            &echo(peer6, pod6, true),
            (Pass, AllowReply),
        ),
    ]);
}
