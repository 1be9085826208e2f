//! The classifier against a hostile pod, through BPF_PROG_TEST_RUN: forged
//! sources, flows opened at the wrong hook, ICMP errors quoting real flows,
//! closing connections reused, conntrack pressure, odd IPv6 header chains.
//! Every case here passed the classifier before it was hardened. Needs root.

use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction::{EGRESS, INGRESS},
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    identity::ANY,
    maps::CONNTRACK,
    policy::PolicyKey,
    proto::{ANY as ANY_PROTO, TCP, UDP},
    verdict::Reason::{self, *},
};
use policy_testbed::fixtures::harness::{
    Harness, PEER, POD,
    Verdict::{self, Drop, Pass},
    ip,
};
use policy_testbed::packet::{Fragment, L4, Packet, TCP_ACK, TCP_FIN, TCP_SYN};

const BOTH: u32 = ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED;

/// A new harness holding [`Harness::cluster`].
fn harness(flags: u32) -> Harness {
    let mut h = Harness::new();
    h.cluster(flags);
    h
}

fn tracked(h: &Harness) -> usize {
    h.dp.maps.conntrack.keys().count()
}

#[test]
fn a_pod_can_send_only_from_its_own_addresses() {
    let mut h = harness(0);
    h.sync();
    // Not isolated at all, and still: another pod's source is refused.
    for (src, dst) in [
        ("10.0.2.30", "10.0.1.20"),
        ("10.0.0.11", "10.0.1.20"),
        ("fd00::20", "fd00::30"),
        ("fe80::10", "fd00::20"),
    ] {
        let p = Packet::udp(ip(src), 5000, ip(dst), 53);
        assert_eq!(
            h.run_reason(Hook::Ingress, &p.frame()),
            (Verdict::Drop, Reason::DropSpoofed),
            "{src} -> {dst}"
        );
    }
    // Its own addresses pass.
    for (src, dst) in [("10.0.0.10", "10.0.1.20"), ("fd00::10", "fd00::20")] {
        let p = Packet::udp(ip(src), 5000, ip(dst), 53);
        assert_eq!(
            h.run_reason(Hook::Ingress, &p.frame()),
            (Verdict::Pass, Reason::AllowNotIsolated)
        );
    }
    // Neighbour discovery from its link-local address, as RFC 4861 sends it.
    let mut ns = Packet::new(ip("fe80::10"), ip("ff02::1:ff00:1"), L4::Icmp { kind: 135 });
    ns.hop_limit = 255;
    // MLD only from a link-local source with hop limit 1.
    let mut mld = Packet::new(ip("fd00::20"), ip("ff02::16"), L4::Icmp { kind: 143 });
    mld.hop_limit = 1;
    let global = mld.frame();
    mld.src = ip("fe80::10");
    let nd = (Pass, AllowNeighborDiscovery);
    h.check(&[
        ("ND", Hook::Ingress, &ns.frame(), nd),
        ("global MLD", Hook::Ingress, &global, (Drop, DropSpoofed)),
        ("link-local MLD", Hook::Ingress, &mld.frame(), nd),
    ]);
}

#[test]
fn a_forged_packet_opens_no_flow_for_either_end() {
    // Egress allowed to the pod's own identity (its namespace), ingress
    // isolated with no rule: the attack of a forged "X -> pod" sent out.
    let mut h = harness(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, POD, ANY_PROTO, 0, 0));
    h.sync();
    let forged = Packet::tcp(ip("10.0.2.30"), 1000, ip("10.0.0.10"), 80, TCP_SYN);
    assert_eq!(
        h.run_reason(Hook::Ingress, &forged.frame()),
        (Verdict::Drop, Reason::DropSpoofed)
    );
    assert_eq!(tracked(&h), 0);
    // X -> pod and pod -> X are both judged as what they are.
    let forged = forged.frame();
    let back = Packet::tcp(
        ip("10.0.0.10"),
        80,
        ip("10.0.2.30"),
        1000,
        TCP_SYN | TCP_ACK,
    );
    h.check(&[
        ("X -> pod", Hook::Egress, &forged, (Drop, DropPolicy)),
        ("pod -> X", Hook::Ingress, &back.frame(), (Drop, DropPolicy)),
    ]);
}

