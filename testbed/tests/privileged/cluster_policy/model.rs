//! The upstream conformance policies as data, for the Admin and Baseline
//! tier tests (standard and NamedPorts): each policy is rendered to YAML
//! for the agent and judged by a small model of the API's semantics, so
//! every cell of the matrix has a verdict worked out from the API text,
//! not only the pairs upstream probes. Upstream's own probes are kept
//! with each stage and the model must agree with them before any traffic
//! is sent, so a model that misread the API fails there, not by agreeing
//! with the agent.
use std::net::IpAddr;

use policy_testbed::Transport;
use policy_testbed::fixtures::conformance::{Backend, Conformance, ns_of};

use super::always;

/// The label every namespace carries, its name (upstream selects its houses
/// by it).
const NAME: &str = "kubernetes.io/metadata.name";

/// Upstream's houses as selected by name: gryffindor and slytherin are
/// namespaces here, ravenclaw and hufflepuff one pod each of alpha.
pub(super) const GRYFFINDOR: Sel = Sel::Namespaces((NAME, "beta"));
pub(super) const SLYTHERIN: Sel = Sel::Namespaces((NAME, "gamma"));
pub(super) const RAVENCLAW: Sel = Sel::Pods((NAME, "alpha"), Some(("app", "api")));
pub(super) const HUFFLEPUFF: Sel = Sel::Pods((NAME, "alpha"), Some(("app", "web")));

/// Upstream's pods (two per house) as ours: ravenclaw and hufflepuff
/// have one pod each here, so their `-0` and `-1` are the same pod.
pub(super) const HARRY_0: &str = "beta/web";
pub(super) const HARRY_1: &str = "beta/api";
pub(super) const DRACO_0: &str = "gamma/web";
pub(super) const DRACO_1: &str = "gamma/api";
pub(super) const LUNA_0: &str = "alpha/api";
pub(super) const LUNA_1: &str = "alpha/api";
pub(super) const CEDRIC_0: &str = "alpha/web";
pub(super) const CEDRIC_1: &str = "alpha/web";

/// One of upstream's probes: (client, server, transport, port, open).
pub(super) type Poke = (&'static str, &'static str, Transport, u16, bool);

/// A label `key: value`.
pub(super) type Label = (&'static str, &'static str);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tier {
    Admin,
    Baseline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Accept,
    Deny,
    Pass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    Ingress,
    Egress,
}

