//! Flow records named: each kind of rule reference against name tables
//! built here, the JSON a reader sees, names that outlive their rule, the
//! `flows` filters, and the bounds (metric series, subscriber queues).
use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use policy_agent::{
    datapath::bpf::{
        events::{DropRecord, decode},
        flows::{
            Error,
            clock::WallClock,
            filter::FlowFilter,
            hub::{Hub, MAX_SUBSCRIBERS},
            naming::{FlowNamer, NameSource, Names, live_labels, name_record},
            record::{Flow, FlowEvent, Verdict},
            stats::{FlowStats, MAX_SERIES, RuleLabels},
        },
        loader::endpoint_meta,
        name_tables::NameTables,
    },
    mapstate::{identity_name, rule_name},
};
use policy_common::{
    direction::{EGRESS, INGRESS},
    event::{FlowRecord, RuleRef},
    family,
    identity::kind as identity_kind,
    policy::{TierSlot, action},
    proto,
    rule_name::{RuleKey, RuleName, kind},
    verdict::Reason,
};
use serde_json::json;

const WEB: u32 = 10;
const DB: u32 = 11;
const WEB_ID: u32 = 300;
const CLIENT_ID: u32 = 301;
const NP_REF: u32 = 7;

fn admin_slot(act: u32) -> TierSlot {
    TierSlot::new(TierSlot::rule_rank(10, 0, 1), act)
}

fn baseline_slot(act: u32) -> TierSlot {
    TierSlot::new(TierSlot::rule_rank(50, 2, 0), act)
}

fn isolating(dir: u8, identity: u32, policies: &[(&str, &str)]) -> Vec<(RuleKey, RuleName)> {
    policies
        .iter()
        .enumerate()
        .map(|(i, (ns, name))| {
            (
                RuleKey::isolating(dir, identity, i as u16),
                rule_name(dir, usize::from(u16::MAX), 0, ns, name, ""),
            )
        })
        .collect()
}

/// Two local pods (web, db), a client identity, a NetworkPolicy rule,
/// an Admin and a Baseline rule, and three policies isolating web.
fn names() -> Names {
    let mut rules = BTreeMap::new();
    rules.insert(
        RuleKey::new(kind::NETWORK_POLICY, INGRESS, NP_REF),
        rule_name(INGRESS, 1, 0, "default", "allow-client", ""),
    );
    rules.insert(
        RuleKey::new(kind::ADMIN, INGRESS, admin_slot(0).rank()),
        rule_name(INGRESS, 1, 10, "", "cluster-guard", "block-client"),
    );
    rules.insert(
        RuleKey::new(kind::BASELINE, INGRESS, baseline_slot(0).rank()),
        rule_name(INGRESS, 0, 50, "", "baseline-default", ""),
    );
    rules.extend(isolating(
        INGRESS,
        WEB_ID,
        &[
            ("default", "allow-client"),
            ("default", "deny-all"),
            ("ops", "z"),
        ],
    ));
    let mut identities = BTreeMap::new();
    identities.insert(
        CLIENT_ID,
        identity_name(identity_kind::LABELS, "ns=default,app=client"),
    );
    identities.insert(
        WEB_ID,
        identity_name(identity_kind::LABELS, "ns=default,app=web"),
    );
    let mut endpoints = BTreeMap::new();
    endpoints.insert(WEB, endpoint_meta("default/web", 0));
    endpoints.insert(DB, endpoint_meta("default/db", 0));
    let mut addresses = BTreeMap::new();
    addresses.insert("10.0.0.2".parse::<IpAddr>().unwrap(), DB);
    Names {
        tables: NameTables {
            identities: identities
                .into_iter()
                .map(|(id, name)| (id, std::sync::Arc::new(name)))
                .collect(),
            endpoints,
            rules,
        },
        addresses,
    }
}

fn v4(a: &str) -> [u8; 16] {
    let ip: std::net::Ipv4Addr = a.parse().unwrap();
    let mut out = [0; 16];
    out[..4].copy_from_slice(&ip.octets());
    out
}

