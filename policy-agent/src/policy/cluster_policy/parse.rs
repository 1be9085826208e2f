//! A ClusterNetworkPolicy validated into the terms of the evaluator and
//! the compiler, failing closed as the API requires.
//!
//! Per rule: "If an implementation sees no fields are set then it can
//! infer that the deployed CRD is of an incompatible version with an
//! unknown field. In that case it should fail closed. For "Accept" rules,
//! "fail closed" means: "treat the rule as matching no traffic". For
//! "Deny" and "Pass" rules, "fail closed" means: "treat the rule as a
//! 'Deny all' rule"." Every field a rule holds that this version does not
//! understand, or holds wrongly, is treated the same way.
//!
//! Per policy (tier, priority, subject, the API's bounds, unknown spec
//! fields): nothing it would let through is let through, and what it
//! would stop is stopped where it is strongest. See [`Effect`].
use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use policy_common::{direction, proto};

use super::error::{ClusterPolicyError, ClusterPolicyErrorKind as Kind, Effect};
use crate::{
    cluster::{
        Labels,
        cluster_policy::{self as wire, Unknown},
    },
    policy::{ports::is_valid_port_name, selector::Selector},
};

/// The API's bounds: "A maximum of 25 rules is allowed in this block",
/// and 25 peers, CIDRs, domain names and protocols per rule.
pub const MAX_ITEMS: usize = 25;

/// `tier`: "Policy tiers are evaluated in the following order: Admin
/// tier, NetworkPolicy tier, Baseline tier."
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Admin,
    Baseline,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Self::Admin => "Admin",
            Self::Baseline => "Baseline",
        }
    }
}

/// A rule's action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Accept,
    Deny,
    Pass,
}

impl Action {
    /// The slot action of [`policy_common::policy::action`].
    pub fn code(self) -> u32 {
        use policy_common::policy::action;
        match self {
            Self::Accept => action::ACCEPT,
            Self::Deny => action::DENY,
            Self::Pass => action::PASS,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Accept => "Accept",
            Self::Deny => "Deny",
            Self::Pass => "Pass",
        }
    }
}

/// Which pods the policy applies to. "Note that host-networked pods are
/// not included in subject selection."
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubjectSelector {
    /// "Namespaces is used to select pods via namespace selectors."
    Namespaces(Selector),
    /// "Pods is used to select pods via namespace AND pod selectors."
    Pods {
        namespaces: Selector,
        pods: Selector,
    },
    /// The subject could not be read: every pod (fail closed).
    Every,
}

impl SubjectSelector {
    pub fn selects(&self, namespace_labels: &Labels, labels: &Labels) -> bool {
        match self {
            Self::Namespaces(ns) => ns.matches(namespace_labels),
            Self::Pods { namespaces, pods } => {
                namespaces.matches(namespace_labels) && pods.matches(labels)
            }
            Self::Every => true,
        }
    }
}

/// One peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterPeer {
    /// "Namespaces defines a way to select all pods within a set of
    /// Namespaces. Note that host-networked pods are not included."
    Namespaces(Selector),
    /// "Pods defines a way to select a set of pods in a set of namespaces."
    Pods {
        namespaces: Selector,
        pods: Selector,
    },
    /// "Networks defines a way to select peers via CIDB blocks ... note
    /// that cluster-internal traffic will be checked against the rule as
    /// well."
    Networks(Vec<IpNet>),
    /// "It selects the nodeIPs as the peer type by matching on the IPs
    /// present in the node.Status.Addresses field of the node."
    Nodes(Selector),
}

/// One entry of `protocols`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolMatch {
    /// "If destinationPort is omitted, all ports for the specified protocol
    /// match."
    AllPorts(u8),
    /// A port number (first == last) or an inclusive range.
    Ports { protocol: u8, first: u16, last: u16 },
    /// "DestinationNamedPort selects a destination port on a pod based on
    /// the ContainerPort name."
    Named(String),
}