#[test]
fn a_flow_continues_only_at_the_hook_it_was_opened_at() {
    let mut h = harness(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, UDP, 16, 5000));
    h.allow(PolicyKey::new(POD, INGRESS, PEER, ANY_PROTO, 0, 0));
    h.sync();
    let out = Packet::udp(ip("10.0.0.10"), 33000, ip("10.0.1.20"), 5000).frame();
    h.check(&[
        ("sent", Hook::Ingress, &out, (Pass, AllowPolicy)),
        // The same header coming in for the pod is no continuation of it.
        ("coming in", Hook::Egress, &out, (Drop, DropPolicy)),
    ]);
    // Received for an address that is not the pod's: judged, not tracked.
    let before = tracked(&h);
    let stray = Packet::udp(ip("10.0.1.20"), 5000, ip("10.0.0.99"), 33000);
    assert_eq!(
        h.run_reason(Hook::Egress, &stray.frame()),
        (Verdict::Pass, Reason::AllowPolicy)
    );
    assert_eq!(tracked(&h), before, "no entry for someone else's address");
}

/// A pod allowed UDP 5000 to PEER only, with that flow open.
fn dns_client() -> (Harness, Packet) {
    let mut h = harness(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, UDP, 16, 5000));
    h.sync();
    let out = Packet::udp(ip("10.0.0.10"), 33000, ip("10.0.1.20"), 5000);
    assert_eq!(h.run(Hook::Ingress, &out.frame()), Verdict::Pass);
    (h, out)
}

fn error_about(src: &str, dst: &str, quoted: &Packet) -> Vec<u8> {
    Packet::new(
        ip(src),
        ip(dst),
        L4::Unreachable {
            quoted: Box::new(quoted.clone()),
        },
    )
    .frame()
}

#[test]
fn an_icmp_error_is_related_only_on_its_way_back_and_while_the_flow_is_allowed() {
    let (mut h, out) = dns_client();
    // A router on the path reports the pod's flow back to the pod.
    let back = error_about("192.0.2.1", "10.0.0.10", &out);
    // The pod quoting its own flow in an error to anyone else: plain ICMP.
    let elsewhere = error_about("10.0.0.10", "203.0.113.9", &out);
    // An error the pod sends about a packet it received goes to that
    // packet's sender: quoting its own outgoing flow, it is not one.
    let reply = Packet::udp(ip("10.0.1.20"), 5000, ip("10.0.0.10"), 33000);
    let about_reply = error_about("10.0.0.10", "10.0.1.20", &reply);
    h.check(&[
        ("a router's", Hook::Egress, &back, (Pass, AllowRelated)),
        (
            "the pod's, elsewhere",
            Hook::Ingress,
            &elsewhere,
            (Drop, DropPolicy),
        ),
        (
            "the pod's, to the peer",
            Hook::Ingress,
            &about_reply,
            (Pass, AllowRelated),
        ),
    ]);
    // The flow is revoked: errors about it go with it.
    h.state.policy.clear();
    h.endpoint(POD, BOTH, 2);
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Egress, &error_about("192.0.2.1", "10.0.0.10", &out)),
        (Verdict::Drop, Reason::DropPolicyChanged)
    );
}

#[test]
fn a_syn_reusing_a_closing_flow_is_judged_afresh() {
    let mut h = harness(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, TCP, 16, 80));
    h.sync();
    let syn = Packet::tcp(ip("10.0.0.10"), 40000, ip("10.0.1.20"), 80, TCP_SYN);
    let fin = Packet::tcp(
        ip("10.0.0.10"),
        40000,
        ip("10.0.1.20"),
        80,
        TCP_FIN | TCP_ACK,
    );
    assert_eq!(h.run(Hook::Ingress, &syn.frame()), Verdict::Pass);
    assert_eq!(
        h.run_reason(Hook::Ingress, &fin.frame()),
        (Verdict::Pass, Reason::AllowEstablished)
    );
    // The allow goes but no revision moves: only a new judgement sees it.
    h.state.policy.clear();
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Ingress, &syn.frame()),
        (Verdict::Drop, Reason::DropPolicy)
    );
}

