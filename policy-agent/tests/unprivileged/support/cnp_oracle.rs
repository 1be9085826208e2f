//! ClusterNetworkPolicy in the oracle: the tiers around the NetworkPolicy
//! tier's word, by the reference evaluator (`policy::cluster_policy::
//! evaluate`, written from the API text apart from the compiler), and
//! generators of random ClusterNetworkPolicies.
use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use policy_agent::{
    cluster::{
        ClusterNetworkPolicy, ClusterState, NodeInfo, ObjectRef, PodInfo,
        cluster_policy::{
            NamespacedPod, Peer, Port, PortRange, Protocol, ProtocolPorts, Rule, Spec, Subject,
        },
    },
    policy::cluster_policy::{
        Connection, Decision, ParsedClusterPolicy, PodView, Remote, decide as evaluate,
    },
};
use policy_common::direction;
use proptest::prelude::*;

use super::oracle::{KEYS, NAMESPACES, NS_KEYS, VALUES, cluster, ns_labels};

/// Whether the tiers admit a new connection of `endpoint` (ingress: from
/// `peer`; egress: to it), given the NetworkPolicy tier's word.
#[allow(clippy::too_many_arguments)]
pub fn decide(
    state: &ClusterState,
    endpoint: &ObjectRef,
    ep: &PodInfo,
    ingress: bool,
    peer_pod: Option<(&ObjectRef, &PodInfo)>,
    peer: IpAddr,
    protocol: u8,
    port: u16,
    np_word: Option<bool>,
) -> bool {
    let (allows, _) = decide_by(
        state, endpoint, ep, ingress, peer_pod, peer, protocol, port, np_word,
    );
    allows
}

/// [`decide`], with the tier rule that decided (its policy's name and the
/// rule's index), when an Accept or a Deny of a tier did.
#[allow(clippy::too_many_arguments)]
pub fn decide_by(
    state: &ClusterState,
    endpoint: &ObjectRef,
    ep: &PodInfo,
    ingress: bool,
    peer_pod: Option<(&ObjectRef, &PodInfo)>,
    peer: IpAddr,
    protocol: u8,
    port: u16,
    np_word: Option<bool>,
) -> (bool, Option<(String, usize)>) {
    let policies: Vec<ParsedClusterPolicy> = state
        .cluster_policies
        .values()
        .map(|cnp| ParsedClusterPolicy::parse(cnp))
        .collect();
    let ep_ns = ns_labels(state, &endpoint.namespace);
    let subject = PodView {
        namespace: &endpoint.namespace,
        namespace_labels: &ep_ns,
        labels: &ep.labels,
        ports: &ep.ports,
    };
    // "host-networked pods are not included in this type of peer": they
    // live at their node's addresses, a node peer's.
    let peer_pod = peer_pod.filter(|(_, p)| !p.host_network);
    let peer_ns = peer_pod.map(|(n, _)| ns_labels(state, &n.namespace));
    let node = state.nodes.values().find(|n| n.addresses.contains(&peer));
    let remote = match (peer_pod, &peer_ns, node) {
        (Some((n, p)), Some(ns), _) => Remote::Pod {
            pod: PodView {
                namespace: &n.namespace,
                namespace_labels: ns,
                labels: &p.labels,
                ports: &p.ports,
            },
            ip: peer,
        },
        (_, _, Some(node)) => Remote::Node {
            labels: &node.labels,
            ip: peer,
        },
        _ => Remote::Address(peer),
    };
    let conn = Connection {
        direction: if ingress {
            direction::INGRESS
        } else {
            direction::EGRESS
        },
        subject,
        remote,
        protocol,
        port,
    };
    let (decision, by) = evaluate(&policies, &conn, np_word);
    let tier_decided = matches!(
        decision,
        Decision::AdminAccept
            | Decision::AdminDeny
            | Decision::BaselineAccept
            | Decision::BaselineDeny
    );
    let rule = by
        .filter(|_| tier_decided)
        .map(|m| (m.policy.name.clone(), m.rule.index));
    (decision.allows(), rule)
}

fn labels(keys: &'static [&'static str]) -> impl Strategy<Value = BTreeMap<String, String>> {
    super::oracle::labels(keys)
}

fn selector(keys: &'static [&'static str]) -> impl Strategy<Value = LabelSelector> {
    prop_oneof![
        1 => Just(LabelSelector::default()),
        3 => labels(keys).prop_map(|l| LabelSelector { match_labels: Some(l), match_expressions: None }),
    ]
}

fn namespaces_of(ns: &'static str) -> LabelSelector {
    LabelSelector {
        match_labels: Some([("kubernetes.io/metadata.name".to_owned(), ns.to_owned())].into()),
        match_expressions: None,
    }
}

fn ns_selector() -> impl Strategy<Value = LabelSelector> {
    prop_oneof![
        2 => selector(NS_KEYS),
        2 => proptest::sample::select(NAMESPACES).prop_map(namespaces_of),
    ]
}

/// Label keys of the generated Nodes.
const NODE_KEYS: &[&str] = &["zone"];

