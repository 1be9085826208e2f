//! ClusterNetworkPolicy: upstream's four SCTP conformance tests
//! (CNPAdminTierIngressSCTP, CNPAdminTierEgressSCTP,
//! CNPBaselineTierIngressSCTP, CNPBaselineTierEgressSCTP) on the harness
//! of the parent module (see its note for the world and the timing).
use super::*;

/// Upstream's pods as ours (see the module's note).
const LUNA: &str = "alpha/api";
const CEDRIC: &str = "alpha/web";
const HARRY_0: &str = "beta/web";
const HARRY_1: &str = "beta/api";
const DRACO_0: &str = "gamma/web";
const DRACO_1: &str = "gamma/api";
/// The pods ravenclaw talks to, or is talked to by.
const OTHERS: [&str; 5] = [HARRY_0, HARRY_1, DRACO_0, DRACO_1, CEDRIC];
/// Upstream's SCTP ports: every pod serves both.
const PORTS: [u16; 2] = [9003, 9005];

/// The world of the four tests on one datapath: alpha, beta and gamma
/// with the pods above (labelled `app: <name>`), each declaring and
/// listening on both SCTP ports; and what is applied now.
struct Houses {
    c: Conformance,
    ears: Listeners,
    applied: std::cell::RefCell<String>,
}

impl Houses {
    fn new(prefix: &'static str, backend: Backend) -> Self {
        let namespaces = [("alpha", "a"), ("beta", "b"), ("gamma", "c")]
            .into_iter()
            .map(|(name, team)| NsSpec {
                name: name.into(),
                labels: labels(&[("team", team)]),
            })
            .collect();
        let ports = || {
            PORTS
                .iter()
                .map(|p| (format!("sctp-{p}"), *p, "SCTP"))
                .collect::<Vec<_>>()
        };
        let all = [LUNA, CEDRIC, HARRY_0, HARRY_1, DRACO_0, DRACO_1];
        let pods = all
            .into_iter()
            .enumerate()
            .map(|(i, id)| {
                let net = match ns_of(id) {
                    "alpha" => 1,
                    "beta" => 2,
                    _ => 3,
                };
                PodSpec::numbered(ns_of(id), name_of(id), net, 10 + i as u8, ports())
            })
            .collect();
        let c = Conformance::with_cluster(prefix, backend, namespaces, pods);
        let servers: Vec<(&str, &[u16])> = all.iter().map(|p| (*p, &PORTS[..])).collect();
        let ears = Listeners::start(&c, &servers);
        Self {
            c,
            ears,
            applied: std::cell::RefCell::default(),
        }
    }