#[test]
fn other_icmp_is_never_tracked() {
    let mut h = harness(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, ANY_PROTO, 0, 0));
    h.sync();
    // A timestamp request out (allowed), then other ICMP back: judged.
    let out = Packet::new(ip("10.0.0.10"), ip("10.0.1.20"), L4::Icmp { kind: 13 });
    assert_eq!(
        h.run_reason(Hook::Ingress, &out.frame()),
        (Verdict::Pass, Reason::AllowPolicy)
    );
    assert_eq!(tracked(&h), 0);
    for kind in [14, 5, 9] {
        let back = Packet::new(ip("10.0.1.20"), ip("10.0.0.10"), L4::Icmp { kind });
        assert_eq!(
            h.run_reason(Hook::Egress, &back.frame()),
            (Verdict::Drop, Reason::DropPolicy),
            "type {kind}"
        );
    }
}

#[test]
fn only_isolated_pods_track_flows() {
    let mut h = harness(0);
    h.sync();
    let out = Packet::tcp(ip("10.0.0.10"), 40000, ip("10.0.1.20"), 80, TCP_SYN);
    assert_eq!(
        h.run_reason(Hook::Ingress, &out.frame()),
        (Verdict::Pass, Reason::AllowNotIsolated)
    );
    assert_eq!(tracked(&h), 0, "an unisolated pod's flows take no room");
    h.endpoint(POD, ENDPOINT_EGRESS_ISOLATED, 2);
    h.allow(PolicyKey::new(POD, EGRESS, ANY, ANY_PROTO, 0, 0));
    h.sync();
    assert_eq!(h.run(Hook::Ingress, &out.frame()), Verdict::Pass);
    assert_eq!(tracked(&h), 1);
}

/// A connection a policy change cut stays cut when the pod answers it:
/// the pod's own mid-stream segment (its egress not isolated, so allowed)
/// opens no flow, and the peer's next segments are judged, not taken as
/// replies to a connection the pod "opened". (Seen for real: a connection
/// through a ClusterIP kept echoing after the backend's ingress policy
/// cut it, whenever the backend's ACK came between the cut and the
/// client's next segment.)
#[test]
fn a_midstream_segment_opens_no_flow() {
    let mut h = harness(ENDPOINT_INGRESS_ISOLATED);
    h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, 0, 0));
    h.sync();
    let from_peer = |flags| Packet::tcp(ip("10.0.1.20"), 40000, ip("10.0.0.10"), 80, flags);
    let from_pod = |flags| Packet::tcp(ip("10.0.0.10"), 80, ip("10.0.1.20"), 40000, flags);
    assert_eq!(
        h.run_reason(Hook::Egress, &from_peer(TCP_SYN).frame()),
        (Verdict::Pass, Reason::AllowPolicy)
    );
    assert_eq!(
        h.run_reason(Hook::Ingress, &from_pod(TCP_SYN | TCP_ACK).frame()),
        (Verdict::Pass, Reason::AllowReply)
    );
    // The policy goes: the peer's next segment cuts the connection.
    h.state.policy.clear();
    h.endpoint(POD, ENDPOINT_INGRESS_ISOLATED, 2);
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Egress, &from_peer(TCP_ACK).frame()),
        (Verdict::Drop, Reason::DropPolicyChanged)
    );
    assert_eq!(tracked(&h), 0);
    // The pod still answers (a retransmission, an ACK): its egress is not
    // isolated, so it passes, but it opens nothing.
    assert_eq!(
        h.run_reason(Hook::Ingress, &from_pod(TCP_ACK).frame()),
        (Verdict::Pass, Reason::AllowNotIsolated)
    );
    assert_eq!(tracked(&h), 0, "a mid-stream segment opened a flow");
    for _ in 0..3 {
        assert_eq!(
            h.run_reason(Hook::Egress, &from_peer(TCP_ACK).frame()),
            (Verdict::Drop, Reason::DropPolicy),
            "the peer's segment rode the pod's answer"
        );
    }
    // A new connection from the pod (a SYN) is tracked as ever.
    let out = Packet::tcp(ip("10.0.0.10"), 41000, ip("10.0.1.20"), 443, TCP_SYN);
    assert_eq!(h.run(Hook::Ingress, &out.frame()), Verdict::Pass);
    assert_eq!(tracked(&h), 1);
}