fn peer(egress: bool) -> impl Strategy<Value = Peer> {
    let networks = if egress { 3 } else { 0 };
    let nodes = if egress { 2 } else { 0 };
    prop_oneof![
        nodes => selector(NODE_KEYS).prop_map(|s| Peer { nodes: Some(s), ..Default::default() }),
        3 => ns_selector().prop_map(|s| Peer { namespaces: Some(s), ..Default::default() }),
        3 => (ns_selector(), selector(KEYS)).prop_map(|(n, p)| Peer {
            pods: Some(NamespacedPod { namespace_selector: Some(n), pod_selector: Some(p), ..Default::default() }),
            ..Default::default()
        }),
        networks => proptest::collection::vec(
            proptest::sample::select(&["10.0.0.0/8", "10.0.0.0/24", "10.1.0.0/16", "0.0.0.0/0", "fd00::/16", "::/0", "203.0.113.0/24"][..]),
            1..=2,
        )
        .prop_map(|n| Peer { networks: Some(n.into_iter().map(str::to_owned).collect()), ..Default::default() }),
    ]
}

fn protocol() -> impl Strategy<Value = Protocol> {
    let ports = |p: Option<Port>| ProtocolPorts {
        destination_port: p,
        ..Default::default()
    };
    let number = |n: u16| {
        Some(Port {
            number: Some(i64::from(n)),
            ..Default::default()
        })
    };
    prop_oneof![
        2 => proptest::sample::select(&[53u16, 80, 81, 8080][..]).prop_map(move |n| Protocol { tcp: Some(ports(number(n))), ..Default::default() }),
        1 => Just(Protocol { udp: Some(ports(number(53))), ..Default::default() }),
        1 => Just(Protocol { tcp: Some(ports(Some(Port {
            range: Some(PortRange { start: Some(80), end: Some(8080), ..Default::default() }),
            ..Default::default()
        }))), ..Default::default() }),
        1 => Just(Protocol { sctp: Some(ports(None)), ..Default::default() }),
        1 => proptest::sample::select(&["http", "dns"][..]).prop_map(|n| Protocol { destination_named_port: Some(n.to_owned()), ..Default::default() }),
    ]
}

fn rule(egress: bool) -> impl Strategy<Value = Rule> {
    (
        proptest::sample::select(&["Accept", "Deny", "Pass"][..]),
        proptest::collection::vec(peer(egress), 1..=2),
        prop_oneof![2 => Just(None), 2 => proptest::collection::vec(protocol(), 1..=2).prop_map(Some)],
        0u8..10,
    )
        .prop_map(move |(action, peers, mut protocols, n)| {
            // "networks/nodes/domainNames peer cannot be set with namedPorts"
            if peers.iter().any(|p| p.networks.is_some())
                && let Some(list) = &mut protocols
            {
                list.retain(|p| p.destination_named_port.is_none());
                if list.is_empty() {
                    protocols = None;
                }
            }
            let (from, to) = if egress { (None, Some(peers)) } else { (Some(peers), None) };
            Rule { name: Some(format!("r{n}")), action: Some(action.to_owned()), from, to, protocols, ..Default::default() }
        })
}

/// A random valid ClusterNetworkPolicy over [`NAMESPACES`].
pub fn cluster_policy() -> impl Strategy<Value = ClusterNetworkPolicy> {
    (
        proptest::sample::select(&["Admin", "Baseline"][..]),
        proptest::sample::select(&[0i64, 10, 10, 20, 1000][..]),
        prop_oneof![
            2 => ns_selector().prop_map(|s| Subject { namespaces: Some(s), ..Default::default() }),
            2 => (ns_selector(), selector(KEYS)).prop_map(|(n, p)| Subject {
                pods: Some(NamespacedPod { namespace_selector: Some(n), pod_selector: Some(p), ..Default::default() }),
                ..Default::default()
            }),
        ],
        prop_oneof![1 => Just(None), 2 => proptest::collection::vec(rule(false), 1..=3).prop_map(Some)],
        prop_oneof![1 => Just(None), 2 => proptest::collection::vec(rule(true), 1..=3).prop_map(Some)],
    )
        .prop_map(|(tier, priority, subject, ingress, egress)| ClusterNetworkPolicy {
            metadata: ObjectMeta::default(),
            spec: Spec {
                tier: Some(tier.to_owned()),
                priority: Some(priority),
                subject: Some(subject),
                ingress,
                egress,
                ..Default::default()
            },
        })
}

/// A random small cluster (see [`cluster`]) with one to three
/// ClusterNetworkPolicies.
pub fn cluster_with_tiers() -> impl Strategy<Value = ClusterState> {
    (
        cluster(),
        proptest::collection::vec(cluster_policy(), 1..=3),
        (labels(NODE_KEYS), labels(NODE_KEYS)),
    )
        .prop_map(|(mut s, cnps, (here, there))| {
            // This node, and another one at an address outside the pods'.
            for (name, labels, ip) in [
                (super::oracle::NODE, here, super::oracle::NODE_IP),
                ("node-b", there, "203.0.113.1"),
            ] {
                let addresses = vec![ip.parse().unwrap()];
                s.nodes.insert(name.into(), NodeInfo { labels, addresses });
            }
            for (i, mut c) in cnps.into_iter().enumerate() {
                let name = format!("cnp{i}");
                c.metadata.name = Some(name.clone());
                s.cluster_policies.insert(name, c.into());
            }
            s
        })
}

#[allow(dead_code)]
const _: &[&str] = VALUES;