/// What a rule matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuleMatch {
    /// Failed closed (an Accept rule).
    Nothing,
    /// Failed closed (a Deny or Pass rule, enforced as Deny).
    Everything,
    /// As written: any peer, and any protocol entry (`None`: "If
    /// unspecified, protocol-specific attributes will not be used to match
    /// traffic").
    Peers {
        peers: Vec<ClusterPeer>,
        protocols: Option<Vec<ProtocolMatch>>,
    },
}

/// One validated rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterRule {
    /// Position in `spec.ingress` / `spec.egress`: "a rule that appears at
    /// the top of the ingress rules would take the highest precedence."
    pub index: usize,
    /// "Name is an identifier for this rule" (may be empty).
    pub name: String,
    /// The action enforced (a failed Pass rule is a Deny).
    pub action: Action,
    pub matches: RuleMatch,
}

/// A ClusterNetworkPolicy in the evaluator's and compiler's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedClusterPolicy {
    pub name: String,
    /// `metadata.generation`: the version its status reports on.
    pub generation: Option<i64>,
    pub tier: Tier,
    /// 0-1000, lower first.
    pub priority: u32,
    pub subject: SubjectSelector,
    pub ingress: Vec<ClusterRule>,
    pub egress: Vec<ClusterRule>,
    pub errors: Vec<ClusterPolicyError>,
}

impl ParsedClusterPolicy {
    /// The prefixes its networks peers carve.
    pub fn prefixes(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.ingress
            .iter()
            .chain(&self.egress)
            .filter_map(|r| match &r.matches {
                RuleMatch::Peers { peers, .. } => Some(peers),
                _ => None,
            })
            .flatten()
            .filter_map(|p| match p {
                ClusterPeer::Networks(nets) => Some(nets.iter().copied()),
                _ => None,
            })
            .flatten()
    }

    /// The selectors of its `nodes` peers (egress only).
    pub fn node_selectors(&self) -> impl Iterator<Item = &Selector> + '_ {
        self.egress
            .iter()
            .filter_map(|r| match &r.matches {
                RuleMatch::Peers { peers, .. } => Some(peers),
                _ => None,
            })
            .flatten()
            .filter_map(|p| match p {
                ClusterPeer::Nodes(sel) => Some(sel),
                _ => None,
            })
    }

    pub fn rules(&self, dir: u8) -> &[ClusterRule] {
        if dir == direction::INGRESS {
            &self.ingress
        } else {
            &self.egress
        }
    }

    /// Validates `cnp`.
    pub fn parse(cnp: &wire::ClusterNetworkPolicy) -> Self {
        let name = cnp.metadata.name.clone().unwrap_or_default();
        let mut p = Parser {
            name: &name,
            errors: Vec::new(),
        };
        let spec = &cnp.spec;
        let mut policy_ok = p.unknown("spec", &spec.unknown, Effect::PolicyFailsClosed);
        let tier = match spec.tier.as_deref() {
            Some("Admin") => Tier::Admin,
            Some("Baseline") => Tier::Baseline,
            other => {
                let kind = match other {
                    None => Kind::Missing("tier"),
                    Some(v) => Kind::UnknownTier { value: v.into() },
                };
                p.error("spec.tier", kind, Effect::PolicyFailsClosed);
                policy_ok = false;
                Tier::Admin
            }
        };
        let priority = match spec.priority {
            Some(v) if (0..=1000).contains(&v) => v as u32,
            other => {
                let kind = match other {
                    None => Kind::Missing("priority"),
                    Some(value) => Kind::PriorityOutOfRange { value },
                };
                p.error("spec.priority", kind, Effect::PolicyFailsClosed);
                policy_ok = false;
                0
            }
        };
        let subject = match p.subject(spec.subject.as_ref()) {
            Some(s) => s,
            None => {
                policy_ok = false;
                SubjectSelector::Every
            }
        };
        let mut rules = [Vec::new(), Vec::new()];
        for (dir, list) in [
            (direction::INGRESS, &spec.ingress),
            (direction::EGRESS, &spec.egress),
        ] {
            let list = list.as_deref().unwrap_or_default();
            let field = format!("spec.{}", direction::name(dir));
            if list.len() > MAX_ITEMS {
                p.too_many(&field, list.len(), Effect::PolicyFailsClosed);
                policy_ok = false;
            }
            rules[usize::from(dir)] = list
                .iter()
                .enumerate()
                .map(|(i, r)| p.rule(dir, &format!("{field}[{i}]"), i, r))
                .collect::<Vec<_>>();
        }
        let [mut ingress, mut egress] = rules;
        let errors = p.errors;
        if !policy_ok {
            for r in ingress.iter_mut().chain(egress.iter_mut()) {
                match r.action {
                    Action::Accept => r.matches = RuleMatch::Nothing,
                    Action::Pass => r.action = Action::Deny,
                    Action::Deny => {}
                }
            }
        }
        Self {
            name,
            generation: cnp.metadata.generation,
            tier,
            priority,
            subject,
            ingress,
            egress,
            errors,
        }
    }
}

