//! The reference evaluator: one connection against ClusterNetworkPolicies
//! and the NetworkPolicy tier, written from the API's text alone. It does
//! not share code with the compiler; tests hold the compiled maps to it.
use std::net::IpAddr;

use policy_common::direction;

use super::parse::{
    Action, ClusterPeer, ClusterRule, ParsedClusterPolicy, ProtocolMatch, RuleMatch, Tier,
};
use crate::cluster::{ContainerPort, Labels};

/// A pod as the API sees it.
#[derive(Clone, Copy, Debug)]
pub struct PodView<'a> {
    pub namespace: &'a str,
    pub namespace_labels: &'a Labels,
    pub labels: &'a Labels,
    pub ports: &'a [ContainerPort],
}

/// The far side of a connection.
#[derive(Clone, Copy, Debug)]
pub enum Remote<'a> {
    /// A pod (not host-networked): "host-networked pods are not included
    /// in this type of peer", so those come as [`Remote::Node`].
    Pod { pod: PodView<'a>, ip: IpAddr },
    /// One of a node's `status.addresses`, with the node's labels.
    Node { labels: &'a Labels, ip: IpAddr },
    /// Any other address.
    Address(IpAddr),
}

impl Remote<'_> {
    pub fn ip(&self) -> IpAddr {
        match self {
            Self::Pod { ip, .. } | Self::Node { ip, .. } | Self::Address(ip) => *ip,
        }
    }
}

/// One new connection seen from a subject pod: its ingress (`remote` is
/// the source) or its egress (`remote` is the destination).
#[derive(Clone, Copy, Debug)]
pub struct Connection<'a> {
    pub direction: u8,
    pub subject: PodView<'a>,
    pub remote: Remote<'a>,
    pub protocol: u8,
    /// The destination port (0 for protocols without ports).
    pub port: u16,
}

impl Connection<'_> {
    /// "DestinationNamedPort selects a destination port on a pod": the
    /// subject for ingress, the remote pod for egress (no pod: no port).
    fn destination_ports(&self) -> Option<&[ContainerPort]> {
        if self.direction == direction::INGRESS {
            Some(self.subject.ports)
        } else {
            match &self.remote {
                Remote::Pod { pod, .. } => Some(pod.ports),
                _ => None,
            }
        }
    }
}

fn peer_matches(peer: &ClusterPeer, remote: &Remote) -> bool {
    match (peer, remote) {
        (ClusterPeer::Namespaces(ns), Remote::Pod { pod, .. }) => ns.matches(pod.namespace_labels),
        (ClusterPeer::Pods { namespaces, pods }, Remote::Pod { pod, .. }) => {
            namespaces.matches(pod.namespace_labels) && pods.matches(pod.labels)
        }
        (ClusterPeer::Nodes(sel), Remote::Node { labels, .. }) => sel.matches(labels),
        // "cluster-internal traffic will be checked against the rule as
        // well"; "Networks matches both regular IP traffic and ICMP".
        (ClusterPeer::Networks(nets), r) => nets.iter().any(|n| n.contains(&r.ip())),
        _ => false,
    }
}

fn protocol_matches(m: &ProtocolMatch, conn: &Connection) -> bool {
    match m {
        ProtocolMatch::AllPorts(p) => *p == conn.protocol,
        ProtocolMatch::Ports {
            protocol,
            first,
            last,
        } => *protocol == conn.protocol && (*first..=*last).contains(&conn.port),
        // The container port with that name, of the connection's protocol.
        ProtocolMatch::Named(name) => conn.destination_ports().is_some_and(|ports| {
            ports.iter().any(|p| {
                p.name.as_deref() == Some(name.as_str())
                    && p.protocol == conn.protocol
                    && p.port == conn.port
            })
        }),
    }
}

/// Whether `rule` matches the connection: "If any element matches the
/// source of incoming traffic then the specified action is applied";
/// protocols "If unspecified, protocol-specific attributes will not be
/// used to match traffic".
pub fn rule_matches(rule: &ClusterRule, conn: &Connection) -> bool {
    match &rule.matches {
        RuleMatch::Nothing => false,
        RuleMatch::Everything => true,
        RuleMatch::Peers { peers, protocols } => {
            peers.iter().any(|p| peer_matches(p, &conn.remote))
                && protocols
                    .as_ref()
                    .is_none_or(|list| list.iter().any(|m| protocol_matches(m, conn)))
        }
    }
}

