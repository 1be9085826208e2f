//! The model's Service semantics: deferral, the verdict after DNAT, the
//! client's later packets.
use std::net::{IpAddr, Ipv4Addr};

use super::*;
use crate::{
    endpoint::{
        ENDPOINT_EGRESS_ISOLATED, ENDPOINT_HAS_V4, ENDPOINT_INGRESS_ISOLATED, EndpointInfo, lookups,
    },
    identity,
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    service::{ServiceEntry, mark},
};

const CLIENT_IF: u32 = 7;
const BACKEND_IF: u32 = 9;
const CLIENT: u32 = 300;
const GOOD: u32 = 301;
const BAD: u32 = 302;
const FOREIGN: u32 = 0x8000_4000;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}
fn client() -> IpAddr {
    v4(10, 0, 0, 5)
}
fn frontend() -> IpAddr {
    v4(10, 96, 0, 10)
}
/// A backend the client's egress allows on TCP 8080.
fn good() -> IpAddr {
    v4(10, 0, 1, 1)
}
/// A backend it does not allow.
fn bad() -> IpAddr {
    v4(10, 0, 1, 2)
}

fn endpoint(identity: u32, flags: u32, addr: [u8; 4]) -> EndpointInfo {
    EndpointInfo {
        identity,
        flags: flags | ENDPOINT_HAS_V4,
        revision: 1,
        egress_lookups: lookups::port_prefix(16),
        ipv4: addr,
        ..Default::default()
    }
}

/// The client (egress isolated unless `flags` says otherwise), a backend
/// pod's interface (not isolated), the frontend 10.96.0.10 and the range
/// 10.96.0.0/12; egress to GOOD on TCP 8080 is allowed.
fn setup(client_flags: u32) -> Datapath {
    let mut m = Maps::default();
    m.endpoints
        .insert(CLIENT_IF, endpoint(CLIENT, client_flags, [10, 0, 0, 5]));
    m.endpoints
        .insert(BACKEND_IF, endpoint(GOOD, 0, [10, 0, 1, 1]));
    for (addr, id) in [(client(), CLIENT), (good(), GOOD), (bad(), BAD)] {
        m.insert_prefix(
            addr,
            32,
            IpcacheEntry {
                identity: id,
                cidr_identity: identity::WORLD,
            },
        );
    }
    m.insert_frontend(frontend(), 32, ServiceEntry::default());
    m.insert_frontend(v4(10, 96, 0, 0), 12, ServiceEntry::default());
    m.policy.insert(
        PolicyKey::new(CLIENT, direction::EGRESS, GOOD, proto::TCP, 16, 8080),
        PolicyEntry::default(),
    );
    Datapath::new(m)
}

fn tcp(ifindex: u32, dir: u8, src: (IpAddr, u16), dst: (IpAddr, u16), flags: u8) -> Packet {
    Packet {
        ifindex,
        direction: dir,
        src: src.0,
        dst: dst.0,
        protocol: proto::TCP,
        sport: src.1,
        dport: dst.1,
        tcp_flags: flags,
        icmp_type: 0,
        hop_limit: 64,
        quoted: None,
        mark: 0,
        ingress_ifindex: 0,
    }
}

/// The client sends to the frontend (its egress hook).
fn sent(sport: u16, flags: u8) -> Packet {
    tcp(
        CLIENT_IF,
        direction::EGRESS,
        (client(), sport),
        (frontend(), 80),
        flags,
    )
}

/// The packet after DNAT to `backend`:8080, reaching the backend's hook
/// with `mark`.
fn dnat(sport: u16, backend: IpAddr, mark: u32) -> Packet {
    Packet {
        mark,
        ..tcp(
            BACKEND_IF,
            direction::INGRESS,
            (client(), sport),
            (backend, 8080),
            TCP_SYN,
        )
    }
}

/// A reply reaching the client, reverse-NATed to come from the frontend.
fn reply(sport: u16) -> Packet {
    tcp(
        CLIENT_IF,
        direction::INGRESS,
        (frontend(), 80),
        (client(), sport),
        TCP_SYN | TCP_ACK,
    )
}

fn pending_mark() -> u32 {
    mark::pending(CLIENT_IF).unwrap()
}

