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

/// The class probe runs only when some entry of the endpoint names a
/// peer that is not a label identity; an endpoint entry written before
/// the bit existed (zero) still probes it, so a class entry is never
/// skipped on an upgrade.
#[test]
fn class_probe_only_where_an_entry_names_a_class() {
    let label = PolicyKey::new(
        300,
        direction::INGRESS,
        identity::FIRST_LABEL,
        proto::TCP,
        16,
        80,
    );
    let class = PolicyKey::new(
        300,
        direction::INGRESS,
        identity::FIRST_CIDR,
        proto::TCP,
        16,
        80,
    );
    let world = PolicyKey::new(300, direction::INGRESS, identity::WORLD, proto::TCP, 16, 80);
    assert_eq!(label.lookup_bits() & lookups::CLASS_PEER, 0);
    assert_ne!(class.lookup_bits() & lookups::CLASS_PEER, 0);
    assert_ne!(world.lookup_bits() & lookups::CLASS_PEER, 0);
    let peer = IpcacheEntry {
        identity: identity::FIRST_LABEL,
        cidr_identity: identity::FIRST_CIDR,
    };
    let stored = |bits: u32| ep(300, lookups::stored(bits));
    assert_eq!(
        Maps::peers_to_probe(&stored(label.lookup_bits()), direction::INGRESS, peer),
        vec![identity::FIRST_LABEL]
    );
    assert_eq!(
        Maps::peers_to_probe(&stored(class.lookup_bits()), direction::INGRESS, peer),
        vec![identity::FIRST_LABEL, identity::FIRST_CIDR]
    );
    assert_eq!(
        Maps::peers_to_probe(&ep(300, 0), direction::INGRESS, peer),
        vec![identity::FIRST_LABEL, identity::FIRST_CIDR]
    );
    // Judged end to end: the class entry admits the flow only with its bit.
    let mut m = Maps::default();
    m.insert_prefix(IpAddr::V4(Ipv4Addr::new(10, 1, 0, 0)), 16, peer);
    m.policy.insert(class, PolicyEntry::default());
    let from = IpAddr::V4(Ipv4Addr::new(10, 1, 0, 9));
    let bits = class.lookup_bits();
    assert_eq!(
        m.judge(&stored(bits), direction::INGRESS, from, proto::TCP, 80)
            .reason,
        Reason::AllowPolicy
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

/// Tier decisions, one packet against two entries: the wildcard peer's
/// (any protocol) and the peer's own (TCP 80). Each row: Admin slots,
/// Baseline slots, NetworkPolicy allow in the peer's entry, whether a
/// NetworkPolicy isolates the pod, and the verdict.
#[test]
fn tiers_decide_in_order() {
    use crate::endpoint::ENDPOINT_INGRESS_TIERED;
    use crate::policy::{ENTRY_TIERS_ONLY, TierSlot, action::*};
    let none = TierSlot::NONE;
    let s = TierSlot::new;
    type Row = (
        (TierSlot, TierSlot),
        (TierSlot, TierSlot),
        bool,
        bool,
        Reason,
    );
    let rows: [Row; 12] = [
        // Nothing matches in any tier: the default, or NetworkPolicy.
        (
            (none, none),
            (none, none),
            false,
            false,
            Reason::AllowNotIsolated,
        ),
        ((none, none), (none, none), false, true, Reason::DropPolicy),
        ((none, none), (none, none), true, true, Reason::AllowPolicy),
        // The Admin rule of lower rank decides, wherever it is.
        (
            (s(2, DENY), s(1, ACCEPT)),
            (none, none),
            false,
            true,
            Reason::AllowAdminTier,
        ),
        (
            (s(1, DENY), s(2, ACCEPT)),
            (none, none),
            true,
            false,
            Reason::DropAdminTier,
        ),
        // Pass skips the rest of the Admin tier, even a Deny behind it.
        (
            (s(3, DENY), s(1, PASS)),
            (none, none),
            true,
            true,
            Reason::AllowPolicy,
        ),
        (
            (s(3, DENY), s(1, PASS)),
            (none, none),
            false,
            true,
            Reason::DropPolicy,
        ),
        // Not isolated: the Baseline tier decides.
        (
            (s(1, PASS), none),
            (s(2, DENY), s(1, ACCEPT)),
            false,
            false,
            Reason::AllowBaselineTier,
        ),
        (
            (none, none),
            (s(1, DENY), s(2, ACCEPT)),
            false,
            false,
            Reason::DropBaselineTier,
        ),
        // A Baseline Pass is the default.
        (
            (none, none),
            (s(1, PASS), s(2, DENY)),
            false,
            false,
            Reason::AllowNotIsolated,
        ),
        // NetworkPolicy isolation overrides the Baseline tier.
        (
            (none, none),
            (s(1, DENY), none),
            true,
            true,
            Reason::AllowPolicy,
        ),
        (
            (none, none),
            (s(1, ACCEPT), none),
            false,
            true,
            Reason::DropPolicy,
        ),
    ];
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9));
    let peer_id = 400;
    for (i, ((admin_any, admin_own), (base_any, base_own), np, isolated, want)) in
        rows.into_iter().enumerate()
    {
        let mut m = Maps::default();
        m.insert_prefix(
            peer,
            32,
            IpcacheEntry {
                identity: peer_id,
                cidr_identity: identity::WORLD,
            },
        );
        let mut e = ep(
            300,
            lookups::port_prefix(16) | lookups::ANY_PROTOCOL | lookups::ANY_PEER,
        );
        e.flags = ENDPOINT_HAS_V4 | ENDPOINT_INGRESS_TIERED;
        if isolated {
            e.flags |= ENDPOINT_INGRESS_ISOLATED;
        }
        let tiers_only = |np: bool| if np { 0 } else { ENTRY_TIERS_ONLY };
        m.policy.insert(
            PolicyKey::new(300, direction::INGRESS, identity::ANY, proto::ANY, 0, 0),
            PolicyEntry {
                rule_ref: 0,
                flags: ENTRY_TIERS_ONLY,
                admin: admin_any,
                baseline: base_any,
            },
        );
        m.policy.insert(
            PolicyKey::new(300, direction::INGRESS, peer_id, proto::TCP, 16, 80),
            PolicyEntry {
                rule_ref: 0,
                flags: tiers_only(np),
                admin: admin_own,
                baseline: base_own,
            },
        );
        let got = m.judge(&e, direction::INGRESS, peer, proto::TCP, 80).reason;
        assert_eq!(got, want, "row {i}");
        // Another port meets only the wildcard entry.
        let other = m.judge(&e, direction::INGRESS, peer, proto::TCP, 81).reason;
        let mut alone = crate::policy::Tiers::default();
        alone.add(
            &m.policy[&PolicyKey::new(300, direction::INGRESS, identity::ANY, proto::ANY, 0, 0)],
        );
        assert_eq!(other, alone.decide(isolated), "row {i}, port 81");
    }
}