/// A record of web's ingress from 192.168.1.5 to port 80.
fn record(reason: Reason, rule: RuleRef) -> FlowRecord {
    FlowRecord {
        timestamp_ns: 1_500_000,
        ifindex: WEB,
        endpoint_identity: WEB_ID,
        peer_identity: CLIENT_ID,
        peer_cidr_identity: 2,
        src: v4("192.168.1.5"),
        dst: v4("10.0.0.1"),
        sport: 40000,
        dport: 80,
        protocol: proto::TCP,
        family: family::IPV4,
        direction: INGRESS,
        reason: reason as u8,
        rule: rule.kept_for(reason),
        ..FlowRecord::default()
    }
}

fn all_refs() -> RuleRef {
    RuleRef {
        network_policy: NP_REF,
        admin: admin_slot(action::DENY),
        baseline: baseline_slot(action::ACCEPT),
    }
}

/// 2024-02-29T12:34:56Z, minus the record's 1.5 ms.
const CLOCK: WallClock = WallClock::with_offset(1_709_210_096_000_000_000 - 1_500_000);

fn named(r: &FlowRecord) -> FlowEvent {
    name_record(&names(), &CLOCK, r)
}

fn policy_names(flow: &Flow) -> Vec<String> {
    flow.policies.iter().map(ToString::to_string).collect()
}

#[test]
fn an_allowed_flow_names_its_network_policy_rule_in_exactly_these_fields() {
    let e = named(&record(Reason::AllowPolicy, all_refs()));
    assert_eq!(
        serde_json::to_value(&e.flow).unwrap(),
        json!({
            "time": "2024-02-29T12:34:56.000000Z",
            "direction": "ingress",
            "pod": "default/web",
            "peer": {"ip": "192.168.1.5"},
            "peer_identity": "ns=default,app=client",
            "protocol": "TCP",
            "port": 80,
            "verdict": "allow",
            "reason": "allow_policy",
            "policies": [{
                "kind": "NetworkPolicy",
                "namespace": "default",
                "name": "allow-client",
                "rule": 1,
                "rule_name": null,
                "tier": null,
                "priority": null
            }],
            "staged": null
        })
    );
    assert_eq!(
        e.flow.to_string(),
        "2024-02-29T12:34:56.000000Z ingress default/web 192.168.1.5 TCP/80 allow allow_policy default/allow-client[1]"
    );
}

#[test]
fn a_tier_verdict_names_the_deciding_slot() {
    let e = named(&record(Reason::DropAdminTier, all_refs()));
    assert_eq!(e.flow.verdict, Verdict::Drop);
    assert_eq!(
        serde_json::to_value(&e.flow.policies).unwrap(),
        json!([{
            "kind": "ClusterNetworkPolicy",
            "namespace": null,
            "name": "cluster-guard",
            "rule": 1,
            "rule_name": "block-client",
            "tier": "Admin",
            "priority": 10
        }])
    );
    let e = named(&record(Reason::AllowBaselineTier, all_refs()));
    assert_eq!(policy_names(&e.flow), ["Baseline:baseline-default[0]"]);
    assert_eq!(e.flow.policies[0].priority, Some(50));
}

#[test]
fn a_policy_drop_names_every_policy_isolating_the_pod() {
    let e = named(&record(Reason::DropPolicy, all_refs()));
    assert_eq!(
        policy_names(&e.flow),
        ["default/allow-client", "default/deny-all", "ops/z"]
    );
    assert!(e.flow.policies.iter().all(|p| p.rule.is_none()));
    // In the other direction nothing isolates web: said, not dropped.
    let mut r = record(Reason::DropPolicy, all_refs());
    r.direction = EGRESS;
    let e = named(&r);
    assert_eq!(e.flow.policies.len(), 1);
    assert_eq!(
        e.flow.policies[0].name,
        format!("unknown policy isolating identity {WEB_ID}")
    );
}