    /// A stage with `policies` (applied unless they are what is applied
    /// already: upstream patches nothing before such a subtest).
    fn stage(&self, what: &str, policies: &[Policy], probes: &[Probe]) {
        let yaml: Vec<String> = policies.iter().map(Policy::yaml).collect();
        let yaml = yaml.join("---\n");
        let changed = *self.applied.borrow() != yaml;
        stage(
            &self.c,
            &self.ears,
            what,
            changed.then_some(yaml.as_str()),
            probes,
        );
        *self.applied.borrow_mut() = yaml;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tier {
    Admin,
    Baseline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Accept,
    Deny,
    Pass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Ingress,
    Egress,
}

/// A subject or a peer.
#[derive(Clone, Copy, Debug)]
enum Sel {
    /// `namespaces:` the one of this name.
    Namespace(&'static str),
    /// `pods:` of this name's namespace with this `app` label.
    Pods(&'static str, &'static str),
    /// `namespaces: {}`: every namespace.
    AnyNamespace,
    /// `pods:` of any namespace with this `app` label.
    AnyNamespacePods(&'static str),
}

const GRYFFINDOR: Sel = Sel::Namespace("beta");
const SLYTHERIN: Sel = Sel::Namespace("gamma");
const RAVENCLAW: Sel = Sel::Pods("alpha", "api");
const HUFFLEPUFF: Sel = Sel::Pods("alpha", "web");

impl Sel {
    fn yaml(self) -> String {
        let ns = |n: &str| format!("{{matchLabels: {{kubernetes.io/metadata.name: {n}}}}}");
        let app = |a: &str| format!("{{matchLabels: {{app: {a}}}}}");
        match self {
            Sel::Namespace(n) => format!("namespaces: {}", ns(n)),
            Sel::Pods(n, a) => format!(
                "pods: {{namespaceSelector: {}, podSelector: {}}}",
                ns(n),
                app(a)
            ),
            Sel::AnyNamespace => "namespaces: {}".to_owned(),
            Sel::AnyNamespacePods(a) => {
                format!("pods: {{namespaceSelector: {{}}, podSelector: {}}}", app(a))
            }
        }
    }

    /// Pods here are labelled `app: <name>`.
    fn selects(self, pod: &str) -> bool {
        match self {
            Sel::Namespace(n) => ns_of(pod) == n,
            Sel::Pods(n, a) => ns_of(pod) == n && name_of(pod) == a,
            Sel::AnyNamespace => true,
            Sel::AnyNamespacePods(a) => name_of(pod) == a,
        }
    }
}

/// A rule's `protocols`.
#[derive(Clone, Copy, Debug)]
enum Ports {
    /// None given: every protocol and port.
    All,
    /// `sctp: {}`: every SCTP port.
    Sctp,
    /// `sctp: {destinationPort: {number: ..}}`.
    SctpPort(u16),
}

#[derive(Clone, Copy, Debug)]
struct Rule {
    name: &'static str,
    action: Action,
    peer: Sel,
    ports: Ports,
}

const fn rule(name: &'static str, action: Action, peer: Sel, ports: Ports) -> Rule {
    Rule {
        name,
        action,
        peer,
        ports,
    }
}

#[derive(Clone, Debug)]
struct Policy {
    name: &'static str,
    tier: Tier,
    priority: u16,
    subject: Sel,
    ingress: Vec<Rule>,
    egress: Vec<Rule>,
}

impl Policy {
    /// A policy on ravenclaw with `rules` in `dir`.
    fn on_ravenclaw(
        (name, tier, priority): (&'static str, Tier, u16),
        dir: Dir,
        rules: Vec<Rule>,
    ) -> Self {
        let mut p = Policy {
            name,
            tier,
            priority,
            subject: RAVENCLAW,
            ingress: Vec::new(),
            egress: Vec::new(),
        };
        *p.rules_mut(dir) = rules;
        p
    }

    fn rules(&self, dir: Dir) -> &[Rule] {
        match dir {
            Dir::Ingress => &self.ingress,
            Dir::Egress => &self.egress,
        }
    }

    fn rules_mut(&mut self, dir: Dir) -> &mut Vec<Rule> {
        match dir {
            Dir::Ingress => &mut self.ingress,
            Dir::Egress => &mut self.egress,
        }
    }

    fn yaml(&self) -> String {
        let mut out = format!(
            "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: {}}}\nspec:\n  tier: {:?}\n  priority: {}\n  subject:\n    {}\n",
            self.name,
            self.tier,
            self.priority,
            self.subject.yaml()
        );
        for (key, peers, rules) in [
            ("ingress", "from", &self.ingress),
            ("egress", "to", &self.egress),
        ] {
            if rules.is_empty() {
                continue;
            }
            out += &format!("  {key}:\n");
            for r in rules {
                out += &format!(
                    "  - name: {}\n    action: {:?}\n    {peers}:\n    - {}\n",
                    r.name,
                    r.action,
                    r.peer.yaml()
                );
                match r.ports {
                    Ports::All => {}
                    Ports::Sctp => out += "    protocols:\n    - sctp: {}\n",
                    Ports::SctpPort(n) => {
                        out += &format!(
                            "    protocols:\n    - sctp: {{destinationPort: {{number: {n}}}}}\n"
                        );
                    }
                }
            }
        }
        out
    }
}

/// The API's verdict on an SCTP association `from` -> `to`:`port` under
/// `policies`: the sender's egress and the receiver's ingress must both
/// allow it. For each side, the Admin tier decides first (the policies
/// selecting the pod by priority, lower first, their rules as written:
/// the first rule that matches Accepts or Denies; a Pass, or no match,
/// goes on), then the NetworkPolicy tier (none here), then the Baseline
/// tier alike; if nothing decides, allowed.
fn open(policies: &[Policy], from: &str, to: &str, port: u16) -> bool {
    let side = |dir: Dir, subject: &str, peer: &str| {
        for tier in [Tier::Admin, Tier::Baseline] {
            let mut applying: Vec<&Policy> = policies
                .iter()
                .filter(|p| p.tier == tier && p.subject.selects(subject))
                .collect();
            applying.sort_by_key(|p| p.priority);
            let first = applying.iter().flat_map(|p| p.rules(dir)).find(|r| {
                r.peer.selects(peer)
                    && match r.ports {
                        Ports::All | Ports::Sctp => true,
                        Ports::SctpPort(n) => n == port,
                    }
            });
            match first.map(|r| r.action) {
                Some(Action::Accept) => return true,
                Some(Action::Deny) => return false,
                Some(Action::Pass) | None => {}
            }
        }
        true
    };
    side(Dir::Egress, from, to) && side(Dir::Ingress, to, from)
}

/// Upstream's rules, rule `i` of its list being rule `i` here: with
/// gryffindor everything Accepted, then Denied, then (Admin only) Passed;
/// slytherin Denied, then (Admin only) Passed, at port 9003; hufflepuff
/// Accepted at port 9003, then Denied everything else.
fn upstream_rules(tier: Tier, dir: Dir) -> Vec<Rule> {
    use Action::{Accept, Deny, Pass};
    let port = Ports::SctpPort(9003);
    let rules = match dir {
        Dir::Ingress => [
            rule(
                "allow-from-gryffindor-everything",
                Accept,
                GRYFFINDOR,
                Ports::All,
            ),
            rule(
                "deny-from-gryffindor-everything",
                Deny,
                GRYFFINDOR,
                Ports::All,
            ),
            rule(
                "pass-from-gryffindor-everything",
                Pass,
                GRYFFINDOR,
                Ports::All,
            ),
            rule("deny-from-slytherin-at-port-9003", Deny, SLYTHERIN, port),
            rule("pass-from-slytherin-at-port-9003", Pass, SLYTHERIN, port),
            rule(
                "allow-from-hufflepuff-at-port-9003",
                Accept,
                HUFFLEPUFF,
                port,
            ),
            rule(
                "deny-from-hufflepuff-everything-else",
                Deny,
                HUFFLEPUFF,
                Ports::All,
            ),
        ],
        Dir::Egress => [
            rule(
                "allow-to-gryffindor-everything",
                Accept,
                GRYFFINDOR,
                Ports::All,
            ),
            rule(
                "deny-to-gryffindor-everything",
                Deny,
                GRYFFINDOR,
                Ports::All,
            ),
            rule(
                "pass-to-gryffindor-everything",
                Pass,
                GRYFFINDOR,
                Ports::All,
            ),
            rule("deny-to-slytherin-at-port-9003", Deny, SLYTHERIN, port),
            rule("pass-to-slytherin-at-port-9003", Pass, SLYTHERIN, port),
            rule("allow-to-hufflepuff-at-port-9003", Accept, HUFFLEPUFF, port),
            rule(
                "deny-to-hufflepuff-everything-else",
                Deny,
                HUFFLEPUFF,
                Ports::All,
            ),
        ],
    };
    rules
        .into_iter()
        // Upstream's Baseline policies have no Pass rules.
        .filter(|r| tier == Tier::Admin || r.action != Action::Pass)
        .collect()
}

/// One of upstream's probes: (client, server, port, open).
type Poke = (&'static str, &'static str, u16, bool);

/// An upstream subtest: its name, the rules it swaps first (in the policy
/// as the subtests before it left it), its probes.
type Subtest = (&'static str, Option<(usize, usize)>, &'static [Poke]);

/// The subtests of CNPAdminTierIngressSCTP, in upstream's order;
/// CNPBaselineTierIngressSCTP has the first four.
const INGRESS_SUBTESTS: [Subtest; 6] = [
    (
        "allow-ingress, rule ordering is respected",
        None,
        &[(HARRY_0, LUNA, 9003, true), (HARRY_1, LUNA, 9005, true)],
    ),
    (
        "allow-ingress at the specified port",
        None,
        &[(CEDRIC, LUNA, 9003, true), (CEDRIC, LUNA, 9005, false)],
    ),
    (
        "deny-ingress, rule ordering is respected",
        Some((0, 1)),
        &[(HARRY_0, LUNA, 9003, false), (HARRY_1, LUNA, 9005, false)],
    ),
    (
        "deny-ingress at the specified port",
        None,
        &[(DRACO_0, LUNA, 9003, false), (DRACO_1, LUNA, 9005, true)],
    ),
    (
        "pass-ingress, rule ordering is respected",
        Some((0, 2)),
        &[(HARRY_0, LUNA, 9003, true), (HARRY_1, LUNA, 9005, true)],
    ),
    (
        "pass-ingress at the specified port",
        Some((3, 4)),
        &[(DRACO_0, LUNA, 9003, true), (DRACO_1, LUNA, 9005, true)],
    ),
];

/// The subtests of CNPAdminTierEgressSCTP, in upstream's order;
/// CNPBaselineTierEgressSCTP has the first four.
const EGRESS_SUBTESTS: [Subtest; 6] = [
    (
        "allow-egress, rule ordering is respected",
        None,
        &[(LUNA, HARRY_0, 9003, true), (LUNA, HARRY_0, 9005, true)],
    ),
    (
        "allow-egress at the specified port",
        None,
        &[(LUNA, CEDRIC, 9003, true), (LUNA, CEDRIC, 9005, false)],
    ),
    (
        "deny-egress, rule ordering is respected",
        Some((0, 1)),
        &[(LUNA, HARRY_1, 9003, false), (LUNA, HARRY_1, 9005, false)],
    ),
    (
        "deny-egress at the specified port",
        None,
        &[(LUNA, DRACO_0, 9003, false), (LUNA, DRACO_0, 9005, true)],
    ),
    (
        "pass-egress, rule ordering is respected",
        Some((0, 2)),
        &[(LUNA, HARRY_1, 9003, true), (LUNA, HARRY_1, 9005, true)],
    ),
    (
        "pass-egress at the specified port",
        Some((3, 4)),
        &[(LUNA, DRACO_0, 9003, true), (LUNA, DRACO_0, 9005, true)],
    ),
];

/// Every pair between ravenclaw and the others in `dir` (ravenclaw the
/// receiver for ingress, the sender for egress), both ports, both
/// families, with the model's verdicts.
fn every_pair(dir: Dir, policies: &[Policy]) -> Vec<Probe> {
    let mut probes = Vec::new();
    for v6 in [false, true] {
        for other in OTHERS {
            for port in PORTS {
                let (from, to) = match dir {
                    Dir::Ingress => (other, LUNA),
                    Dir::Egress => (LUNA, other),
                };
                probes.push(Probe {
                    from: from.into(),
                    to: to.into(),
                    port,
                    v6,
                    open: open(policies, from, to, port),
                });
            }
        }
    }
    probes
}

/// An upstream SCTP test as data: its name, the direction its policy
/// rules, the policy as its manifest has it, its subtests.
struct Upstream {
    test: &'static str,
    dir: Dir,
    policy: Policy,
    subtests: &'static [Subtest],
}

/// CNPAdminTierIngressSCTP: the Admin policy `ingress-sctp` on
/// ravenclaw's ingress, its six subtests.
fn cnp_admin_tier_ingress_sctp() -> Upstream {
    let dir = Dir::Ingress;
    Upstream {
        test: "CNPAdminTierIngressSCTP",
        dir,
        policy: Policy::on_ravenclaw(
            ("ingress-sctp", Tier::Admin, 5),
            dir,
            upstream_rules(Tier::Admin, dir),
        ),
        subtests: &INGRESS_SUBTESTS,
    }
}

/// CNPAdminTierEgressSCTP: the Admin policy `egress-sctp` on ravenclaw's
/// egress, its six subtests.
fn cnp_admin_tier_egress_sctp() -> Upstream {
    let dir = Dir::Egress;
    Upstream {
        test: "CNPAdminTierEgressSCTP",
        dir,
        policy: Policy::on_ravenclaw(
            ("egress-sctp", Tier::Admin, 8),
            dir,
            upstream_rules(Tier::Admin, dir),
        ),
        subtests: &EGRESS_SUBTESTS,
    }
}

/// CNPBaselineTierIngressSCTP: the Baseline policy `default` on
/// ravenclaw's ingress, its four subtests.
fn cnp_baseline_tier_ingress_sctp() -> Upstream {
    let dir = Dir::Ingress;
    Upstream {
        test: "CNPBaselineTierIngressSCTP",
        dir,
        policy: Policy::on_ravenclaw(
            ("default", Tier::Baseline, 10),
            dir,
            upstream_rules(Tier::Baseline, dir),
        ),
        subtests: &INGRESS_SUBTESTS[..4],
    }
}

/// CNPBaselineTierEgressSCTP: the Baseline policy `default` on
/// ravenclaw's egress, its four subtests.
fn cnp_baseline_tier_egress_sctp() -> Upstream {
    let dir = Dir::Egress;
    Upstream {
        test: "CNPBaselineTierEgressSCTP",
        dir,
        policy: Policy::on_ravenclaw(
            ("default", Tier::Baseline, 10),
            dir,
            upstream_rules(Tier::Baseline, dir),
        ),
        subtests: &EGRESS_SUBTESTS[..4],
    }
}

/// Two upstream tests of one tier, one on ravenclaw's ingress and one on
/// its egress, run in lockstep: stage `k` is subtest `k` of each (their
/// edits are the same, at the same subtests), with both policies applied
/// and both directions probed. The policies cannot meet: the ingress one
/// judges only what enters ravenclaw, the egress one only what leaves it,
/// and no policy selects the other pods; the model, judging with both,
/// must still agree with each test's own probes. Two policies of the
/// same name (upstream calls both Baseline ones `default`) are one
/// object with both directions' rules.
fn in_lockstep(h: &Houses, tests: [Upstream; 2]) {
    for (what, policies) in lockstep(tests) {
        let mut probes = every_pair(Dir::Ingress, &policies);
        probes.extend(every_pair(Dir::Egress, &policies));
        h.stage(&what, &policies, &probes);
    }
}

/// [`in_lockstep`]'s stages (their names and policies), upstream's probes
/// held to the model on each.
fn lockstep(mut tests: [Upstream; 2]) -> Vec<(String, Vec<Policy>)> {
    let stages = tests.iter().map(|t| t.subtests.len()).max().unwrap_or(0);
    let mut out = Vec::new();
    for k in 0..stages {
        let mut names = Vec::new();
        for t in &mut tests {
            if let Some((what, swap, _)) = t.subtests.get(k) {
                if let Some((a, b)) = swap {
                    t.policy.rules_mut(t.dir).swap(*a, *b);
                }
                names.push(format!("{}: {what}", t.test));
            }
        }
        let mut policies: Vec<Policy> = Vec::new();
        for t in &tests {
            match policies.iter_mut().find(|p| p.name == t.policy.name) {
                Some(same) => *same.rules_mut(t.dir) = t.policy.rules(t.dir).to_vec(),
                None => policies.push(t.policy.clone()),
            }
        }
        for t in &tests {
            let Some((what, _, pokes)) = t.subtests.get(k) else {
                continue;
            };
            for &(from, to, port, want) in *pokes {
                assert_eq!(
                    open(&policies, from, to, port),
                    want,
                    "{}, {what}: the model disagrees with upstream's probe {from} -> {to}:{port}",
                    t.test
                );
            }
        }
        out.push((names.join(" + "), policies));
    }
    out
}

/// Without a kernel: the model agrees with every probe of upstream's,
/// and each stage has admitted and refused pairs in both directions.
#[test]
fn the_model_agrees_with_upstreams_sctp_probes() {
    let admin = lockstep([cnp_admin_tier_ingress_sctp(), cnp_admin_tier_egress_sctp()]);
    let baseline = lockstep([
        cnp_baseline_tier_ingress_sctp(),
        cnp_baseline_tier_egress_sctp(),
    ]);
    assert_eq!((admin.len(), baseline.len()), (6, 4));
    for (what, policies) in admin.iter().chain(&baseline) {
        for dir in [Dir::Ingress, Dir::Egress] {
            let probes = every_pair(dir, policies);
            assert!(
                probes.iter().any(|p| p.open) && probes.iter().any(|p| !p.open),
                "{what}: {dir:?} probes only one verdict"
            );
        }
    }
    // The Baseline tests' two `default`s are one object.
    assert!(baseline.iter().all(|(_, p)| p.len() == 1));
}

/// The shape this file tested before the transcription, folded in after
/// CNPAdminTierIngressSCTP (which covers it but for the port-less
/// `sctp: {}` and the peers in any namespace): an Accept of the `web`
/// pods of every namespace on one SCTP port, then a Deny of every SCTP
/// port from every namespace.
fn sctp_guard(h: &Houses) {
    let guard = Policy::on_ravenclaw(
        ("sctp-guard", Tier::Admin, 5),
        Dir::Ingress,
        vec![
            rule(
                "allow-web-sctp-9003",
                Action::Accept,
                Sel::AnyNamespacePods("web"),
                Ports::SctpPort(9003),
            ),
            rule("deny-sctp", Action::Deny, Sel::AnyNamespace, Ports::Sctp),
        ],
    );
    let policies = [guard];
    let probes = every_pair(Dir::Ingress, &policies);
    h.stage("sctp-guard", &policies, &probes);
}

/// The four upstream tests on one datapath's cluster (setting a cluster
/// up, and the first BPF load, cost more in the guest than a stage): the
/// Admin ones in lockstep, the earlier shape, the Baseline ones in
/// lockstep.
fn cnp_sctp_conformance(prefix: &'static str, backend: Backend) {
    if let Some(why) = sctp_unavailable() {
        eprintln!("SKIPPED {prefix} ({backend:?}): {why}");
        return;
    }
    let begun = Instant::now();
    let h = Houses::new(prefix, backend);
    eprintln!(
        "sctp {backend:?}: cluster up in {:.1}s",
        begun.elapsed().as_secs_f64()
    );
    in_lockstep(
        &h,
        [cnp_admin_tier_ingress_sctp(), cnp_admin_tier_egress_sctp()],
    );
    sctp_guard(&h);
    in_lockstep(
        &h,
        [
            cnp_baseline_tier_ingress_sctp(),
            cnp_baseline_tier_egress_sctp(),
        ],
    );
}

/// CNPAdminTierIngressSCTP, CNPAdminTierEgressSCTP,
/// CNPBaselineTierIngressSCTP and CNPBaselineTierEgressSCTP, on BPF and
/// on iptables side by side.
#[test]
fn cnp_admin_and_baseline_tier_ingress_and_egress_sctp() {
    on_both_datapaths(["sctpcb", "sctpci"], cnp_sctp_conformance);
}