#[test]
fn tier_slots_order_by_rank_without_branches() {
    use crate::policy::{TierSlot, action::*};
    let a = TierSlot::new(1, DENY);
    let b = TierSlot::new(7, ACCEPT);
    assert_eq!(a.best(b), a);
    assert_eq!(b.best(a), a);
    assert_eq!(TierSlot::NONE.best(b), b);
    assert_eq!(b.best(TierSlot::NONE), b);
    assert_eq!(a.rank(), 1);
    assert_eq!(b.action(), ACCEPT);
    let last = TierSlot::new(TierSlot::MAX_RANK, PASS);
    assert_eq!(last.rank(), TierSlot::MAX_RANK);
    assert_eq!(last.best(TierSlot::NONE), last);
}

/// The rule a flow record names: the first allowing entry in probe order
/// (longest port prefix first, any-protocol last; the peer's identity
/// before its class), never a tiers-only one; under tiers also the best
/// slot of each tier.
#[test]
fn a_judgement_names_what_the_lookup_found() {
    use crate::endpoint::ENDPOINT_INGRESS_TIERED;
    use crate::event::RuleRef;
    use crate::policy::{ENTRY_TIERS_ONLY, TierSlot, action};
    let peer = IpAddr::V4(Ipv4Addr::new(10, 1, 0, 9));
    let entry = |rule_ref, flags, admin, baseline| PolicyEntry {
        rule_ref,
        flags,
        admin,
        baseline,
    };
    let key = |peer, protocol, len, port| {
        PolicyKey::new(300, direction::INGRESS, peer, protocol, len, port)
    };
    let none = TierSlot::NONE;
    let mut m = Maps::default();
    m.insert_prefix(
        peer,
        32,
        IpcacheEntry {
            identity: identity::FIRST_LABEL,
            cidr_identity: identity::FIRST_CIDR,
        },
    );
    let label_any = key(identity::FIRST_LABEL, proto::ANY, 0, 0);
    let label_8 = key(identity::FIRST_LABEL, proto::TCP, 8, 80);
    let label_16 = key(identity::FIRST_LABEL, proto::TCP, 16, 80);
    let class_16 = key(identity::FIRST_CIDR, proto::TCP, 16, 80);
    m.policy.insert(label_any, entry(1, 0, none, none));
    m.policy.insert(label_8, entry(2, 0, none, none));
    m.policy.insert(class_16, entry(3, 0, none, none));
    let bits = [label_any, label_8, label_16, class_16]
        .iter()
        .fold(0, |b, k| b | k.lookup_bits());
    let e = ep(300, lookups::stored(bits));
    let judged = m.judge(&e, direction::INGRESS, peer, proto::TCP, 80);
    assert_eq!(
        (judged.reason, judged.matched, judged.rule),
        (
            Reason::AllowPolicy,
            Some(label_8),
            RuleRef {
                network_policy: 2,
                ..RuleRef::default()
            }
        )
    );
    // A tiers-only entry in front allows nothing and names nothing.
    let admin = TierSlot::new(4, action::PASS);
    m.policy
        .insert(label_16, entry(9, ENTRY_TIERS_ONLY, admin, none));
    let judged = m.judge(&e, direction::INGRESS, peer, proto::TCP, 80);
    assert_eq!(
        (judged.reason, judged.rule.network_policy),
        (Reason::AllowPolicy, 2)
    );
    // UDP: only the any-protocol entry allows.
    let judged = m.judge(&e, direction::INGRESS, peer, proto::UDP, 53);
    assert_eq!(
        (judged.reason, judged.rule.network_policy),
        (Reason::AllowPolicy, 1)
    );
    // No allowing entry: nothing named.
    m.policy.remove(&label_any);
    let judged = m.judge(&e, direction::INGRESS, peer, proto::UDP, 53);
    assert_eq!(
        (judged.reason, judged.rule),
        (Reason::DropPolicy, RuleRef::default())
    );

    // Under tiers every entry is folded: the best slot of each tier, and
    // still the first allowing entry's rule.
    let tiered = EndpointInfo {
        flags: e.flags | ENDPOINT_INGRESS_TIERED,
        ..e
    };
    let baseline = TierSlot::new(2, action::DENY);
    m.policy.insert(class_16, entry(3, 0, none, baseline));
    let judged = m.judge(&tiered, direction::INGRESS, peer, proto::TCP, 80);
    assert_eq!(
        (judged.reason, judged.rule),
        (
            Reason::AllowPolicy,
            RuleRef {
                network_policy: 2,
                admin,
                baseline,
            }
        )
    );
    // Not isolated: the Baseline tier decides; the record keeps its slot.
    let unisolated = EndpointInfo {
        flags: tiered.flags & !ENDPOINT_INGRESS_ISOLATED,
        ..tiered
    };
    let judged = m.judge(&unisolated, direction::INGRESS, peer, proto::TCP, 80);
    assert_eq!(judged.reason, Reason::DropBaselineTier);
    assert_eq!(
        judged.rule.kept_for(judged.reason),
        RuleRef {
            baseline,
            ..RuleRef::default()
        }
    );
}