/// A `protocols` item.
#[derive(Clone, Copy, Debug)]
pub(super) enum Proto {
    /// (protocol, destination port).
    Port(&'static str, u16),
    /// `destinationNamedPort`: "selects a destination port on a pod based
    /// on the ContainerPort name", so it resolves on the destination pod
    /// (the subject for ingress, the peer for egress), to that container
    /// port's number and protocol; a pod without the name matches nothing.
    Named(&'static str),
}

pub(super) fn tcp(port: u16) -> Proto {
    Proto::Port("tcp", port)
}

pub(super) fn udp(port: u16) -> Proto {
    Proto::Port("udp", port)
}

/// Kept in the YAML as upstream writes it; never probed here (no SCTP
/// module on this kernel), so it matches none of the matrix's cells.
pub(super) fn sctp(port: u16) -> Proto {
    Proto::Port("sctp", port)
}

pub(super) fn named(name: &'static str) -> Proto {
    Proto::Named(name)
}

impl Proto {
    /// Whether it matches `port`/`tr` on the destination pod `dst`.
    fn matches(&self, c: &Conformance, dst: &str, port: u16, tr: Transport) -> bool {
        match *self {
            Proto::Port(p, n) => p == tr.name() && n == port,
            Proto::Named(name) => c.pods.iter().any(|pod| {
                pod.id() == dst
                    && pod.ports.iter().any(|(n, number, protocol)| {
                        n == name && *number == port && protocol.eq_ignore_ascii_case(tr.name())
                    })
            }),
        }
    }

    fn yaml(&self) -> String {
        match self {
            Proto::Port(p, n) => format!("{p}: {{destinationPort: {{number: {n}}}}}"),
            Proto::Named(name) => format!("destinationNamedPort: {name}"),
        }
    }

    /// As upstream's rule names spell it.
    fn label(&self) -> String {
        match self {
            Proto::Port(_, n) => n.to_string(),
            Proto::Named(name) => (*name).to_owned(),
        }
    }
}

/// A subject or a peer.
#[derive(Clone, Debug)]
pub(super) enum Sel {
    /// `namespaces: {matchLabels: {..}}`.
    Namespaces(Label),
    /// `pods: {namespaceSelector: .., podSelector: ..}`; no pod label is
    /// the empty selector, every pod.
    Pods(Label, Option<Label>),
    /// `networks: [..]` (egress peers only).
    Networks(Vec<String>),
}

impl Sel {
    fn yaml(&self) -> String {
        let labels = |(k, v): Label| format!("{{matchLabels: {{{k}: {v}}}}}");
        match self {
            Sel::Namespaces(ns) => format!("namespaces: {}", labels(*ns)),
            Sel::Pods(ns, pod) => format!(
                "pods: {{namespaceSelector: {}, podSelector: {}}}",
                labels(*ns),
                pod.map_or_else(|| "{}".to_owned(), labels)
            ),
            Sel::Networks(cidrs) => {
                let quoted: Vec<String> = cidrs.iter().map(|n| format!("{n:?}")).collect();
                format!("networks: [{}]", quoted.join(", "))
            }
        }
    }

    /// Whether it selects `pod` (its `v6` address, for networks) in the
    /// world as `c` has it now (namespace labels may have changed).
    fn selects(&self, c: &Conformance, pod: &str, v6: bool) -> bool {
        let ns_has = |(k, v): Label| {
            let ns = ns_of(pod);
            (k == NAME && v == ns)
                || c.namespaces
                    .iter()
                    .any(|n| n.name == ns && n.labels.get(k).is_some_and(|x| x == v))
        };
        let pod_has = |(k, v): Label| {
            c.pods
                .iter()
                .any(|p| p.id() == pod && p.labels.get(k).is_some_and(|x| x == v))
        };
        match self {
            Sel::Namespaces(ns) => ns_has(*ns),
            Sel::Pods(ns, p) => ns_has(*ns) && p.is_none_or(pod_has),
            Sel::Networks(cidrs) => cidrs.iter().any(|n| in_cidr(c.pod_ip(pod, v6), n)),
        }
    }
}

fn in_cidr(ip: IpAddr, cidr: &str) -> bool {
    let (net, len) = cidr.split_once('/').unwrap();
    let len: u32 = len.parse().unwrap();
    match (ip, net.parse::<IpAddr>().unwrap()) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            len == 0 || (u32::from(a) ^ u32::from(n)) >> (32 - len) == 0
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            len == 0 || (u128::from(a) ^ u128::from(n)) >> (128 - len) == 0
        }
        _ => false,
    }
}

/// An address of each family of `pod`, as host prefixes.
pub(super) fn host_prefixes(c: &Conformance, pod: &str) -> [String; 2] {
    [
        format!("{}/32", c.pod_ip(pod, false)),
        format!("{}/128", c.pod_ip(pod, true)),
    ]
}

#[derive(Clone, Debug)]
pub(super) struct Rule {
    pub name: String,
    pub action: Action,
    pub peer: Sel,
    /// Empty: every protocol and port, ICMP included.
    pub protocols: Vec<Proto>,
}

impl Rule {
    /// `dst` is the connection's destination pod, where named ports
    /// resolve.
    fn matches(
        &self,
        c: &Conformance,
        (peer, dst): (&str, &str),
        port: u16,
        tr: Transport,
        v6: bool,
    ) -> bool {
        self.peer.selects(c, peer, v6)
            && (self.protocols.is_empty()
                || self.protocols.iter().any(|p| p.matches(c, dst, port, tr)))
    }
}