fn reasons(o: &Outcome) -> (Option<Reason>, Option<Reason>) {
    (
        o.after_dnat.map(|j| j.reason),
        o.judgement.map(|j| j.reason),
    )
}

#[test]
fn only_an_egress_isolated_pods_flow_to_a_frontend_is_deferred() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let out = dp.classify(&sent(40000, TCP_SYN));
    assert_eq!(out.reason(), Some(Reason::PassService));
    assert_eq!(out.mark, pending_mark());
    // An address in the Service range is a frontend too.
    let mut in_range = sent(40001, TCP_SYN);
    in_range.dst = v4(10, 100, 7, 7);
    assert_eq!(dp.classify(&in_range).reason(), Some(Reason::PassService));
    // Not a frontend: judged on the spot, no mark.
    let mut direct = sent(40002, TCP_SYN);
    direct.dst = good();
    direct.dport = 8080;
    let out = dp.classify(&direct);
    assert_eq!(out.reason(), Some(Reason::AllowPolicy));
    assert_eq!(out.mark, 0);
    // ICMP carries no port a Service forwards: judged as it is.
    let mut echo = sent(3, 0);
    echo.protocol = proto::ICMP;
    echo.icmp_type = 8;
    echo.dport = 3;
    assert_eq!(dp.classify(&echo).reason(), Some(Reason::DropPolicy));

    // Isolated for ingress only, or not at all: never deferred.
    for flags in [ENDPOINT_INGRESS_ISOLATED, 0] {
        let mut dp = setup(flags);
        let out = dp.classify(&sent(40000, TCP_SYN));
        assert_eq!(out.reason(), Some(Reason::AllowNotIsolated), "{flags}");
        assert_eq!(out.mark, 0);
        assert!(dp.services.is_empty());
    }
}

#[test]
fn allowed_after_dnat_the_flow_is_established() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    // Still pending: the next packet is deferred again, a reply passes.
    assert_eq!(
        dp.classify(&sent(40000, TCP_SYN)).reason(),
        Some(Reason::PassService)
    );
    assert_eq!(
        dp.classify(&reply(40000)).reason(),
        Some(Reason::AllowReply)
    );
    let out = dp.classify(&dnat(40000, good(), m));
    assert_eq!(
        reasons(&out),
        (Some(Reason::AllowPolicy), Some(Reason::AllowNotIsolated))
    );
    assert_eq!(out.mark, 0, "the mark is consumed");
    let key = ServiceKey {
        ifindex: CLIENT_IF,
        src: client(),
        sport: 40000,
        protocol: proto::TCP,
    };
    assert_eq!(dp.services[&key].backend, Some((good(), 8080)));
    // Judged: still checked after DNAT, established on its backend.
    let out = dp.classify(&sent(40000, TCP_ACK));
    assert_eq!(out.reason(), Some(Reason::PassService));
    assert_eq!(out.mark, m, "a judged flow is still marked");
    let out = dp.classify(&dnat(40000, good(), m));
    assert_eq!(
        out.after_dnat.map(|j| j.reason),
        Some(Reason::AllowEstablished)
    );
    assert_eq!(
        dp.classify(&reply(40000)).reason(),
        Some(Reason::AllowReply)
    );
}

/// kube-proxy deletes a UDP flow's conntrack entry when its endpoint
/// leaves, and the next datagram meets a new choice: a judged flow that
/// lands elsewhere is judged there.
#[test]
fn a_judged_flow_that_lands_on_another_backend_is_judged_again() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    dp.classify(&dnat(40000, good(), m));
    assert_eq!(dp.classify(&sent(40000, TCP_ACK)).mark, m);
    let out = dp.uplink(&dnat(40000, bad(), m));
    assert_eq!(out.reason(), Some(Reason::DropPolicy));
    assert!(dp.flows.is_empty() && dp.services.is_empty());
}