/// The rule of a tier that decides a connection.
#[derive(Clone, Copy, Debug)]
pub struct TierMatch<'a> {
    pub policy: &'a ParsedClusterPolicy,
    pub rule: &'a ClusterRule,
}

/// The policies of `tier` in the order they are tried: "Policies with lower
/// priority values have higher precedence". Of equal priorities "the
/// implementation can apply any of the matching policies": this one tries
/// them by name.
pub fn in_order(policies: &[ParsedClusterPolicy], tier: Tier) -> Vec<&ParsedClusterPolicy> {
    let mut out: Vec<_> = policies.iter().filter(|p| p.tier == tier).collect();
    out.sort_by(|a, b| (a.priority, &a.name).cmp(&(b.priority, &b.name)));
    out
}

/// The first rule of `tier` matching `conn`: policies selecting the subject
/// in order, "the relative precedence of ingress rules within a single CNP
/// object ... will be determined by the order in which the rule is
/// written". "Note that host-networked pods are not included in subject
/// selection": callers pass only pods.
pub fn first_match<'a>(
    policies: &'a [ParsedClusterPolicy],
    tier: Tier,
    conn: &Connection,
) -> Option<TierMatch<'a>> {
    in_order(policies, tier)
        .into_iter()
        .filter(|p| {
            p.subject
                .selects(conn.subject.namespace_labels, conn.subject.labels)
        })
        .find_map(|policy| {
            policy
                .rules(conn.direction)
                .iter()
                .find(|r| rule_matches(r, conn))
                .map(|rule| TierMatch { policy, rule })
        })
}

/// What decided a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// An Admin rule accepted it.
    AdminAccept,
    /// An Admin rule denied it.
    AdminDeny,
    /// A NetworkPolicy isolates the subject: its rules allow it (true) or
    /// none does (false).
    NetworkPolicy(bool),
    BaselineAccept,
    BaselineDeny,
    /// "If a given connection wasn't allowed or denied by any of the tiers,
    /// the default kubernetes policy is applied, which says that all pods
    /// can communicate with each other."
    Default,
}

impl Decision {
    pub fn allows(self) -> bool {
        matches!(
            self,
            Self::AdminAccept | Self::NetworkPolicy(true) | Self::BaselineAccept | Self::Default
        )
    }
}

/// Decides `conn` tier by tier. `network_policy` is the NetworkPolicy
/// tier's word on it: `None` when no NetworkPolicy isolates the subject in
/// this direction ("Further evaluation only happens for Pods not selected
/// by a v1.NetworkPolicy"), else whether one of their rules allows it.
///
/// "If Admin tier has made a final decision (Accept or Deny) on a
/// connection, then no further evaluation is done." Pass: "Skips all
/// further ClusterNetworkPolicy rules in the current tier for the selected
/// traffic, and passes evaluation to the next tier."
pub fn decide<'a>(
    policies: &'a [ParsedClusterPolicy],
    conn: &Connection,
    network_policy: Option<bool>,
) -> (Decision, Option<TierMatch<'a>>) {
    let admin = first_match(policies, Tier::Admin, conn);
    match admin.map(|m| m.rule.action) {
        Some(Action::Accept) => return (Decision::AdminAccept, admin),
        Some(Action::Deny) => return (Decision::AdminDeny, admin),
        Some(Action::Pass) | None => {}
    }
    if let Some(allowed) = network_policy {
        return (Decision::NetworkPolicy(allowed), admin);
    }
    let baseline = first_match(policies, Tier::Baseline, conn);
    match baseline.map(|m| m.rule.action) {
        Some(Action::Accept) => (Decision::BaselineAccept, baseline),
        Some(Action::Deny) => (Decision::BaselineDeny, baseline),
        // "from Baseline to the default".
        Some(Action::Pass) | None => (Decision::Default, baseline.or(admin)),
    }
}