pub(super) fn rule(name: &str, action: Action, peer: Sel, protocols: &[Proto]) -> Rule {
    Rule {
        name: name.to_owned(),
        action,
        peer,
        protocols: protocols.to_vec(),
    }
}

#[derive(Clone, Debug)]
pub(super) struct Policy {
    pub name: &'static str,
    pub tier: Tier,
    pub priority: u16,
    pub subject: Sel,
    pub ingress: Vec<Rule>,
    pub egress: Vec<Rule>,
}

/// A policy without rules yet.
pub(super) fn policy(name: &'static str, tier: Tier, priority: u16, subject: Sel) -> Policy {
    Policy {
        name,
        tier,
        priority,
        subject,
        ingress: Vec::new(),
        egress: Vec::new(),
    }
}

impl Policy {
    pub(super) fn rules_mut(&mut self, dir: Dir) -> &mut Vec<Rule> {
        match dir {
            Dir::Ingress => &mut self.ingress,
            Dir::Egress => &mut self.egress,
        }
    }

    fn rules(&self, dir: Dir) -> &[Rule] {
        match dir {
            Dir::Ingress => &self.ingress,
            Dir::Egress => &self.egress,
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
                if !r.protocols.is_empty() {
                    out += "    protocols:\n";
                    for p in &r.protocols {
                        out += &format!("    - {}\n", p.yaml());
                    }
                }
            }
        }
        out
    }
}

/// The rule list upstream's TCP, UDP and gress policies share, rule `i`
/// here being upstream's `i`: everything with ravenclaw Accepted, then
/// Denied, then (Admin only) Passed; slytherin Denied, then (Admin only)
/// Passed, at `slytherin` ports; the `third` house Accepted at its
/// `third` ports, then Denied everything else.
pub(super) fn ladder(
    tier: Tier,
    dir: Dir,
    slytherin: &[Proto],
    third: (&str, Sel, &[Proto]),
) -> Vec<Rule> {
    let way = if dir == Dir::Egress { "to" } else { "from" };
    let ports = |ps: &[Proto]| {
        let n: Vec<String> = ps.iter().map(Proto::label).collect();
        n.join("-")
    };
    let (house, peer, third_ports) = third;
    let mut rules = vec![
        rule(
            &format!("allow-{way}-ravenclaw-everything"),
            Action::Accept,
            RAVENCLAW,
            &[],
        ),
        rule(
            &format!("deny-{way}-ravenclaw-everything"),
            Action::Deny,
            RAVENCLAW,
            &[],
        ),
        rule(
            &format!("pass-{way}-ravenclaw-everything"),
            Action::Pass,
            RAVENCLAW,
            &[],
        ),
        rule(
            &format!("deny-{way}-slytherin-at-port-{}", ports(slytherin)),
            Action::Deny,
            SLYTHERIN,
            slytherin,
        ),
        rule(
            &format!("pass-{way}-slytherin-at-port-{}", ports(slytherin)),
            Action::Pass,
            SLYTHERIN,
            slytherin,
        ),
        rule(
            &format!("allow-{way}-{house}-at-port-{}", ports(third_ports)),
            Action::Accept,
            peer.clone(),
            third_ports,
        ),
        rule(
            &format!("deny-{way}-{house}-everything-else"),
            Action::Deny,
            peer,
            &[],
        ),
    ];
    if tier == Tier::Baseline {
        // Upstream's Baseline policies have no Pass rules.
        rules.retain(|r| r.action != Action::Pass);
    }
    rules
}