/// A tracked flow cut by a policy change keeps what its new judgement
/// found, whether a packet of it or an ICMP error about it meets the
/// change.
#[test]
fn a_flow_cut_by_a_change_names_what_cut_it() {
    use crate::endpoint::ENDPOINT_INGRESS_TIERED;
    use crate::event::RuleRef;
    use crate::policy::{TierSlot, action};
    let mut e = ep(
        300,
        lookups::stored(lookups::ANY_PROTOCOL | lookups::ANY_PEER),
    );
    e.flags |= ENDPOINT_INGRESS_TIERED;
    let any = PolicyKey::new(300, direction::INGRESS, identity::ANY, proto::ANY, 0, 0);
    let mut m = Maps::default();
    m.policy.insert(
        any,
        PolicyEntry {
            rule_ref: 5,
            ..PolicyEntry::default()
        },
    );
    m.endpoints.insert(7, e);
    let mut dp = Datapath::new(m);
    let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
    let query = udp_packet(direction::INGRESS, peer, pod);
    let opened = dp.classify(&query).judgement.map(|j| (j.reason, j.rule));
    assert_eq!(
        opened,
        Some((
            Reason::AllowPolicy,
            RuleRef {
                network_policy: 5,
                ..RuleRef::default()
            }
        ))
    );
    // An Admin deny lands with a new revision.
    let deny = TierSlot::new(1, action::DENY);
    dp.maps.policy.insert(
        any,
        PolicyEntry {
            rule_ref: 5,
            admin: deny,
            ..PolicyEntry::default()
        },
    );
    e.revision = 2;
    dp.maps.endpoints.insert(7, e);
    let cut = RuleRef {
        network_policy: 5,
        admin: deny,
        baseline: TierSlot::NONE,
    };
    // An ICMP error from the pod about the query.
    let error = Packet {
        direction: direction::EGRESS,
        src: pod,
        dst: peer,
        protocol: proto::ICMP,
        sport: 0,
        dport: 0,
        icmp_type: 3,
        quoted: Some(Quoted {
            src: peer,
            dst: pod,
            protocol: proto::UDP,
            sport: 5000,
            dport: 53,
        }),
        ..query
    };
    let j = dp.classify(&error).judgement.map(|j| (j.reason, j.rule));
    assert_eq!(j, Some((Reason::DropPolicyChanged, cut)));
    // The flow is gone; opened again and cut by its next packet.
    dp.maps.policy.insert(
        any,
        PolicyEntry {
            rule_ref: 5,
            ..PolicyEntry::default()
        },
    );
    assert_eq!(dp.classify(&query).reason(), Some(Reason::AllowPolicy));
    dp.maps.policy.insert(
        any,
        PolicyEntry {
            rule_ref: 5,
            admin: deny,
            ..PolicyEntry::default()
        },
    );
    e.revision = 3;
    dp.maps.endpoints.insert(7, e);
    let j = dp.classify(&query).judgement.map(|j| (j.reason, j.rule));
    assert_eq!(j, Some((Reason::DropPolicyChanged, cut)));
}

