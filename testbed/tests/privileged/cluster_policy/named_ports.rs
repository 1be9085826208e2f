//! The upstream experimental NamedPorts tests, on the node's world as
//! mod.rs maps it. Each takes a standard-channel policy (the one its
//! upstream manifest holds, built as admin_tier.rs and baseline_tier.rs
//! build it) and rewrites one rule's `protocols` to a single
//! `destinationNamedPort`, as upstream patches it; then upstream's two
//! probes and the whole matrix.
//!
//! Port names: upstream's pods name TCP 80 "web" and UDP 53 "dns"; ours
//! name them "http" and "dns", so upstream's "web" is our "http". Upstream
//! names the same ports in every namespace, which cannot tell where a
//! name is resolved; here gamma's "http" is 8080 (and "admin" 80), so two
//! further stages of our own pin the API's "selects a destination port on
//! a pod": the slytherin Deny rewritten to "http" (resolved on beta or
//! alpha it is 80, on gamma 8080), then the pod the upstream rule reaches
//! stripped of its named port, which must then match nothing there.
use policy_testbed::Transport::{Tcp, Udp};
use policy_testbed::fixtures::conformance::Backend;

use super::model::{
    CEDRIC_0, CEDRIC_1, DRACO_0, DRACO_1, Dir, GRYFFINDOR, HARRY_0, HARRY_1, HUFFLEPUFF, Poke,
    Policy, Sel, Tier, ladder, named, policy, stage, tcp, udp,
};

