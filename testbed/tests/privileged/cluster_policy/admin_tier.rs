//! The upstream Admin tier tests of the standard channel (TCP, UDP, inline
//! CIDR, gress combined, priority), on the node's world as mod.rs maps it.
//! Upstream's ports (TCP 80 and 8080, UDP 53 and 5353) are the ones every
//! pod here serves; its SCTP items stay in the policies but SCTP is not
//! probed (the SCTP tests live elsewhere). CNPAdminTierIngressTCP and
//! CNPAdminTierIntegration are in mod.rs.
use policy_testbed::Transport::{Tcp, Udp};
use policy_testbed::fixtures::conformance::{Backend, labels};

use super::model::{
    Action, CEDRIC_0, CEDRIC_1, DRACO_0, DRACO_1, Dir, GRYFFINDOR, HARRY_0, HARRY_1, HUFFLEPUFF,
    LUNA_0, LUNA_1, Poke, Policy, Rule, Sel, Tier, edited_in_place, host_prefixes, ladder, policy,
    rule, sctp, stage, tcp, udp,
};

/// CNPAdminTierEgressTCP's probes, by the state upstream runs them on
/// (see `edited_in_place`). CNPBaselineTierEgressTCP probes the first two.
pub(super) const EGRESS_TCP_POKES: [&[Poke]; 4] = [
    // allow-egress: rule 0 before rule 1; at the specified port: rule 5,
    // then rule 6.
    &[
        (HARRY_0, LUNA_0, Tcp, 80, true),
        (HARRY_1, LUNA_0, Tcp, 8080, true),
        (HARRY_0, CEDRIC_1, Tcp, 8080, true),
        (HARRY_1, CEDRIC_1, Tcp, 80, false),
    ],
    // deny-egress: Deny now first; at the specified port: rule 3, and
    // other ports match nothing.
    &[
        (HARRY_0, LUNA_1, Tcp, 80, false),
        (HARRY_1, LUNA_1, Tcp, 8080, false),
        (HARRY_0, DRACO_0, Tcp, 80, false),
        (HARRY_1, DRACO_0, Tcp, 8080, true),
    ],
    // pass-egress: Pass first, nothing in the later tiers.
    &[
        (HARRY_0, LUNA_0, Tcp, 80, true),
        (HARRY_1, LUNA_0, Tcp, 8080, true),
    ],
    // pass-egress at the specified port.
    &[
        (HARRY_0, DRACO_0, Tcp, 80, true),
        (HARRY_1, DRACO_0, Tcp, 8080, true),
    ],
];

/// CNPAdminTierEgressUDP's probes (hufflepuff's egress); the Baseline test
/// probes the first two.
pub(super) const EGRESS_UDP_POKES: [&[Poke]; 4] = [
    &[
        (CEDRIC_0, LUNA_0, Udp, 53, true),
        (CEDRIC_1, LUNA_0, Udp, 5353, true),
        (CEDRIC_0, HARRY_1, Udp, 53, true),
        (CEDRIC_1, HARRY_1, Udp, 5353, false),
    ],
    &[
        (CEDRIC_0, LUNA_1, Udp, 53, false),
        (CEDRIC_1, LUNA_1, Udp, 5353, false),
        (CEDRIC_0, DRACO_0, Udp, 5353, false),
        (CEDRIC_1, DRACO_0, Udp, 53, true),
    ],
    &[
        (CEDRIC_0, LUNA_1, Udp, 5353, true),
        (CEDRIC_1, LUNA_1, Udp, 53, true),
    ],
    &[
        (CEDRIC_0, DRACO_0, Udp, 5353, true),
        (CEDRIC_1, DRACO_0, Udp, 53, true),
    ],
];

/// CNPAdminTierIngressUDP's probes (hufflepuff's ingress); the Baseline
/// test probes the first two.
pub(super) const INGRESS_UDP_POKES: [&[Poke]; 4] = [
    &[
        (LUNA_0, CEDRIC_0, Udp, 53, true),
        (LUNA_1, CEDRIC_0, Udp, 5353, true),
        (HARRY_0, CEDRIC_1, Udp, 53, true),
        (HARRY_1, CEDRIC_1, Udp, 5353, false),
    ],
    &[
        (LUNA_0, CEDRIC_1, Udp, 53, false),
        (LUNA_1, CEDRIC_1, Udp, 5353, false),
        (DRACO_0, CEDRIC_0, Udp, 5353, false),
        (DRACO_1, CEDRIC_0, Udp, 53, true),
    ],
    &[
        (LUNA_0, CEDRIC_1, Udp, 5353, true),
        (LUNA_1, CEDRIC_1, Udp, 53, true),
    ],
    &[
        (DRACO_0, CEDRIC_0, Udp, 5353, true),
        (DRACO_1, CEDRIC_0, Udp, 53, true),
    ],
];