#[test]
fn a_changed_policy_drop_names_the_deny_that_decided_it() {
    let e = named(&record(Reason::DropPolicyChanged, all_refs()));
    assert_eq!(
        policy_names(&e.flow),
        ["Admin:cluster-guard[1 \"block-client\"]"]
    );
    let baseline_deny = RuleRef {
        network_policy: NP_REF,
        admin: admin_slot(action::PASS),
        baseline: baseline_slot(action::DENY),
    };
    let e = named(&record(Reason::DropPolicyChanged, baseline_deny));
    assert_eq!(policy_names(&e.flow), ["Baseline:baseline-default[0]"]);
    let no_deny = RuleRef {
        network_policy: NP_REF,
        admin: TierSlot::NONE,
        baseline: baseline_slot(action::ACCEPT),
    };
    let e = named(&record(Reason::DropPolicyChanged, no_deny));
    assert_eq!(e.flow.policies.len(), 3);
}

#[test]
fn other_reasons_name_no_policy() {
    for reason in [
        Reason::AllowNotIsolated,
        Reason::DropUpdating,
        Reason::DropSpoofed,
    ] {
        let e = named(&record(reason, all_refs()));
        assert!(e.flow.policies.is_empty(), "{reason:?}");
    }
}

#[test]
fn an_unknown_rule_is_named_as_unknown() {
    let refs = RuleRef {
        network_policy: 0x63,
        ..RuleRef::default()
    };
    let e = named(&record(Reason::AllowPolicy, refs));
    assert_eq!(e.flow.policies[0].name, "unknown rule 0x00000063");
    assert!(e.flow.policies[0].is_unknown());
    let slot = TierSlot::new(TierSlot::rule_rank(7, 0, 3), action::DENY);
    let e = named(&record(
        Reason::DropAdminTier,
        RuleRef {
            admin: slot,
            ..RuleRef::default()
        },
    ));
    let p = &e.flow.policies[0];
    assert_eq!(p.name, format!("unknown rule 0x{:08x}", slot.rank()));
    assert_eq!((p.rule, p.priority), (Some(3), Some(7)));
}

#[test]
fn peers_protocols_and_ports() {
    let mut r = record(Reason::DropPolicy, all_refs());
    r.direction = EGRESS;
    r.src = v4("10.0.0.1");
    r.dst = v4("10.0.0.2");
    let e = named(&r);
    assert_eq!(
        serde_json::to_value(&e.flow.peer).unwrap(),
        json!({"pod": "default/db", "ip": "10.0.0.2"})
    );
    r.protocol = proto::ICMP;
    let e = named(&r);
    assert_eq!((e.flow.protocol.as_str(), e.flow.port), ("ICMP", None));
    r.protocol = 47;
    let e = named(&r);
    assert_eq!(e.flow.protocol, "47");
    assert_eq!(serde_json::to_value(&e.flow).unwrap()["port"], json!(null));
    let drop = DropRecord::of(&e).unwrap();
    assert_eq!(drop.protocol, "proto 47");
    assert_eq!(drop.peer, "ns=default,app=client");
    assert!(DropRecord::of(&named(&record(Reason::AllowPolicy, all_refs()))).is_none());
}

#[test]
fn the_wire_form_reads_back() {
    let e = named(&record(Reason::DropPolicy, all_refs()));
    let line = serde_json::to_string(&e).unwrap();
    assert_eq!(serde_json::from_str::<FlowEvent>(&line).unwrap(), e);
}

#[test]
fn ring_records_shorter_than_a_flow_record_are_skipped() {
    let size = std::mem::size_of::<FlowRecord>();
    assert!(decode(&vec![0; size - 1]).is_none());
    assert!(decode(&vec![0; size]).is_some());
}

/// Names read from a list, one entry a read (the last repeats).
struct Reads(Vec<Names>);

impl NameSource for Reads {
    fn read(&mut self) -> Result<Names, Error> {
        if self.0.len() > 1 {
            Ok(self.0.remove(0))
        } else {
            Ok(self.0[0].clone())
        }
    }
}

fn without_rules(mut n: Names, keep: impl Fn(&RuleKey) -> bool) -> Names {
    n.tables.rules.retain(|k, _| keep(k));
    n
}