/// One test: the policy as upstream's manifest has it, and the three
/// stages.
struct Case {
    test: &'static str,
    policy: Policy,
    dir: Dir,
    /// Upstream's patch: the rule's index and our name for its port.
    patched: (usize, &'static str),
    /// Upstream's probes after the patch.
    upstream: &'static [Poke],
    /// The slytherin Deny's index (rewritten to "http"), and our probes.
    slytherin: (usize, &'static [Poke]),
    /// The pod whose container port `patched` names is then removed, and
    /// our probes.
    stripped: (&'static str, &'static [Poke]),
}

fn run(case: Case, (prefix, backend): (&'static str, Backend)) {
    let Case {
        test,
        mut policy,
        dir,
        patched: (index, name),
        upstream,
        slytherin: (deny, by_destination),
        stripped: (pod, lost),
    } = case;
    let mut c = crate::flow_audit::audited(prefix, backend);
    policy.rules_mut(dir)[index].protocols = vec![named(name)];
    stage(
        &c,
        &format!("{test}, rule {index} at named port {name}"),
        std::slice::from_ref(&policy),
        upstream,
    );
    // Ours: a name that differs between the subject's and the peer's pods.
    policy.rules_mut(dir)[deny].protocols = vec![named("http")];
    stage(
        &c,
        &format!("{test}, and the slytherin Deny at named port http"),
        std::slice::from_ref(&policy),
        by_destination,
    );
    // Ours: the pod loses the name; the policy is unchanged.
    c.pod_mut(pod).ports.retain(|(n, _, _)| n != name);
    c.write_cluster();
    stage(
        &c,
        &format!("{test}, {pod} without a port named {name}"),
        std::slice::from_ref(&policy),
        lost,
    );
}

/// CNPAdminTierIngressNamedPort: CNPAdminTierIngressUDP's `ingress-udp`
/// (hufflepuff's ingress), its rule 5 (gryffindor at UDP 53) at "dns".
fn cnp_admin_tier_ingress_named_port(prefix: &'static str, backend: Backend) {
    let mut p = policy("ingress-udp", Tier::Admin, 4, HUFFLEPUFF);
    p.ingress = ladder(
        Tier::Admin,
        Dir::Ingress,
        &[udp(5353)],
        ("gryffindor", GRYFFINDOR, &[udp(53)]),
    );
    let case = Case {
        test: "CNPAdminTierIngressNamedPort",
        policy: p,
        dir: Dir::Ingress,
        patched: (5, "dns"),
        upstream: &[
            (HARRY_0, CEDRIC_1, Udp, 53, true),
            (HARRY_1, CEDRIC_1, Udp, 5353, false),
        ],
        // Resolved on the subject, alpha/web: TCP 80, not gamma's 8080.
        // Gamma's UDP 5353 now meets only the Pass.
        slytherin: (
            3,
            &[
                (DRACO_0, CEDRIC_0, Tcp, 80, false),
                (DRACO_1, CEDRIC_0, Tcp, 8080, true),
                (DRACO_0, CEDRIC_0, Udp, 5353, true),
            ],
        ),
        // Rule 5 matches nothing: rule 6 denies gryffindor everything.
        stripped: (
            CEDRIC_0,
            &[
                (HARRY_0, CEDRIC_1, Udp, 53, false),
                (DRACO_0, CEDRIC_0, Tcp, 80, false),
            ],
        ),
    };
    run(case, (prefix, backend));
}

/// CNPAdminTierEgressNamedPort: CNPAdminTierEgressTCP's `egress-tcp`
/// (gryffindor's egress), its rule 5 (hufflepuff at TCP 8080) at "http"
/// (upstream's "web"), TCP 80 on hufflepuff's pod.
fn cnp_admin_tier_egress_named_port(prefix: &'static str, backend: Backend) {
    let mut p = policy("egress-tcp", Tier::Admin, 6, GRYFFINDOR);
    p.egress = ladder(
        Tier::Admin,
        Dir::Egress,
        &[tcp(80)],
        ("hufflepuff", HUFFLEPUFF, &[tcp(8080)]),
    );
    let case = Case {
        test: "CNPAdminTierEgressNamedPort",
        policy: p,
        dir: Dir::Egress,
        patched: (5, "http"),
        upstream: &[
            (HARRY_0, CEDRIC_1, Tcp, 80, true),
            (HARRY_1, CEDRIC_1, Tcp, 8080, false),
        ],
        // Resolved on the peer, gamma's pods: TCP 8080, not beta's 80,
        // which now meets only the Pass.
        slytherin: (
            3,
            &[
                (HARRY_0, DRACO_0, Tcp, 8080, false),
                (HARRY_1, DRACO_1, Tcp, 80, true),
            ],
        ),
        stripped: (
            CEDRIC_0,
            &[
                (HARRY_0, CEDRIC_1, Tcp, 80, false),
                (HARRY_0, DRACO_0, Tcp, 8080, false),
            ],
        ),
    };
    run(case, (prefix, backend));
}

/// Upstream's Baseline manifests: the Admin ones in the Baseline tier,
/// without the Pass rules.
fn default(subject: Sel) -> Policy {
    policy("default", Tier::Baseline, 10, subject)
}

/// CNPBaselineTierIngressNamedPort: CNPBaselineTierIngressTCP's `default`
/// (gryffindor's ingress), its rule 3 (hufflepuff at TCP 80) at "http"
/// (upstream's "web").
fn cnp_baseline_tier_ingress_named_port(prefix: &'static str, backend: Backend) {
    let mut p = default(GRYFFINDOR);
    p.ingress = ladder(
        Tier::Baseline,
        Dir::Ingress,
        &[tcp(80)],
        ("hufflepuff", HUFFLEPUFF, &[tcp(80)]),
    );
    let case = Case {
        test: "CNPBaselineTierIngressNamedPort",
        policy: p,
        dir: Dir::Ingress,
        patched: (3, "http"),
        upstream: &[
            (CEDRIC_0, HARRY_1, Tcp, 80, true),
            (CEDRIC_1, HARRY_1, Tcp, 8080, false),
        ],
        // Resolved on the subject, beta's pods: TCP 80, not gamma's 8080.
        slytherin: (
            2,
            &[
                (DRACO_0, HARRY_0, Tcp, 80, false),
                (DRACO_1, HARRY_1, Tcp, 8080, true),
            ],
        ),
        // Per pod: beta/api loses "http", beta/web keeps it.
        stripped: (
            HARRY_1,
            &[
                (CEDRIC_0, HARRY_1, Tcp, 80, false),
                (CEDRIC_0, HARRY_0, Tcp, 80, true),
                (DRACO_0, HARRY_1, Tcp, 80, true),
                (DRACO_0, HARRY_0, Tcp, 80, false),
            ],
        ),
    };
    run(case, (prefix, backend));
}

/// CNPBaselineTierEgressNamedPort: CNPBaselineTierEgressUDP's `default`
/// (hufflepuff's egress), its rule 3 (gryffindor at UDP 53) at "dns".
fn cnp_baseline_tier_egress_named_port(prefix: &'static str, backend: Backend) {
    let mut p = default(HUFFLEPUFF);
    p.egress = ladder(
        Tier::Baseline,
        Dir::Egress,
        &[udp(5353)],
        ("gryffindor", GRYFFINDOR, &[udp(53)]),
    );
    let case = Case {
        test: "CNPBaselineTierEgressNamedPort",
        policy: p,
        dir: Dir::Egress,
        patched: (3, "dns"),
        upstream: &[
            (CEDRIC_0, HARRY_1, Udp, 53, true),
            (CEDRIC_1, HARRY_1, Udp, 5353, false),
        ],
        // Resolved on the peer, gamma's pods: TCP 8080, not alpha's 80;
        // gamma's UDP 5353 is no longer denied.
        slytherin: (
            2,
            &[
                (CEDRIC_0, DRACO_0, Tcp, 8080, false),
                (CEDRIC_0, DRACO_1, Tcp, 80, true),
                (CEDRIC_0, DRACO_0, Udp, 5353, true),
            ],
        ),
        // Per pod: beta/api loses "dns", beta/web keeps it.
        stripped: (
            HARRY_1,
            &[
                (CEDRIC_0, HARRY_1, Udp, 53, false),
                (CEDRIC_0, HARRY_0, Udp, 53, true),
            ],
        ),
    };
    run(case, (prefix, backend));
}

#[test]
fn cnp_admin_tier_ingress_named_port_bpf() {
    cnp_admin_tier_ingress_named_port("cnpanpi", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_ingress_named_port_iptables() {
    cnp_admin_tier_ingress_named_port("cnpanpii", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_egress_named_port_bpf() {
    cnp_admin_tier_egress_named_port("cnpanpe", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_egress_named_port_iptables() {
    cnp_admin_tier_egress_named_port("cnpanpei", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_ingress_named_port_bpf() {
    cnp_baseline_tier_ingress_named_port("cnpbnpi", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_ingress_named_port_iptables() {
    cnp_baseline_tier_ingress_named_port("cnpbnpii", Backend::Iptables);
}

#[test]
fn cnp_baseline_tier_egress_named_port_bpf() {
    cnp_baseline_tier_egress_named_port("cnpbnpe", Backend::Bpf);
}

#[test]
fn cnp_baseline_tier_egress_named_port_iptables() {
    cnp_baseline_tier_egress_named_port("cnpbnpei", Backend::Iptables);
}