/// CNPAdminTierGress's probes, egress then ingress in each subtest (its
/// SCTP probes left out); the Baseline test probes the first two.
pub(super) const GRESS_POKES: [&[Poke]; 4] = [
    &[
        // allow-gress
        (HARRY_0, LUNA_0, Tcp, 80, true),
        (HARRY_1, LUNA_0, Udp, 53, true),
        (LUNA_0, HARRY_0, Tcp, 80, true),
        (LUNA_1, HARRY_0, Udp, 53, true),
        // allow-gress at the specified ports
        (HARRY_0, CEDRIC_1, Tcp, 8080, true),
        (HARRY_1, CEDRIC_1, Tcp, 80, false),
        (HARRY_0, CEDRIC_1, Udp, 5353, true),
        (HARRY_1, CEDRIC_1, Udp, 53, false),
        (CEDRIC_0, HARRY_1, Tcp, 80, true),
        (CEDRIC_1, HARRY_1, Tcp, 8080, false),
        (CEDRIC_0, HARRY_1, Udp, 5353, true),
        (CEDRIC_1, HARRY_1, Udp, 53, false),
    ],
    &[
        // deny-gress
        (HARRY_0, LUNA_1, Tcp, 80, false),
        (HARRY_1, LUNA_1, Udp, 53, false),
        (LUNA_0, HARRY_1, Tcp, 80, false),
        (LUNA_1, HARRY_1, Udp, 53, false),
        // deny-gress at the specified ports
        (HARRY_0, DRACO_0, Tcp, 80, false),
        (HARRY_1, DRACO_0, Tcp, 8080, true),
        (HARRY_0, DRACO_0, Udp, 53, false),
        (HARRY_1, DRACO_0, Udp, 5353, true),
        (DRACO_0, HARRY_0, Tcp, 80, false),
        (DRACO_1, HARRY_0, Tcp, 8080, true),
        (DRACO_0, HARRY_0, Udp, 53, false),
        (DRACO_1, HARRY_0, Udp, 5353, true),
    ],
    &[
        // pass-gress
        (HARRY_0, LUNA_0, Tcp, 80, true),
        (HARRY_0, LUNA_0, Udp, 5353, true),
        (LUNA_0, HARRY_0, Tcp, 80, true),
        (LUNA_1, HARRY_0, Udp, 53, true),
    ],
    &[
        // pass-gress at the specified ports
        (HARRY_0, DRACO_0, Tcp, 80, true),
        (HARRY_1, DRACO_0, Tcp, 8080, true),
        (HARRY_0, DRACO_0, Udp, 53, true),
        (HARRY_1, DRACO_0, Udp, 5353, true),
        (DRACO_0, HARRY_0, Tcp, 80, true),
        (DRACO_1, HARRY_0, Tcp, 8080, true),
        (DRACO_0, HARRY_0, Udp, 53, true),
        (DRACO_1, HARRY_0, Udp, 5353, true),
    ],
];

/// The gress-rules policy's lists (upstream's names, up to "port" and
/// "ports"), for both tiers.
pub(super) fn gress_rules(tier: Tier, policy: &mut Policy) {
    let slytherin = [tcp(80), udp(53), sctp(9003)];
    policy.egress = ladder(
        tier,
        Dir::Egress,
        &slytherin,
        (
            "hufflepuff",
            HUFFLEPUFF,
            &[tcp(8080), udp(5353), sctp(9003)],
        ),
    );
    policy.ingress = ladder(
        tier,
        Dir::Ingress,
        &slytherin,
        ("hufflepuff", HUFFLEPUFF, &[tcp(80), udp(5353), sctp(9003)]),
    );
}

/// CNPAdminTierEgressTCP: gryffindor's egress.
fn cnp_admin_tier_egress_tcp(prefix: &'static str, backend: Backend) {
    let mut p = policy("egress-tcp", Tier::Admin, 6, GRYFFINDOR);
    p.egress = ladder(
        Tier::Admin,
        Dir::Egress,
        &[tcp(80)],
        ("hufflepuff", HUFFLEPUFF, &[tcp(8080)]),
    );
    edited_in_place(
        "CNPAdminTierEgressTCP",
        (prefix, backend),
        p,
        &EGRESS_TCP_POKES,
    );
}