/// An LRU conntrack far too small for the flows: evicted flows are judged
/// again (their replies dropped where the pod is isolated), never let
/// through, and the misses are counted as pressure.
#[test]
fn an_evicted_flow_is_judged_again_never_opened() {
    let mut h = Harness::with_capacities(&[(CONNTRACK, 32)]);
    h.cluster(BOTH);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, TCP, 0, 0));
    h.sync();
    let flows = 256u16;
    for i in 0..flows {
        let syn = Packet::tcp(ip("10.0.0.10"), 20000 + i, ip("10.0.1.20"), 80, TCP_SYN);
        assert_eq!(h.run(Hook::Ingress, &syn.frame()), Verdict::Pass);
    }
    let before = h.dp.maps.counters().unwrap();
    let (mut replied, mut judged) = (0, 0);
    for i in 0..flows {
        let ack = Packet::tcp(ip("10.0.1.20"), 80, ip("10.0.0.10"), 20000 + i, TCP_ACK);
        match h.run_reason(Hook::Egress, &ack.frame()) {
            (Verdict::Pass, Reason::AllowReply) => replied += 1,
            (Verdict::Drop, Reason::DropPolicy) => judged += 1,
            other => panic!("reply {i}: {other:?}"),
        }
    }
    assert!(judged > 0, "the table was too small to hold every flow");
    assert!(replied > 0, "recent flows keep their entries");
    let after = h.dp.maps.counters().unwrap();
    let misses = |c: &std::collections::BTreeMap<(Reason, u8), u64>| {
        c.get(&(Reason::CtMidstreamMiss, INGRESS))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(misses(&after) - misses(&before), judged as u64);
}

#[test]
fn six_extension_headers_are_walked_and_fragments_keep_their_key() {
    let mut h = harness(BOTH);
    h.allow(PolicyKey::new(POD, INGRESS, PEER, UDP, 16, 53));
    h.sync();
    let mut p = Packet::udp(ip("fd00::20"), 1000, ip("fd00::10"), 53);
    p.ipv6_ext_headers = 6;
    let six = p.frame();
    p.ipv6_ext_headers = 7;
    let seven = p.frame();
    // Destination options after the Fragment header: the later fragments
    // name them, the first names UDP after them; one datagram all the same.
    let frag = |offset, more| {
        let mut p = Packet::udp(ip("fd00::20"), 1001, ip("fd00::10"), 53);
        p.ipv6_ext_after_fragment = 2;
        p.fragment = Some(Fragment {
            id: 77,
            offset,
            more,
        });
        p.frame()
    };
    let (first, later) = (frag(0, true), frag(185, false));
    // A TCP segment without SYN and no flow: judged, and no continuation.
    let ack = Packet::tcp(ip("fd00::20"), 1000, ip("fd00::10"), 53, TCP_ACK).frame();
    h.check(&[
        ("6 headers", Hook::Egress, &six, (Pass, AllowPolicy)),
        ("7 headers", Hook::Egress, &seven, (Drop, DropMalformed)),
        ("first", Hook::Egress, &first, (Pass, AllowPolicy)),
        ("later", Hook::Egress, &later, (Pass, AllowFragment)),
        ("ACK, no flow", Hook::Egress, &ack, (Drop, DropPolicy)),
    ]);
}
