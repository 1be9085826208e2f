//! The judgement at one local endpoint: the map verdict (the kernel's
//! lookup order over the compiled content) beside the rule verdict (the
//! policies read with [`super::super::evaluate`]).
use std::{cmp::Reverse, collections::BTreeMap, net::IpAddr};

use policy_common::{
    direction,
    identity::{ANY, NODE},
    ipcache::IpcacheEntry,
    model::{Maps, has_ports},
    policy::PolicyKey,
};

use super::report::{DirectionReport, KeyReport, PeerReport, PolicyReport, RuleMatch};
use crate::{
    cluster::{ClusterState, PodInfo, PodRef},
    identity::{LabelKey, default_namespace_labels, protocol_name},
    mapstate::identity_name_str,
    policy::{
        Compiled,
        evaluate::{evaluate_named_port_reach, evaluate_peers, evaluate_ports},
        parse::{ParsedPolicy, Peers, Rule, peer_field},
        peer::Peer,
        ports::{PortMatch, Ports},
    },
};

/// Addresses held by live pods (the compiler's rule: not terminal, not
/// hostNetwork, not a node address; the newest pod, then the first name).
pub(super) fn holders(state: &ClusterState) -> BTreeMap<IpAddr, PodRef> {
    let mut best: BTreeMap<IpAddr, (Reverse<i64>, &PodRef)> = BTreeMap::new();
    for (pod, info) in &state.pods {
        if info.terminal || info.host_network {
            continue;
        }
        for ip in info.ips.iter().filter(|ip| !state.node_ips.contains(ip)) {
            let cand = (Reverse(info.created), pod);
            best.entry(*ip)
                .and_modify(|b| *b = (*b).min(cand))
                .or_insert(cand);
        }
    }
    best.into_iter()
        .map(|(ip, (_, pod))| (ip, pod.clone()))
        .collect()
}

pub(super) fn pod_key(state: &ClusterState, pod: &PodRef, info: &PodInfo) -> LabelKey {
    let labels = state
        .namespaces
        .get(&*pod.namespace)
        .map(|n| n.labels.clone())
        .unwrap_or_else(|| default_namespace_labels(&pod.namespace));
    LabelKey::of_pod(&pod.namespace, &labels, info)
}

fn identity_label(c: &Compiled, id: u32) -> String {
    match id {
        ANY => "none".to_owned(),
        _ => c
            .maps
            .identities
            .get(&id)
            .map_or_else(|| format!("#{id}"), |n| identity_name_str(n)),
    }
}

fn key_report(c: &Compiled, key: &PolicyKey) -> KeyReport {
    let entry = c.maps.policy.get(key);
    let rule = entry.and_then(|e| c.rules.get(&e.rule_ref)).map(|o| {
        format!(
            "{} {}[{}]",
            o.policy,
            direction::name(o.direction),
            o.rule_index
        )
    });
    KeyReport {
        endpoint_identity: key.endpoint_identity,
        peer_identity: key.peer_identity,
        direction: direction::name(key.direction).to_owned(),
        protocol: protocol_name(key.protocol).to_owned(),
        port: key.port,
        port_prefix_len: key.port_prefix_len,
        present: entry.is_some(),
        rule_ref: entry.map(|e| e.rule_ref),
        rule,
    }
}

pub(super) struct Side {
    pub address: IpAddr,
    pub pod: Option<(PodRef, LabelKey)>,
}

fn describe_port(i: usize, m: &PortMatch, resolved: Option<u16>) -> String {
    match m {
        PortMatch::Protocol(p) => format!("ports[{i}] {} (every port)", protocol_name(*p)),
        PortMatch::Range {
            protocol,
            first,
            last,
        } if first == last => {
            format!("ports[{i}] {} {first}", protocol_name(*protocol))
        }
        PortMatch::Range {
            protocol,
            first,
            last,
        } => format!("ports[{i}] {} {first}-{last}", protocol_name(*protocol)),
        PortMatch::Named { protocol, name } => match resolved {
            Some(n) => format!("ports[{i}] {} {name:?} = {n}", protocol_name(*protocol)),
            None => format!("ports[{i}] {} {name:?}", protocol_name(*protocol)),
        },
    }
}

/// The addresses of label identity `identity` in the compiled ipcache.
fn identity_addresses_of(c: &Compiled, identity: u32) -> Vec<IpAddr> {
    if identity == ANY {
        return Vec::new();
    }
    c.maps
        .ipcache
        .iter()
        .filter(|(n, e)| e.identity == identity && n.prefix_len() == n.max_prefix_len())
        .map(|(n, _)| n.addr())
        .collect()
}