/// CNPAdminTierEgressUDP: hufflepuff's egress, gryffindor the third house.
fn cnp_admin_tier_egress_udp(prefix: &'static str, backend: Backend) {
    let mut p = policy("egress-udp", Tier::Admin, 7, HUFFLEPUFF);
    p.egress = ladder(
        Tier::Admin,
        Dir::Egress,
        &[udp(5353)],
        ("gryffindor", GRYFFINDOR, &[udp(53)]),
    );
    edited_in_place(
        "CNPAdminTierEgressUDP",
        (prefix, backend),
        p,
        &EGRESS_UDP_POKES,
    );
}

/// CNPAdminTierIngressUDP: hufflepuff's ingress, gryffindor the third
/// house.
fn cnp_admin_tier_ingress_udp(prefix: &'static str, backend: Backend) {
    let mut p = policy("ingress-udp", Tier::Admin, 4, HUFFLEPUFF);
    p.ingress = ladder(
        Tier::Admin,
        Dir::Ingress,
        &[udp(5353)],
        ("gryffindor", GRYFFINDOR, &[udp(53)]),
    );
    edited_in_place(
        "CNPAdminTierIngressUDP",
        (prefix, backend),
        p,
        &INGRESS_UDP_POKES,
    );
}

/// CNPAdminTierGress: gryffindor's egress and ingress in one policy, each
/// rule over TCP, UDP (and SCTP) ports at once; upstream swaps the same
/// rules in both directions.
fn cnp_admin_tier_gress(prefix: &'static str, backend: Backend) {
    let mut p = policy("gress-rules", Tier::Admin, 15, GRYFFINDOR);
    gress_rules(Tier::Admin, &mut p);
    edited_in_place("CNPAdminTierGress", (prefix, backend), p, &GRESS_POKES);
}

/// The inline CIDR tests' probes, by stage (both tiers). Upstream's
/// `luna-lovegood-1` and `cedric-diggory-1` stand for pods of those houses
/// whose address the inserted Accept does not list: here alpha/db.
const INLINE_CIDR_POKES: [&[Poke]; 4] = [
    // deny-egress to 0.0.0.0/0 (and ::/0); slytherin Accepted before it.
    &[
        (HARRY_1, LUNA_0, Tcp, 80, false),
        (HARRY_1, LUNA_0, Udp, 53, false),
        (HARRY_1, CEDRIC_0, Tcp, 80, false),
        (HARRY_1, CEDRIC_0, Udp, 53, false),
        (HARRY_1, DRACO_0, Tcp, 80, true),
        (HARRY_1, DRACO_0, Udp, 53, true),
    ],
    // slytherin relabelled: the Accept no longer matches.
    &[
        (HARRY_1, DRACO_0, Tcp, 80, false),
        (HARRY_1, DRACO_0, Udp, 53, false),
    ],
    // its label back.
    &[
        (HARRY_1, DRACO_0, Tcp, 80, true),
        (HARRY_1, DRACO_0, Udp, 53, true),
    ],
    // allow-egress to two pods' addresses, inserted first.
    &[
        (HARRY_1, LUNA_0, Tcp, 80, true),
        (HARRY_1, LUNA_0, Udp, 53, true),
        (HARRY_1, CEDRIC_0, Tcp, 80, true),
        (HARRY_1, CEDRIC_0, Udp, 53, true),
        (HARRY_1, "alpha/db", Tcp, 80, false),
        (HARRY_1, "alpha/db", Udp, 53, false),
    ],
];