#[test]
fn denied_after_dnat_the_packet_drops_and_the_flow_is_forgotten() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    let out = dp.classify(&dnat(40000, bad(), m));
    assert_eq!(reasons(&out), (Some(Reason::DropPolicy), None));
    assert!(!out.passes());
    assert!(dp.flows.is_empty() && dp.services.is_empty());
    // The next packet is a new flow, deferred again.
    assert_eq!(
        dp.classify(&sent(40000, TCP_SYN)).reason(),
        Some(Reason::PassService)
    );
    // At the uplink (a remote backend) the same.
    let out = dp.uplink(&dnat(40000, bad(), m | FOREIGN));
    assert_eq!(reasons(&out), (Some(Reason::DropPolicy), None));
    assert_eq!(out.mark, FOREIGN);
    // A client that is gone cannot be judged.
    let gone = mark::pending(55).unwrap();
    assert_eq!(
        dp.uplink(&dnat(1, good(), gone)).reason(),
        Some(Reason::DropPolicy)
    );
}

#[test]
fn the_uplink_judges_marked_packets_only() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let out = dp.uplink(&dnat(40000, bad(), FOREIGN));
    assert_eq!(out.reason(), None);
    assert!(out.passes());
    assert_eq!(out.mark, FOREIGN);
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    let out = dp.uplink(&dnat(40000, good(), m));
    assert_eq!(out.reason(), Some(Reason::AllowPolicy));
    assert_eq!(out.mark, 0);
    assert_eq!(
        dp.classify(&sent(40000, TCP_ACK)).reason(),
        Some(Reason::PassService)
    );
    assert_eq!(
        dp.uplink(&dnat(40000, good(), m)).reason(),
        Some(Reason::AllowEstablished)
    );
}

#[test]
fn a_revision_change_rejudges_against_the_backend() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    dp.classify(&dnat(40000, good(), m));
    // Another flow, still pending when the revision moves.
    dp.classify(&sent(40001, TCP_SYN));
    let bump = |dp: &mut Datapath| {
        let ep = dp.maps.endpoints.get_mut(&CLIENT_IF).unwrap();
        ep.revision += 1;
    };
    // Still allowed: on to DNAT, under the new revision.
    bump(&mut dp);
    assert_eq!(
        dp.classify(&sent(40000, TCP_ACK)).reason(),
        Some(Reason::PassService)
    );
    assert_eq!(dp.flows[&Flow::of(&sent(40000, TCP_ACK))].revision, 2);
    // The backend is no longer allowed: the reply is cut, and the flow.
    dp.maps.policy.clear();
    bump(&mut dp);
    assert_eq!(
        dp.classify(&reply(40000)).reason(),
        Some(Reason::DropPolicyChanged)
    );
    let out = dp.classify(&sent(40000, TCP_ACK));
    assert_eq!(out.reason(), Some(Reason::PassService), "a new flow");
    // The pending flow has no backend to judge: still judged after DNAT.
    assert_eq!(
        dp.classify(&sent(40001, TCP_ACK)).reason(),
        Some(Reason::PassService)
    );
}

#[test]
fn a_stale_flow_without_a_backend_is_judged_after_dnat_again() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    dp.classify(&dnat(40000, good(), m));
    // The remembered backend is lost (an LRU eviction).
    let key = ServiceKey {
        ifindex: CLIENT_IF,
        src: client(),
        sport: 40000,
        protocol: proto::TCP,
    };
    dp.services.get_mut(&key).unwrap().backend = None;
    dp.maps.endpoints.get_mut(&CLIENT_IF).unwrap().revision += 1;
    assert_eq!(
        dp.classify(&reply(40000)).reason(),
        Some(Reason::AllowReply)
    );
    assert_eq!(
        dp.classify(&sent(40000, TCP_ACK)).reason(),
        Some(Reason::PassService)
    );
    let out = dp.classify(&dnat(40000, bad(), m));
    assert_eq!(out.reason(), Some(Reason::DropPolicy));
    assert!(dp.flows.is_empty());
}

#[test]
fn a_client_beyond_the_marks_range_is_refused() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    let big = mark::IFINDEX_MASK + 1;
    let ep = dp.maps.endpoints[&CLIENT_IF];
    dp.maps.endpoints.insert(big, ep);
    let out = dp.classify(&Packet {
        ifindex: big,
        ..sent(40000, TCP_SYN)
    });
    assert_eq!(out.reason(), Some(Reason::DropPolicy));
    assert_eq!(out.mark, 0);
    assert!(dp.flows.is_empty() && dp.services.is_empty());
}

