//! The upstream Baseline tier tests of the standard channel (TCP, UDP,
//! inline CIDR, gress combined), on the node's world as mod.rs maps it.
//! Each is its Admin twin's policy in the Baseline tier, named `default`
//! at priority 10, without the Pass rules, and upstream probes what the
//! Admin test probes in its first two subtest states: those tables are
//! shared with admin_tier.rs. No NetworkPolicy exists, so the Baseline
//! tier judges every pod it selects. SCTP items stay in the policies but
//! are not probed (the SCTP tests live elsewhere).
use policy_testbed::Transport::Tcp;
use policy_testbed::fixtures::conformance::Backend;

use super::admin_tier::{
    EGRESS_TCP_POKES, EGRESS_UDP_POKES, GRESS_POKES, INGRESS_UDP_POKES, gress_rules, inline_cidr,
    inline_cidr_rules,
};
use super::model::{
    CEDRIC_0, CEDRIC_1, DRACO_0, DRACO_1, Dir, GRYFFINDOR, HARRY_0, HARRY_1, HUFFLEPUFF, LUNA_0,
    LUNA_1, Poke, Policy, Sel, Tier, edited_in_place, ladder, policy, tcp, udp,
};

/// CNPBaselineTierIngressTCP's probes: allow-ingress (rule 0 before 1; at
/// the port, rule 3 then 4), then with rules 0 and 1 swapped deny-ingress
/// (Deny first; at the port, rule 2, other ports matching nothing).
const INGRESS_TCP_POKES: [&[Poke]; 2] = [
    &[
        (LUNA_0, HARRY_0, Tcp, 80, true),
        (LUNA_1, HARRY_0, Tcp, 8080, true),
        (CEDRIC_0, HARRY_1, Tcp, 80, true),
        (CEDRIC_1, HARRY_1, Tcp, 8080, false),
    ],
    &[
        (LUNA_0, HARRY_1, Tcp, 80, false),
        (LUNA_1, HARRY_1, Tcp, 8080, false),
        (DRACO_0, HARRY_0, Tcp, 80, false),
        (DRACO_1, HARRY_0, Tcp, 8080, true),
    ],
];

fn default(subject: Sel) -> Policy {
    policy("default", Tier::Baseline, 10, subject)
}

/// CNPBaselineTierEgressTCP: gryffindor's egress.
fn cnp_baseline_tier_egress_tcp(prefix: &'static str, backend: Backend) {
    let mut p = default(GRYFFINDOR);
    p.egress = ladder(
        Tier::Baseline,
        Dir::Egress,
        &[tcp(80)],
        ("hufflepuff", HUFFLEPUFF, &[tcp(8080)]),
    );
    edited_in_place(
        "CNPBaselineTierEgressTCP",
        (prefix, backend),
        p,
        &EGRESS_TCP_POKES[..2],
    );
}

/// CNPBaselineTierIngressTCP: gryffindor's ingress.
fn cnp_baseline_tier_ingress_tcp(prefix: &'static str, backend: Backend) {
    let mut p = default(GRYFFINDOR);
    p.ingress = ladder(
        Tier::Baseline,
        Dir::Ingress,
        &[tcp(80)],
        ("hufflepuff", HUFFLEPUFF, &[tcp(80)]),
    );
    edited_in_place(
        "CNPBaselineTierIngressTCP",
        (prefix, backend),
        p,
        &INGRESS_TCP_POKES,
    );
}

/// CNPBaselineTierEgressUDP: hufflepuff's egress, gryffindor the third
/// house.
fn cnp_baseline_tier_egress_udp(prefix: &'static str, backend: Backend) {
    let mut p = default(HUFFLEPUFF);
    p.egress = ladder(
        Tier::Baseline,
        Dir::Egress,
        &[udp(5353)],
        ("gryffindor", GRYFFINDOR, &[udp(53)]),
    );
    edited_in_place(
        "CNPBaselineTierEgressUDP",
        (prefix, backend),
        p,
        &EGRESS_UDP_POKES[..2],
    );
}

/// CNPBaselineTierIngressUDP: hufflepuff's ingress, gryffindor the third
/// house.
fn cnp_baseline_tier_ingress_udp(prefix: &'static str, backend: Backend) {
    let mut p = default(HUFFLEPUFF);
    p.ingress = ladder(
        Tier::Baseline,
        Dir::Ingress,
        &[udp(5353)],
        ("gryffindor", GRYFFINDOR, &[udp(53)]),
    );
    edited_in_place(
        "CNPBaselineTierIngressUDP",
        (prefix, backend),
        p,
        &INGRESS_UDP_POKES[..2],
    );
}

/// CNPBaselineTierGress: gryffindor's egress and ingress in one policy.
fn cnp_baseline_tier_gress(prefix: &'static str, backend: Backend) {
    let mut p = default(GRYFFINDOR);
    gress_rules(Tier::Baseline, &mut p);
    edited_in_place(
        "CNPBaselineTierGress",
        (prefix, backend),
        p,
        &GRESS_POKES[..2],
    );
}

/// CNPBaselineTierEgressInlineCIDRPeers: gryffindor (by name) denies every
/// address but slytherin's pods; then two pods' addresses Accepted ahead
/// of that.
fn cnp_baseline_tier_egress_inline_cidr_peers(prefix: &'static str, backend: Backend) {
    let mut p = default(GRYFFINDOR);
    p.egress = inline_cidr_rules();
    inline_cidr("CNPBaselineTierEgressInlineCIDRPeers", (prefix, backend), p);
}

#[test]
fn cnp_baseline_tier_egress_tcp_bpf() {
    cnp_baseline_tier_egress_tcp("cnpbet", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_egress_tcp_iptables() {
    cnp_baseline_tier_egress_tcp("cnpbeti", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_ingress_tcp_bpf() {
    cnp_baseline_tier_ingress_tcp("cnpbit", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_ingress_tcp_iptables() {
    cnp_baseline_tier_ingress_tcp("cnpbiti", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_egress_udp_bpf() {
    cnp_baseline_tier_egress_udp("cnpbeu", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_egress_udp_iptables() {
    cnp_baseline_tier_egress_udp("cnpbeui", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_ingress_udp_bpf() {
    cnp_baseline_tier_ingress_udp("cnpbiu", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_ingress_udp_iptables() {
    cnp_baseline_tier_ingress_udp("cnpbiui", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_gress_bpf() {
    cnp_baseline_tier_gress("cnpbg", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_gress_iptables() {
    cnp_baseline_tier_gress("cnpbgi", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_egress_inline_cidr_peers_bpf() {
    cnp_baseline_tier_egress_inline_cidr_peers("cnpbcidr", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_egress_inline_cidr_peers_iptables() {
    cnp_baseline_tier_egress_inline_cidr_peers("cnpbcidri", Backend::Iptables);
}