#[test]
fn a_removed_rule_stays_named_and_a_miss_reads_again() {
    let full = names();
    let none = without_rules(full.clone(), |_| false);
    // First read: everything; then it is all gone.
    let mut namer = FlowNamer::new(Reads(vec![full.clone(), none.clone()]), CLOCK);
    namer.refresh().unwrap();
    let e = namer.name(&record(Reason::AllowPolicy, all_refs()));
    assert_eq!(policy_names(&e.flow), ["default/allow-client[1]"]);

    // Nothing at first; the rule appears in the pins later: a miss reads
    // them again (once the last read is old enough).
    let mut namer = FlowNamer::new(Reads(vec![none, full]), CLOCK);
    let e = namer.name(&record(Reason::AllowPolicy, all_refs()));
    assert!(e.flow.policies[0].is_unknown());
    std::thread::sleep(Duration::from_millis(120));
    let e = namer.name(&record(Reason::AllowPolicy, all_refs()));
    assert_eq!(policy_names(&e.flow), ["default/allow-client[1]"]);
}

/// A name handed over before its removal (the daemon does so for every
/// name a sync removes) names records its namer never saw in the pins.
#[test]
fn a_name_handed_over_before_its_removal_names_later_records() {
    let full = names();
    let none = without_rules(full.clone(), |_| false);
    let mut namer = FlowNamer::new(Reads(vec![none]), CLOCK);
    let e = namer.name(&record(Reason::AllowPolicy, all_refs()));
    assert!(e.flow.policies[0].is_unknown());
    namer.keep(full.tables.rules.clone());
    let e = namer.name(&record(Reason::AllowPolicy, all_refs()));
    assert_eq!(policy_names(&e.flow), ["default/allow-client[1]"]);
}

#[test]
fn an_isolating_list_is_replaced_whole_and_kept_when_gone() {
    let full = names();
    let only_first = without_rules(full.clone(), |k| k.kind != kind::ISOLATING || k.index == 0);
    let none = without_rules(full.clone(), |k| k.kind != kind::ISOLATING);
    let mut namer = FlowNamer::new(Reads(vec![full, only_first, none]), CLOCK);
    namer.refresh().unwrap();
    let e = namer.name(&record(Reason::DropPolicy, all_refs()));
    assert_eq!(policy_names(&e.flow), ["default/allow-client"]);
    namer.refresh().unwrap();
    let e = namer.name(&record(Reason::DropPolicy, all_refs()));
    assert_eq!(policy_names(&e.flow), ["default/allow-client"]);
}

fn flow_with(pod: &str, peer: &str, verdict: Verdict, reason: Reason) -> Flow {
    let mut r = record(reason, all_refs());
    if verdict == Verdict::Drop && reason.admits_new_flow() {
        r.reason = Reason::DropPolicy as u8;
    }
    let mut f = named(&r).flow;
    f.pod = pod.to_owned();
    f.peer = policy_agent::datapath::bpf::flows::record::Peer::pod(peer, "10.0.0.9");
    f
}

#[test]
fn filters() {
    let allowed = flow_with(
        "default/web",
        "prod/api",
        Verdict::Allow,
        Reason::AllowPolicy,
    );
    let dropped = flow_with("default/web", "prod/api", Verdict::Drop, Reason::DropPolicy);
    let all = FlowFilter::default();
    assert!(all.matches(&allowed) && all.matches(&dropped));
    let by_pod = |p: &str| FlowFilter {
        pod: Some(p.into()),
        ..FlowFilter::default()
    };
    assert!(by_pod("default/web").matches(&allowed));
    assert!(by_pod("prod/api").matches(&allowed));
    assert!(!by_pod("default/db").matches(&allowed));
    let by_ns = |n: &str| FlowFilter {
        namespace: Some(n.into()),
        ..FlowFilter::default()
    };
    assert!(by_ns("prod").matches(&allowed));
    assert!(!by_ns("kube-system").matches(&allowed));
    let drops = FlowFilter {
        verdict: Some(Verdict::Drop),
        ..FlowFilter::default()
    };
    assert!(!drops.matches(&allowed) && drops.matches(&dropped));
    let by_policy = |p: &str| FlowFilter {
        policy: Some(p.into()),
        ..FlowFilter::default()
    };
    assert!(by_policy("allow-client").matches(&allowed));
    assert!(by_policy("default/allow-client").matches(&allowed));
    assert!(!by_policy("ops/allow-client").matches(&allowed));
    assert!(by_policy("ops/z").matches(&dropped));
    assert!(!by_policy("deny-all").matches(&allowed));
}