/// Collects the errors of one policy.
struct Parser<'a> {
    name: &'a str,
    errors: Vec<ClusterPolicyError>,
}

/// A rule that failed closed keeps this.
fn failed(action: Option<Action>) -> (Action, RuleMatch, Effect) {
    match action {
        Some(Action::Accept) => (
            Action::Accept,
            RuleMatch::Nothing,
            Effect::RuleMatchesNothing,
        ),
        _ => (Action::Deny, RuleMatch::Everything, Effect::RuleDeniesAll),
    }
}

impl Parser<'_> {
    fn error(&mut self, field: impl Into<String>, kind: Kind, effect: Effect) {
        self.errors.push(ClusterPolicyError {
            policy: self.name.to_owned(),
            field: field.into(),
            kind,
            effect,
        });
    }

    /// Reports every unknown field; whether there was none.
    fn unknown(&mut self, field: &str, unknown: &Unknown, effect: Effect) -> bool {
        for name in unknown.keys() {
            self.error(field, Kind::UnknownField { name: name.clone() }, effect);
        }
        unknown.is_empty()
    }

    fn too_many(&mut self, field: &str, count: usize, effect: Effect) {
        self.error(
            field,
            Kind::TooMany {
                count,
                max: MAX_ITEMS,
            },
            effect,
        );
    }

    fn selector(
        &mut self,
        field: &str,
        sel: Option<&LabelSelector>,
        effect: Effect,
    ) -> Option<Selector> {
        // An absent selector inside a set field is the empty one: "if
        // empty, it selects all".
        let Some(sel) = sel else {
            return Some(Selector::everything());
        };
        Selector::parse(sel)
            .map_err(|(sub, problem)| {
                self.error(
                    format!("{field}.{sub}"),
                    Kind::BadSelector { problem },
                    effect,
                )
            })
            .ok()
    }

    fn namespaced_pod(
        &mut self,
        field: &str,
        np: &wire::NamespacedPod,
        effect: Effect,
    ) -> Option<(Selector, Selector)> {
        let known = self.unknown(field, &np.unknown, effect);
        let namespaces = self.selector(
            &format!("{field}.namespaceSelector"),
            np.namespace_selector.as_ref(),
            effect,
        );
        // "PodSelector ... +required".
        if np.pod_selector.is_none() {
            self.error(
                format!("{field}.podSelector"),
                Kind::Missing("podSelector"),
                effect,
            );
            return None;
        }
        let pods = self.selector(
            &format!("{field}.podSelector"),
            np.pod_selector.as_ref(),
            effect,
        );
        Some((namespaces?, pods?)).filter(|_| known)
    }

    fn subject(&mut self, subject: Option<&wire::Subject>) -> Option<SubjectSelector> {
        let effect = Effect::PolicyFailsClosed;
        let Some(s) = subject else {
            self.error("spec.subject", Kind::Missing("subject"), effect);
            return None;
        };
        let known = self.unknown("spec.subject", &s.unknown, effect);
        let out = match (&s.namespaces, &s.pods) {
            (Some(ns), None) => self
                .selector("spec.subject.namespaces", Some(ns), effect)
                .map(SubjectSelector::Namespaces),
            (None, Some(pods)) => self
                .namespaced_pod("spec.subject.pods", pods, effect)
                .map(|(namespaces, pods)| SubjectSelector::Pods { namespaces, pods }),
            _ => {
                self.error("spec.subject", Kind::SubjectNotOne, effect);
                None
            }
        };
        out.filter(|_| known)
    }

    fn rule(&mut self, dir: u8, field: &str, index: usize, r: &wire::Rule) -> ClusterRule {
        let name = r.name.clone().unwrap_or_default();
        if name.chars().count() > 100 {
            self.error(
                format!("{field}.name"),
                Kind::NameTooLong {
                    len: name.chars().count(),
                },
                Effect::ReportedOnly,
            );
        }
        let action = match r.action.as_deref() {
            Some("Accept") => Some(Action::Accept),
            Some("Deny") => Some(Action::Deny),
            Some("Pass") => Some(Action::Pass),
            _ => None,
        };
        let (fail_action, fail_match, effect) = failed(action);
        let fail = || ClusterRule {
            index,
            name: name.clone(),
            action: fail_action,
            matches: fail_match.clone(),
        };
        let Some(action) = action else {
            let kind = match &r.action {
                None => Kind::Missing("action"),
                Some(v) => Kind::UnknownAction { value: v.clone() },
            };
            self.error(format!("{field}.action"), kind, effect);
            return fail();
        };
        let (peer_field, peers, other, other_field) = if dir == direction::INGRESS {
            ("from", &r.from, &r.to, "to")
        } else {
            ("to", &r.to, &r.from, "from")
        };
        let mut ok = self.unknown(field, &r.unknown, effect);
        if other.is_some() {
            self.error(
                field,
                Kind::UnknownField {
                    name: other_field.into(),
                },
                effect,
            );
            ok = false;
        }
        let peers = match peers.as_deref() {
            None | Some([]) => {
                self.error(format!("{field}.{peer_field}"), Kind::NoPeers, effect);
                return fail();
            }
            Some(list) => {
                if list.len() > MAX_ITEMS {
                    self.too_many(&format!("{field}.{peer_field}"), list.len(), effect);
                    ok = false;
                }
                let mut out = Vec::new();
                for (i, peer) in list.iter().enumerate() {
                    match self.peer(dir, &format!("{field}.{peer_field}[{i}]"), peer, effect) {
                        PeerOutcome::Peer(p) => out.push(p),
                        PeerOutcome::Unsupported => {
                            // domainNames ("only supported for Accept
                            // rules"), not enforced yet: an Accept rule
                            // matches nothing; any other fails closed.
                            if action == Action::Accept {
                                return ClusterRule {
                                    index,
                                    name,
                                    action,
                                    matches: RuleMatch::Nothing,
                                };
                            }
                            ok = false;
                        }
                        PeerOutcome::Bad => ok = false,
                    }
                }
                out
            }
        };
        let protocols = match r.protocols.as_deref() {
            None => None,
            Some(list) => {
                if list.is_empty() {
                    // "+kubebuilder:validation:MinItems=1"
                    self.error(
                        format!("{field}.protocols"),
                        Kind::Missing("an item"),
                        effect,
                    );
                    ok = false;
                }
                if list.len() > MAX_ITEMS {
                    self.too_many(&format!("{field}.protocols"), list.len(), effect);
                    ok = false;
                }
                let mut out = Vec::new();
                for (i, pm) in list.iter().enumerate() {
                    match self.protocol(&format!("{field}.protocols[{i}]"), pm, effect) {
                        Some(m) => out.push(m),
                        None => ok = false,
                    }
                }
                Some(out)
            }
        };
        // "networks/nodes/domainNames peer cannot be set with namedPorts
        // since there are no namedPorts for networks/nodes/domainNames"
        let named = protocols
            .iter()
            .flatten()
            .any(|m| matches!(m, ProtocolMatch::Named(_)));
        if named
            && peers
                .iter()
                .any(|p| matches!(p, ClusterPeer::Networks(_) | ClusterPeer::Nodes(_)))
        {
            self.error(
                format!("{field}.protocols"),
                Kind::NamedPortWithoutPods,
                effect,
            );
            ok = false;
        }
        if !ok {
            return fail();
        }
        ClusterRule {
            index,
            name,
            action,
            matches: RuleMatch::Peers { peers, protocols },
        }
    }

    fn peer(&mut self, dir: u8, field: &str, peer: &wire::Peer, effect: Effect) -> PeerOutcome {
        let known = self.unknown(field, &peer.unknown, effect);
        let set = [
            peer.namespaces.is_some(),
            peer.pods.is_some(),
            peer.nodes.is_some(),
            peer.networks.is_some(),
            peer.domain_names.is_some(),
        ]
        .iter()
        .filter(|s| **s)
        .count();
        if set != 1 {
            self.error(field, Kind::PeerNotOne, effect);
            return PeerOutcome::Bad;
        }
        if !known {
            return PeerOutcome::Bad;
        }
        // Ingress peers: namespaces and pods only; anything else is a
        // field this direction does not understand.
        let egress_only = |name: &str| Kind::UnknownField { name: name.into() };
        if let Some(ns) = &peer.namespaces {
            return self
                .selector(&format!("{field}.namespaces"), Some(ns), effect)
                .map_or(PeerOutcome::Bad, |s| {
                    PeerOutcome::Peer(ClusterPeer::Namespaces(s))
                });
        }
        if let Some(pods) = &peer.pods {
            return self
                .namespaced_pod(&format!("{field}.pods"), pods, effect)
                .map_or(PeerOutcome::Bad, |(namespaces, pods)| {
                    PeerOutcome::Peer(ClusterPeer::Pods { namespaces, pods })
                });
        }
        if dir == direction::INGRESS {
            let name = if peer.nodes.is_some() {
                "nodes"
            } else if peer.networks.is_some() {
                "networks"
            } else {
                "domainNames"
            };
            self.error(field, egress_only(name), effect);
            return PeerOutcome::Bad;
        }
        if let Some(nodes) = &peer.nodes {
            // "if present but empty, it selects all Nodes."
            return self
                .selector(&format!("{field}.nodes"), Some(nodes), effect)
                .map_or(PeerOutcome::Bad, |s| {
                    PeerOutcome::Peer(ClusterPeer::Nodes(s))
                });
        }
        if let Some(nets) = &peer.networks {
            if nets.is_empty() {
                self.error(
                    format!("{field}.networks"),
                    Kind::Missing("an item"),
                    effect,
                );
                return PeerOutcome::Bad;
            }
            if nets.len() > MAX_ITEMS {
                self.too_many(&format!("{field}.networks"), nets.len(), effect);
                return PeerOutcome::Bad;
            }
            let mut out = Vec::new();
            for (i, n) in nets.iter().enumerate() {
                match parse_cidr(n) {
                    Some(net) => out.push(net),
                    None => {
                        self.error(
                            format!("{field}.networks[{i}]"),
                            Kind::BadCidr { value: n.clone() },
                            effect,
                        );
                        return PeerOutcome::Bad;
                    }
                }
            }
            return PeerOutcome::Peer(ClusterPeer::Networks(out));
        }
        self.error(
            format!("{field}.domainNames"),
            Kind::DomainNamesNotSupported,
            effect,
        );
        PeerOutcome::Unsupported
    }

    fn protocol(
        &mut self,
        field: &str,
        pm: &wire::Protocol,
        effect: Effect,
    ) -> Option<ProtocolMatch> {
        let known = self.unknown(field, &pm.unknown, effect);
        let set = [
            pm.tcp.is_some(),
            pm.udp.is_some(),
            pm.sctp.is_some(),
            pm.destination_named_port.is_some(),
        ]
        .iter()
        .filter(|s| **s)
        .count();
        if set != 1 {
            self.error(field, Kind::ProtocolNotOne, effect);
            return None;
        }
        if let Some(name) = &pm.destination_named_port {
            if !is_valid_port_name(name) {
                self.error(
                    format!("{field}.destinationNamedPort"),
                    Kind::BadPortName {
                        value: name.clone(),
                    },
                    effect,
                );
                return None;
            }
            return known.then(|| ProtocolMatch::Named(name.clone()));
        }
        let (key, protocol, ports) = if let Some(p) = &pm.tcp {
            ("tcp", proto::TCP, p)
        } else if let Some(p) = &pm.udp {
            ("udp", proto::UDP, p)
        } else {
            ("sctp", proto::SCTP, pm.sctp.as_ref()?)
        };
        let field = format!("{field}.{key}");
        let known = self.unknown(&field, &ports.unknown, effect) && known;
        let Some(port) = &ports.destination_port else {
            return known.then_some(ProtocolMatch::AllPorts(protocol));
        };
        let field = format!("{field}.destinationPort");
        let known = self.unknown(&field, &port.unknown, effect) && known;
        let in_range = |p: &mut Self, f: String, v: i64| -> Option<u16> {
            let ok = u16::try_from(v).ok().filter(|v| *v >= 1);
            if ok.is_none() {
                p.error(f, Kind::PortOutOfRange { value: v }, effect);
            }
            ok
        };
        let out = match (port.number, &port.range) {
            (Some(n), None) => {
                let n = in_range(self, format!("{field}.number"), n)?;
                ProtocolMatch::Ports {
                    protocol,
                    first: n,
                    last: n,
                }
            }
            (None, Some(r)) => {
                let known = self.unknown(&format!("{field}.range"), &r.unknown, effect);
                let (Some(start), Some(end)) = (r.start, r.end) else {
                    self.error(
                        format!("{field}.range"),
                        Kind::Missing("start and end"),
                        effect,
                    );
                    return None;
                };
                let first = in_range(self, format!("{field}.range.start"), start)?;
                let last = in_range(self, format!("{field}.range.end"), end)?;
                // "Start port must be less than End port"
                if first >= last {
                    self.error(
                        format!("{field}.range"),
                        Kind::RangeNotIncreasing { start, end },
                        effect,
                    );
                    return None;
                }
                if !known {
                    return None;
                }
                ProtocolMatch::Ports {
                    protocol,
                    first,
                    last,
                }
            }
            _ => {
                self.error(field, Kind::PortNotOne, effect);
                return None;
            }
        };
        known.then_some(out)
    }
}

enum PeerOutcome {
    Peer(ClusterPeer),
    /// A peer this agent does not enforce yet (domainNames, nodes).
    Unsupported,
    Bad,
}

/// "Each item in Networks should be provided in the CIDR format, for
/// example "10.0.0.0/8"": a bare address is not a CIDR; host bits are
/// cleared (the API server's isCIDR accepts `10.1.2.3/8` and the prefix
/// it names is 10.0.0.0/8, as for NetworkPolicy's ipBlock).
fn parse_cidr(s: &str) -> Option<IpNet> {
    s.trim().parse::<IpNet>().ok().map(|n| n.trunc())
}