/// What the tiers say of one side of a connection: `subject`'s egress
/// towards `peer`, or its ingress from `peer`. In each tier the rules of
/// the policies selecting the subject, by priority then as written: the
/// first that matches decides if it Accepts or Denies; a Pass, or no
/// match, goes on to the next tier. No NetworkPolicy exists in these
/// tests, so the NetworkPolicy tier never decides; after Baseline the
/// default allows.
fn side(
    c: &Conformance,
    policies: &[Policy],
    dir: Dir,
    (subject, peer): (&str, &str),
    (port, tr, v6): (u16, Transport, bool),
) -> bool {
    for tier in [Tier::Admin, Tier::Baseline] {
        let mut applying: Vec<&Policy> = policies
            .iter()
            .filter(|p| p.tier == tier && p.subject.selects(c, subject, v6))
            .collect();
        applying.sort_by_key(|p| p.priority);
        let dst = if dir == Dir::Egress { peer } else { subject };
        let first = applying
            .iter()
            .flat_map(|p| p.rules(dir))
            .find(|r| r.matches(c, (peer, dst), port, tr, v6));
        match first.map(|r| r.action) {
            Some(Action::Accept) => return true,
            Some(Action::Deny) => return false,
            Some(Action::Pass) | None => {}
        }
    }
    true
}

/// The model's verdict on one cell: the node and self traffic pass; else
/// the source's egress and the destination's ingress must both allow (an
/// egress Accept does not skip the destination's ingress rules).
pub(super) fn open(
    c: &Conformance,
    policies: &[Policy],
    (from, to): (&str, &str),
    port: u16,
    tr: Transport,
    v6: bool,
) -> bool {
    always(from, to)
        || (side(c, policies, Dir::Egress, (from, to), (port, tr, v6))
            && side(c, policies, Dir::Ingress, (to, from), (port, tr, v6)))
}

/// One stage of an upstream test: its probes held to the model (both
/// families), then `policies` applied and the whole matrix held to the
/// model.
pub(super) fn stage(c: &Conformance, what: &str, policies: &[Policy], pokes: &[Poke]) {
    for &(from, to, tr, port, want) in pokes {
        for v6 in [false, true] {
            assert_eq!(
                open(c, policies, (from, to), port, tr, v6),
                want,
                "{what}: the model disagrees with the probe {from} -> {to} {port}/{} (IPv6: {v6})",
                tr.name()
            );
        }
    }
    let yaml: Vec<String> = policies.iter().map(Policy::yaml).collect();
    c.write_policies(&yaml.join("---\n"));
    c.apply_ok();
    c.check_by_family(what, |f, t, port, tr, v6| {
        open(c, policies, (f, t), port, tr, v6)
    });
}

/// Upstream's TCP, UDP and gress tests edit their one policy in place,
/// subtest after subtest: as written, then rules 0 and 1 swapped (Deny
/// first), then 0 and 2 (Pass first), then 3 and 4 (the port Pass first),
/// in every direction it has. `stages[i]` holds the probes of the subtests
/// upstream runs on the `i`-th state; Baseline tests stop after two.
pub(super) fn edited_in_place(
    test: &str,
    (prefix, backend): (&'static str, Backend),
    mut policy: Policy,
    stages: &[&[Poke]],
) {
    const EDITS: [(&str, Option<(usize, usize)>); 4] = [
        ("as written", None),
        ("rules 0 and 1 swapped", Some((0, 1))),
        ("then rules 0 and 2 swapped", Some((0, 2))),
        ("then rules 3 and 4 swapped", Some((3, 4))),
    ];
    let c = crate::flow_audit::audited(prefix, backend);
    for ((what, edit), pokes) in EDITS.iter().zip(stages) {
        if let Some((a, b)) = edit {
            for dir in [Dir::Ingress, Dir::Egress] {
                let rules = policy.rules_mut(dir);
                if !rules.is_empty() {
                    rules.swap(*a, *b);
                }
            }
        }
        stage(
            &c,
            &format!("{test}, {what}"),
            std::slice::from_ref(&policy),
            pokes,
        );
    }
}