/// The rule-level evaluation of one rule for the flow, at `endpoint`
/// judging traffic with `peer` in `dir` (`port` already 0 for a protocol
/// without ports).
#[allow(clippy::too_many_arguments)]
fn match_rule(
    c: &Compiled,
    rule: &Rule,
    dir: u8,
    endpoint: &LabelKey,
    peer: &Side,
    peer_identity: u32,
    protocol: u8,
    port: u16,
) -> Option<RuleMatch> {
    let field = peer_field(dir);
    let peer_key = peer.pod.as_ref().map(|(_, k)| k);
    let matched = evaluate_peers(rule, peer_key, peer.address);
    if !matched.any() {
        return None;
    }
    let mut peers = Vec::new();
    if matched.all {
        peers.push(format!("{field} absent or empty (every peer)"));
    }
    let list: &[Peer] = match &rule.peers {
        Peers::List(l) => l,
        Peers::All => &[],
    };
    for i in &matched.selectors {
        peers.push(format!("{field}[{i}] selector"));
    }
    for i in &matched.blocks {
        if let Some(Peer::Block(b)) = list.get(*i) {
            peers.push(format!("{field}[{i}] ipBlock {}", b.cidr));
        }
    }
    // Named ports resolve on the destination: the endpoint for ingress,
    // the peer pod for egress when the rule reaches it by name.
    let reached = || {
        evaluate_named_port_reach(
            rule,
            !matched.selectors.is_empty(),
            &identity_addresses_of(c, peer_identity),
        )
    };
    let destination = |m: &PortMatch| match (m, dir) {
        (PortMatch::Named { .. }, direction::INGRESS) => Some(endpoint.clone()),
        (PortMatch::Named { .. }, _) if reached() => peer_key.cloned(),
        _ => None,
    };
    let ports: Vec<String> = match evaluate_ports(&rule.ports, protocol, port, destination) {
        None => vec!["ports absent or empty (every port and protocol)".to_owned()],
        Some(indexes) => {
            let list: &[PortMatch] = match &rule.ports {
                Ports::List(l) => l,
                Ports::All => &[],
            };
            indexes
                .into_iter()
                .filter_map(|i| list.get(i).map(|m| (i, m)))
                .map(|(i, m)| {
                    let resolved = matches!(m, PortMatch::Named { .. }).then_some(port);
                    describe_port(i, m, resolved)
                })
                .collect()
        }
    };
    if ports.is_empty() {
        return None;
    }
    Some(RuleMatch {
        rule_index: rule.index,
        rule_ref: rule.rule_ref,
        peers,
        ports,
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn judge_side(
    state: &ClusterState,
    c: &Compiled,
    model: &Maps,
    parsed: &[ParsedPolicy],
    dir: u8,
    endpoint: &Side,
    peer: &Side,
    protocol: u8,
    port: u16,
) -> Option<DirectionReport> {
    let (pod, key) = endpoint.pod.as_ref()?;
    let ep = c.maps.endpoints.get(pod)?;
    let port = if has_ports(protocol) { port } else { 0 };
    let judged = model.judge(ep, dir, peer.address, protocol, port);
    let mut probed = Vec::new();
    if judged.peer.identity != NODE && ep.judged(dir) {
        // Under tiers every shape is probed; else the first hit ends it.
        let every = ep.tiered(dir);
        for peer_id in Maps::peers_to_probe(ep, dir, judged.peer) {
            for k in Maps::probes_for_peer(ep, dir, peer_id, protocol, port) {
                probed.push(key_report(c, &k));
                if !every && model.policy.contains_key(&k) {
                    break;
                }
            }
            if !every && judged.matched.is_some_and(|m| m.peer_identity == peer_id) {
                break;
            }
        }
    }
    let mut policies = Vec::new();
    let mut any_rule = false;
    let mut isolated = false;
    for p in parsed {
        if !p.isolates(dir) || !p.selects(&pod.namespace, &key.labels) {
            continue;
        }
        isolated = true;
        let matched_rules: Vec<RuleMatch> = p
            .rules_in(dir)
            .filter_map(|r| match_rule(c, r, dir, key, peer, judged.peer.identity, protocol, port))
            .collect();
        any_rule |= !matched_rules.is_empty();
        policies.push(PolicyReport {
            policy: p.name.to_string(),
            valid: p.is_valid(),
            errors: p.errors.iter().map(ToString::to_string).collect(),
            matched_rules,
        });
    }
    // Node traffic: the NetworkPolicy tier allows it; what the pod sends
    // the node still meets the ClusterNetworkPolicy tiers.
    let peer_is_node = state.node_ips.contains(&peer.address);
    let tiers = super::tiers::tier_decision(
        state,
        dir,
        endpoint.pod.as_ref()?,
        peer,
        protocol,
        port,
        isolated.then_some(any_rule || peer_is_node),
    );
    let rules_allowed = (peer_is_node && (dir == direction::INGRESS || tiers.is_none()))
        || match &tiers {
            Some((decision, _)) => decision.allows(),
            None => !isolated || any_rule,
        };
    Some(DirectionReport {
        direction: direction::name(dir).to_owned(),
        endpoint: pod.to_string(),
        endpoint_identity: ep.identity,
        endpoint_identity_name: identity_label(c, ep.identity),
        isolated,
        policies,
        probed,
        matched_key: judged.matched.map(|k| key_report(c, &k)),
        map_reason: judged.reason.name().to_owned(),
        map_allowed: !judged.reason.is_drop(),
        rules_allowed,
        tier: tiers.and_then(|(_, t)| t),
    })
}

pub(super) fn peer_report(
    state: &ClusterState,
    c: &Compiled,
    model: &Maps,
    side: &Side,
) -> PeerReport {
    let e: IpcacheEntry = model.ipcache_lookup(side.address);
    PeerReport {
        address: side.address,
        pod: side.pod.as_ref().map(|(p, _)| p.to_string()),
        node: state.node_ips.contains(&side.address),
        identity: e.identity,
        identity_name: identity_label(c, e.identity),
        cidr_identity: e.cidr_identity,
        cidr_identity_name: identity_label(c, e.cidr_identity),
    }
}