/// The kernel keeps one conntrack entry for both ways of a tuple: a
/// connection opened the other way on a closing flow's tuple replaces it,
/// so the first flow's packets are answers to the new one from then on.
/// ICMP echo keeps its roles apart: a request each way is two flows.
#[test]
fn a_connection_is_one_flow_whichever_way_it_was_opened() {
    let mut m = Maps::default();
    m.policy.insert(
        PolicyKey::new(300, direction::INGRESS, identity::WORLD, proto::TCP, 16, 80),
        PolicyEntry::default(),
    );
    m.endpoints.insert(7, ep(300, lookups::port_prefix(16)));
    let mut dp = Datapath::new(m);
    let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5));
    let tcp = |direction, flags| {
        let (src, dst, sport, dport) = if direction == direction::INGRESS {
            (peer, pod, 40000, 80)
        } else {
            (pod, peer, 80, 40000)
        };
        Packet {
            ifindex: 7,
            direction,
            src,
            dst,
            protocol: proto::TCP,
            sport,
            dport,
            tcp_flags: flags,
            icmp_type: 0,
            hop_limit: 64,
            quoted: None,
            mark: 0,
            ingress_ifindex: 0,
        }
    };
    assert_eq!(
        dp.classify(&tcp(direction::INGRESS, TCP_SYN)).reason(),
        Some(Reason::AllowPolicy)
    );
    assert_eq!(
        dp.classify(&tcp(direction::INGRESS, TCP_FIN | TCP_ACK))
            .reason(),
        Some(Reason::AllowEstablished)
    );
    // The pod opens a connection on the closing flow's tuple.
    let opened = dp.classify(&tcp(direction::EGRESS, TCP_SYN)).reason();
    assert!(opened.is_some_and(|r| !r.is_drop()), "{opened:?}");
    assert_eq!(dp.flows.len(), 1);
    assert_eq!(
        dp.classify(&tcp(direction::INGRESS, TCP_ACK)).reason(),
        Some(Reason::AllowReply)
    );

    let echo = |direction, icmp_type| Packet {
        protocol: proto::ICMP,
        sport: 9,
        dport: 9,
        icmp_type,
        ..tcp(direction, 0)
    };
    dp.maps.policy.insert(
        PolicyKey::new(300, direction::INGRESS, identity::WORLD, proto::ANY, 0, 0),
        PolicyEntry::default(),
    );
    let mut e = ep(300, lookups::port_prefix(16) | lookups::ANY_PROTOCOL);
    e.revision = 2;
    dp.maps.endpoints.insert(7, e);
    dp.flows.clear();
    assert!(dp.classify(&echo(direction::EGRESS, 8)).reason().is_some());
    assert!(dp.classify(&echo(direction::INGRESS, 8)).reason().is_some());
    assert_eq!(dp.flows.len(), 2);
    assert_eq!(
        dp.classify(&echo(direction::INGRESS, 0)).reason(),
        Some(Reason::AllowReply)
    );
}