#[test]
fn foreign_mark_bits_survive_every_hook() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    // Our bits set by someone else are replaced, the others kept.
    let stray = FOREIGN | mark::pending(mark::IFINDEX_MASK).unwrap();
    let out = dp.classify(&Packet {
        mark: stray,
        ingress_ifindex: 0,
        ..sent(40000, TCP_SYN)
    });
    assert_eq!(out.mark, FOREIGN | pending_mark());
    let out = dp.classify(&dnat(40000, good(), out.mark));
    assert_eq!(out.mark, FOREIGN);
    // Unmarked, nothing changes.
    let out = dp.classify(&Packet {
        mark: FOREIGN,
        ingress_ifindex: 0,
        ..reply(40000)
    });
    assert_eq!(out.mark, FOREIGN);
    assert_eq!(out.after_dnat, None);
}

#[test]
fn a_second_frontend_on_one_source_port_is_refused_while_the_first_lives() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    // Two flows from one source port to two frontends: after DNAT
    // nothing tells them apart, so the second is refused...
    let first = sent(40000, TCP_SYN);
    let mut second = first;
    second.dst = v4(10, 96, 0, 11);
    let m = dp.classify(&first).mark;
    assert_eq!(dp.classify(&second).reason(), Some(Reason::DropPolicy));
    // ...and the verdict on the first is the first's.
    dp.classify(&dnat(40000, good(), m));
    assert_eq!(dp.classify(&first).reason(), Some(Reason::PassService));
    assert!(!dp.flows[&Flow::of(&first)].pending);
    assert_eq!(dp.classify(&second).reason(), Some(Reason::DropPolicy));
    // Once the first is gone, the second may go.
    dp.flows.clear();
    assert_eq!(dp.classify(&second).reason(), Some(Reason::PassService));
    // The first's entry, if it outlived its key, is forgotten.
    dp.flows.insert(
        Flow::of(&first),
        FlowState {
            revision: 1,
            closing: false,
            service: true,
            pending: true,
            peer_of: PeerOf::Address,
        },
    );
    assert_eq!(dp.classify(&first).reason(), Some(Reason::DropPolicy));
    assert!(!dp.flows.contains_key(&Flow::of(&first)));
}

#[test]
fn an_icmp_error_about_a_stale_flow_is_judged_against_the_backend() {
    let mut dp = setup(ENDPOINT_EGRESS_ISOLATED);
    // Everything may reach the frontend's address itself.
    let world = PolicyKey::new(
        CLIENT,
        direction::EGRESS,
        identity::WORLD,
        proto::TCP,
        16,
        80,
    );
    dp.maps.policy.insert(world, PolicyEntry::default());
    dp.maps.insert_prefix(
        frontend(),
        32,
        IpcacheEntry {
            identity: identity::ANY,
            cidr_identity: identity::WORLD,
        },
    );
    let m = dp.classify(&sent(40000, TCP_SYN)).mark;
    dp.classify(&dnat(40000, good(), m));
    let error = Packet {
        protocol: proto::ICMP,
        sport: 0,
        dport: 0,
        tcp_flags: 0,
        icmp_type: 3,
        quoted: Some(Quoted {
            src: client(),
            dst: frontend(),
            protocol: proto::TCP,
            sport: 40000,
            dport: 80,
        }),
        ..tcp(
            CLIENT_IF,
            direction::INGRESS,
            (v4(192, 0, 2, 1), 0),
            (client(), 0),
            0,
        )
    };
    assert_eq!(
        dp.classify(&error).reason(),
        Some(Reason::AllowRelated),
        "current"
    );
    // The backend is denied now: the frontend's own address being allowed
    // does not keep the flow.
    dp.maps.policy.retain(|k, _| *k == world);
    dp.maps.endpoints.get_mut(&CLIENT_IF).unwrap().revision += 1;
    assert_eq!(
        dp.classify(&error).reason(),
        Some(Reason::DropPolicyChanged)
    );
    assert_eq!(
        dp.classify(&sent(40000, TCP_ACK)).reason(),
        Some(Reason::PassService)
    );
}
