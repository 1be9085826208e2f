//! The ClusterNetworkPolicy tiers' word on one side of a flow, from the
//! policies read directly (the reference evaluator), naming the rule that
//! decided and where a Pass handed the flow on.
use policy_common::proto;

use super::{judge::Side, report::TierReport};
use crate::{
    cluster::{ClusterState, ContainerPort, PodRef},
    identity::LabelKey,
    policy::cluster_policy::{
        Action, Connection, Decision, ParsedClusterPolicy, PodView, Remote, decide,
    },
};

fn ports_of(key: &LabelKey) -> Vec<ContainerPort> {
    key.named_ports
        .iter()
        .map(|p| ContainerPort {
            name: Some(p.name.as_str().into()),
            port: p.port,
            protocol: p.protocol,
        })
        .collect()
}

fn view<'a>(pod: &'a PodRef, key: &'a LabelKey, ports: &'a [ContainerPort]) -> PodView<'a> {
    PodView {
        namespace: &pod.namespace,
        namespace_labels: &key.namespace_labels,
        labels: &key.labels,
        ports,
    }
}

/// The decision at `endpoint` in `dir` with `peer`, given the
/// NetworkPolicy tier's word; None when no ClusterNetworkPolicy exists.
#[allow(clippy::too_many_arguments)]
pub(super) fn tier_decision(
    state: &ClusterState,
    dir: u8,
    endpoint: &(PodRef, LabelKey),
    peer: &Side,
    protocol: u8,
    port: u16,
    network_policy: Option<bool>,
) -> Option<(Decision, Option<TierReport>)> {
    if state.cluster_policies.is_empty() {
        return None;
    }
    let policies: Vec<ParsedClusterPolicy> = state
        .cluster_policies
        .values()
        .map(|cnp| ParsedClusterPolicy::parse(cnp))
        .collect();
    let (ep_ports, peer_ports) = (
        ports_of(&endpoint.1),
        peer.pod
            .as_ref()
            .map(|(_, k)| ports_of(k))
            .unwrap_or_default(),
    );
    // A Node's address (a host-network pod's too) is a `nodes` peer's.
    let node = state
        .nodes
        .values()
        .find(|n| n.addresses.contains(&peer.address));
    let remote = match (&peer.pod, node) {
        (Some((p, k)), _) => Remote::Pod {
            pod: view(p, k, &peer_ports),
            ip: peer.address,
        },
        (None, Some(n)) => Remote::Node {
            labels: &n.labels,
            ip: peer.address,
        },
        (None, None) => Remote::Address(peer.address),
    };
    let conn = Connection {
        direction: dir,
        subject: view(&endpoint.0, &endpoint.1, &ep_ports),
        remote,
        protocol,
        port: if proto::has_ports(protocol) { port } else { 0 },
    };
    let (decision, matched) = decide(&policies, &conn, network_policy);
    let report = matched.map(|m| TierReport {
        tier: m.policy.tier.name().to_owned(),
        policy: m.policy.name.clone(),
        priority: m.policy.priority,
        rule_index: m.rule.index,
        rule_name: m.rule.name.clone(),
        action: m.rule.action.name().to_owned(),
        passed_to: (m.rule.action == Action::Pass).then(|| {
            match decision {
                Decision::NetworkPolicy(_) => "NetworkPolicy",
                Decision::BaselineAccept | Decision::BaselineDeny => "Baseline",
                _ => "the default",
            }
            .to_owned()
        }),
    });
    Some((decision, report))
}