fn labels(name: &str) -> RuleLabels {
    RuleLabels {
        kind: "NetworkPolicy".into(),
        namespace: "default".into(),
        name: name.into(),
        rule: "0".into(),
        direction: "ingress",
    }
}

#[test]
fn per_policy_series_are_bounded_and_pruned() {
    let stats = FlowStats::default();
    let base = named(&record(Reason::AllowPolicy, all_refs())).flow;
    for i in 0..MAX_SERIES + 5 {
        let mut f = base.clone();
        f.policies[0].name = format!("p{i}");
        f.policies[0].rule = Some(0);
        stats.count(Some(Reason::AllowPolicy), &f);
    }
    assert_eq!(stats.series(), MAX_SERIES);
    assert_eq!(stats.other("ingress", "allow"), 5);
    assert_eq!(stats.get(&labels("p0"), "allow"), Some(1));
    // A dropped packet that is no new flow is not counted per policy.
    stats.count(Some(Reason::DropPolicyChanged), &base);
    assert_eq!(stats.get(&labels("allow-client"), "allow"), None);
    // Only rules the pins still name keep their series.
    let live = [labels("p1")].into_iter().collect();
    stats.retain(&live);
    assert_eq!(stats.series(), 1);
    let mut out = String::new();
    stats.render(&mut out, 3, 4);
    assert!(out.contains(
        "policy_agent_policy_flows_total{kind=\"NetworkPolicy\",namespace=\"default\",name=\"p1\",rule=\"0\",direction=\"ingress\",verdict=\"allow\"} 1"
    ));
    assert!(out.contains("policy_agent_policy_flows_total{kind=\"other\",namespace=\"\",name=\"\",rule=\"\",direction=\"ingress\",verdict=\"allow\"} 5"));
    assert!(out.contains("policy_agent_flow_records_lost_total{cause=\"budget\"} 3"));
    assert!(out.contains("policy_agent_flow_records_lost_total{cause=\"ring\"} 4"));
    assert!(out.contains("policy_agent_flow_records_lost_total{cause=\"subscriber\"} 0"));
}

#[test]
fn live_labels_match_what_flows_count() {
    let n = names();
    let live = live_labels(&n.tables.rules);
    for reason in [
        Reason::AllowPolicy,
        Reason::DropAdminTier,
        Reason::AllowBaselineTier,
        Reason::DropPolicy,
    ] {
        let f = named(&record(reason, all_refs())).flow;
        for p in &f.policies {
            assert!(
                live.contains(&RuleLabels::of(p, "ingress")),
                "{reason:?} {p}"
            );
        }
    }
}

#[test]
fn a_slow_subscriber_loses_records_and_never_blocks() {
    let hub = Hub::default();
    let slow = hub.subscribe_with(4).unwrap();
    let fast = hub.subscribe_with(100).unwrap();
    for i in 0..10 {
        hub.publish(&format!("line {i}").into());
    }
    assert_eq!(hub.lost(), 6);
    assert_eq!(slow.try_iter().count(), 4);
    assert_eq!(fast.try_iter().count(), 10);
    // A subscriber that left is forgotten at the next record.
    drop(slow);
    hub.publish(&"x".into());
    assert_eq!(hub.subscribers(), 1);
    let _more: Vec<_> = (1..MAX_SUBSCRIBERS)
        .map(|_| hub.subscribe().unwrap())
        .collect();
    assert!(hub.subscribe().is_none());
}
