//! The model's own unit tests.
use std::net::Ipv4Addr;

use super::*;
use crate::endpoint::{ENDPOINT_HAS_V4, ENDPOINT_INGRESS_ISOLATED};
use crate::{
    direction,
    endpoint::{EndpointInfo, lookups},
    identity,
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    proto,
    verdict::Reason,
};

fn ep(identity: u32, ingress_lookups: u32) -> EndpointInfo {
    EndpointInfo {
        identity,
        flags: ENDPOINT_INGRESS_ISOLATED | ENDPOINT_HAS_V4,
        revision: 1,
        ingress_lookups,
        ipv4: [10, 0, 0, 5],
        ..Default::default()
    }
}

#[test]
fn longest_prefix_wins() {
    let mut m = Maps::default();
    let a = IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3));
    m.insert_prefix(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 0)),
        8,
        IpcacheEntry {
            identity: 0,
            cidr_identity: identity::FIRST_CIDR,
        },
    );
    m.insert_prefix(
        IpAddr::V4(Ipv4Addr::new(10, 1, 0, 0)),
        16,
        IpcacheEntry {
            identity: 0,
            cidr_identity: identity::FIRST_CIDR + 1,
        },
    );
    assert_eq!(m.ipcache_lookup(a).cidr_identity, identity::FIRST_CIDR + 1);
    assert_eq!(
        m.ipcache_lookup(IpAddr::V4(Ipv4Addr::new(10, 2, 0, 1)))
            .cidr_identity,
        identity::FIRST_CIDR
    );
    assert_eq!(
        m.ipcache_lookup(IpAddr::V4(Ipv4Addr::new(11, 0, 0, 1))),
        IpcacheEntry::UNKNOWN
    );
}

#[test]
fn port_range_prefix_matches_inside_only() {
    let mut m = Maps::default();
    let e = ep(300, lookups::port_prefix(13));
    // 8000-8007 is 8000/13.
    m.policy.insert(
        PolicyKey::new(
            300,
            direction::INGRESS,
            identity::WORLD,
            proto::TCP,
            13,
            8000,
        ),
        PolicyEntry::default(),
    );
    let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    assert_eq!(
        m.judge(&e, direction::INGRESS, peer, proto::TCP, 8007)
            .reason,
        Reason::AllowPolicy
    );
    assert_eq!(
        m.judge(&e, direction::INGRESS, peer, proto::TCP, 8008)
            .reason,
        Reason::DropPolicy
    );
    assert_eq!(
        m.judge(&e, direction::INGRESS, peer, proto::UDP, 8001)
            .reason,
        Reason::DropPolicy
    );
}

#[test]
fn reply_passes_and_is_rejudged_after_revision_change() {
    let mut m = Maps::default();
    let mut e = ep(300, lookups::port_prefix(16));
    m.policy.insert(
        PolicyKey::new(300, direction::INGRESS, identity::WORLD, proto::TCP, 16, 80),
        PolicyEntry::default(),
    );
    m.endpoints.insert(7, e);
    let mut dp = Datapath::new(m);
    let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
    let syn = Packet {
        ifindex: 7,
        direction: direction::INGRESS,
        src: peer,
        dst: pod,
        protocol: proto::TCP,
        sport: 40000,
        dport: 80,
        tcp_flags: TCP_SYN,
        icmp_type: 0,
        hop_limit: 64,
        quoted: None,
        mark: 0,
        ingress_ifindex: 0,
    };
    let reply = Packet {
        ifindex: 7,
        direction: direction::EGRESS,
        src: pod,
        dst: peer,
        protocol: proto::TCP,
        sport: 80,
        dport: 40000,
        tcp_flags: TCP_SYN | TCP_ACK,
        icmp_type: 0,
        hop_limit: 64,
        quoted: None,
        mark: 0,
        ingress_ifindex: 0,
    };
    assert_eq!(dp.classify(&syn).reason(), Some(Reason::AllowPolicy));
    assert_eq!(dp.classify(&reply).reason(), Some(Reason::AllowReply));
    // The policy goes away and the revision moves: the flow is cut.
    dp.maps.policy.clear();
    e.revision = 2;
    dp.maps.endpoints.insert(7, e);
    assert_eq!(
        dp.classify(&reply).reason(),
        Some(Reason::DropPolicyChanged)
    );
    assert_eq!(dp.classify(&syn).reason(), Some(Reason::DropPolicy));
}

#[test]
fn a_forged_source_opens_nothing() {
    let mut e = ep(300, 0);
    e.flags |= crate::endpoint::ENDPOINT_EGRESS_ISOLATED;
    e.egress_lookups = lookups::ANY_PROTOCOL | lookups::ANY_PEER;
    let mut m = Maps::default();
    m.policy.insert(
        PolicyKey::new(300, direction::EGRESS, identity::ANY, proto::ANY, 0, 0),
        PolicyEntry::default(),
    );
    m.endpoints.insert(7, e);
    let mut dp = Datapath::new(m);
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
    let x = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9));
    let pkt = udp_packet;
    // Sent by the pod with X's source, to itself: spoofed, no flow.
    assert_eq!(
        dp.classify(&pkt(direction::EGRESS, x, pod)).reason(),
        Some(Reason::DropSpoofed)
    );
    assert!(dp.flows.is_empty());
    // So X -> pod is judged as new ingress (isolated, no rule): dropped.
    assert_eq!(
        dp.classify(&pkt(direction::INGRESS, x, pod)).reason(),
        Some(Reason::DropPolicy)
    );
}

/// A DNS query of the pod at ifindex 7 in `direction`, from `src` to
/// `dst`.
pub(super) fn udp_packet(direction: u8, src: IpAddr, dst: IpAddr) -> Packet {
    Packet {
        ifindex: 7,
        direction,
        src,
        dst,
        protocol: proto::UDP,
        sport: 5000,
        dport: 53,
        tcp_flags: 0,
        icmp_type: 0,
        hop_limit: 64,
        quoted: None,
        mark: 0,
        ingress_ifindex: 0,
    }
}