/// The inline CIDR tests, either tier: `policy` holds the Accept of
/// slytherin and the Deny of every address. Slytherin is selected by
/// `team: c` (upstream: by its house label, which the test rewrites; a
/// namespace's name label cannot change). Upstream lists each pod's one
/// address; both families' are listed here, so the Accept shows in both
/// halves of the matrix.
pub(super) fn inline_cidr(test: &str, (prefix, backend): (&'static str, Backend), policy: Policy) {
    let mut c = crate::flow_audit::audited(prefix, backend);
    let mut policies = vec![policy];
    stage(
        &c,
        &format!("{test}, as written"),
        &policies,
        INLINE_CIDR_POKES[0],
    );
    let before = c.ns_mut("gamma").labels.clone();
    c.ns_mut("gamma").labels = labels(&[("team", "denied-namespace-label")]);
    c.write_cluster();
    stage(
        &c,
        &format!("{test}, gamma relabelled"),
        &policies,
        INLINE_CIDR_POKES[1],
    );
    c.ns_mut("gamma").labels = before;
    c.write_cluster();
    stage(
        &c,
        &format!("{test}, gamma's label back"),
        &policies,
        INLINE_CIDR_POKES[2],
    );
    let [api4, api6] = host_prefixes(&c, LUNA_0);
    let [web4, web6] = host_prefixes(&c, CEDRIC_0);
    policies[0].egress.insert(
        0,
        rule(
            "allow-egress-to-specific-podIPs",
            Action::Accept,
            Sel::Networks(vec![api4, web4, api6, web6]),
            &[],
        ),
    );
    stage(
        &c,
        &format!("{test}, pod addresses Accepted first"),
        &policies,
        INLINE_CIDR_POKES[3],
    );
}

/// The inline CIDR policies' two rules.
pub(super) fn inline_cidr_rules() -> Vec<Rule> {
    vec![
        rule(
            "allow-egress-to-slytherin",
            Action::Accept,
            Sel::Pods(("team", "c"), None),
            &[],
        ),
        rule(
            "deny-egress-to-internet",
            Action::Deny,
            Sel::Networks(vec!["0.0.0.0/0".into(), "::/0".into()]),
            &[],
        ),
    ]
}

/// CNPAdminTierEgressInlineCIDRPeers: gryffindor's pods (by house label,
/// `team: b`) deny every address but slytherin's pods; then two pods'
/// addresses Accepted ahead of that.
fn cnp_admin_tier_egress_inline_cidr_peers(prefix: &'static str, backend: Backend) {
    let mut p = policy(
        "inline-cidr-as-peers-example",
        Tier::Admin,
        85,
        Sel::Pods(("team", "b"), None),
    );
    p.egress = inline_cidr_rules();
    inline_cidr("CNPAdminTierEgressInlineCIDRPeers", (prefix, backend), p);
}

/// CNPAdminTierPriorityField: a Deny at priority 50 over a Pass at 60,
/// both ways between gryffindor and slytherin (by house label: `team`);
/// then the Pass moved to 40, handing both to the Baseline Accept.
fn cnp_admin_tier_priority_field(prefix: &'static str, backend: Backend) {
    let c = crate::flow_audit::audited(prefix, backend);
    let gryffindor = Sel::Pods(("team", "b"), None);
    let slytherin = Sel::Pods(("team", "c"), None);
    let both_ways = |name: &'static str, tier, priority, action, verb: &str| {
        let mut p = policy(name, tier, priority, gryffindor.clone());
        p.ingress = vec![rule(
            &format!("{verb}-all-ingress-from-slytherin"),
            action,
            slytherin.clone(),
            &[],
        )];
        p.egress = vec![rule(
            &format!("{verb}-all-egress-to-slytherin"),
            action,
            slytherin.clone(),
            &[],
        )];
        p
    };
    let mut policies = vec![
        both_ways("priority-50-example", Tier::Admin, 50, Action::Deny, "deny"),
        both_ways(
            "old-priority-60-new-priority-40-example",
            Tier::Admin,
            60,
            Action::Pass,
            "pass",
        ),
        both_ways("default", Tier::Baseline, 10, Action::Accept, "allow"),
    ];
    let pokes = |open| -> [Poke; 4] {
        [
            (DRACO_0, HARRY_0, Tcp, 80, open),
            (DRACO_1, HARRY_0, Tcp, 8080, open),
            (HARRY_0, DRACO_0, Tcp, 80, open),
            (HARRY_1, DRACO_0, Tcp, 8080, open),
        ]
    };
    let test = "CNPAdminTierPriorityField";
    stage(
        &c,
        &format!("{test}, Deny at 50, Pass at 60"),
        &policies,
        &pokes(false),
    );
    policies[1].priority = 40;
    stage(&c, &format!("{test}, Pass at 40"), &policies, &pokes(true));
}

#[test]
fn cnp_admin_tier_egress_tcp_bpf() {
    cnp_admin_tier_egress_tcp("cnpaet", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_egress_tcp_iptables() {
    cnp_admin_tier_egress_tcp("cnpaeti", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_egress_udp_bpf() {
    cnp_admin_tier_egress_udp("cnpaeu", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_egress_udp_iptables() {
    cnp_admin_tier_egress_udp("cnpaeui", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_ingress_udp_bpf() {
    cnp_admin_tier_ingress_udp("cnpaiu", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_ingress_udp_iptables() {
    cnp_admin_tier_ingress_udp("cnpaiui", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_gress_bpf() {
    cnp_admin_tier_gress("cnpag", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_gress_iptables() {
    cnp_admin_tier_gress("cnpagi", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_egress_inline_cidr_peers_bpf() {
    cnp_admin_tier_egress_inline_cidr_peers("cnpacidr", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_egress_inline_cidr_peers_iptables() {
    cnp_admin_tier_egress_inline_cidr_peers("cnpacidri", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_priority_field_bpf() {
    cnp_admin_tier_priority_field("cnpaprio", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_priority_field_iptables() {
    cnp_admin_tier_priority_field("cnpaprioi", Backend::Iptables);
}
