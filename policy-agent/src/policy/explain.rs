//! Why a flow is allowed or dropped.
//!
//! Two answers, which must agree (the tests check they do):
//! - the map verdict: [`policy_common::model::Maps::judge`] over the
//!   compiled content, exactly what the kernel would do, with the keys it
//!   probed and the one that matched;
//! - the rule verdict: the policies read directly, naming the policies
//!   that select each endpoint and the rules, peers and ports that match.
//!
//! Egress is judged at the source if it is a local endpoint, ingress at the
//! destination if it is one; a flow passes if both pass. For a whole-cluster
//! view compile with [`super::CompileOptions::all_pods_local`].
use std::{
    cmp::Reverse,
    collections::BTreeMap,
    fmt::{self, Write as _},
    net::IpAddr,
};

use policy_common::{
    direction,
    identity::{ANY, NODE},
    ipcache::IpcacheEntry,
    model::{Maps, has_ports},
    policy::PolicyKey,
};
use serde::Serialize;

use super::{
    Compiled,
    parse::{ParsedPolicy, Peers, Rule, peer_field},
    peer::Peer,
    ports::{PortMatch, Ports},
};
use crate::{
    cluster::{ClusterState, PodInfo, PodRef},
    identity::{LabelKey, default_namespace_labels, protocol_name},
    mapstate::identity_name_str,
};

/// One end of a flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlowEnd {
    Pod(PodRef),
    Ip(IpAddr),
}

/// A flow to explain: `protocol` is an IP protocol number, `port` the
/// destination port (ignored for protocols without ports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExplainQuery {
    pub src: FlowEnd,
    pub dst: FlowEnd,
    pub protocol: u8,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExplainError {
    #[error("pod {0} is not in the cluster state")]
    UnknownPod(PodRef),
    #[error(
        "pod {0} holds no IP address (pending, terminal, hostNetwork or its address taken by a newer pod)"
    )]
    NoAddress(PodRef),
    #[error("{src} and {dst} have no address family in common")]
    FamilyMismatch { src: String, dst: String },
}

/// What one end of the flow is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerReport {
    pub address: IpAddr,
    /// "namespace/name" of the pod holding the address.
    pub pod: Option<String>,
    pub node: bool,
    /// The ipcache entry of the address.
    pub identity: u32,
    pub identity_name: String,
    pub cidr_identity: u32,
    pub cidr_identity_name: String,
}

/// One policy key, as probed or matched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyReport {
    pub endpoint_identity: u32,
    pub peer_identity: u32,
    pub direction: String,
    pub protocol: String,
    pub port: u16,
    pub port_prefix_len: u8,
    /// Whether the key is in the policy map.
    pub present: bool,
    pub rule_ref: Option<u32>,
    /// "namespace/name ingress[0]" of the rule behind the entry.
    pub rule: Option<String>,
}

/// A rule that matches the flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleMatch {
    pub rule_index: usize,
    pub rule_ref: u32,
    /// Which peers matched, e.g. `from[1] podSelector` or `from absent`.
    pub peers: Vec<String>,
    /// Which ports matched, e.g. `ports[0] TCP 8000-8080`.
    pub ports: Vec<String>,
}

/// A policy that selects the endpoint in the direction judged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    pub valid: bool,
    pub errors: Vec<String>,
    pub matched_rules: Vec<RuleMatch>,
}

/// The judgement at one local endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DirectionReport {
    pub direction: String,
    pub endpoint: String,
    pub endpoint_identity: u32,
    pub endpoint_identity_name: String,
    pub isolated: bool,
    /// Policies selecting the endpoint that isolate this direction.
    pub policies: Vec<PolicyReport>,
    /// Keys probed, in the kernel's order.
    pub probed: Vec<KeyReport>,
    pub matched_key: Option<KeyReport>,
    /// [`Reason::name`] of the map verdict.
    pub map_reason: String,
    pub map_allowed: bool,
    pub rules_allowed: bool,
}

/// The explanation of one flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub src: PeerReport,
    pub dst: PeerReport,
    pub protocol: String,
    pub port: u16,
    pub allowed: bool,
    /// Judged at the source (its egress), if it is a local endpoint.
    pub egress: Option<DirectionReport>,
    /// Judged at the destination (its ingress), if it is a local endpoint.
    pub ingress: Option<DirectionReport>,
    pub notes: Vec<String>,
}

impl Explanation {
    /// Whether the map verdicts and the rule verdicts agree everywhere.
    pub fn consistent(&self) -> bool {
        [&self.egress, &self.ingress]
            .into_iter()
            .flatten()
            .all(|d| d.map_allowed == d.rules_allowed)
    }
}

/// Addresses held by live pods (the compiler's rule: not terminal, not
/// hostNetwork, not a node address; the newest pod, then the first name).
fn holders(state: &ClusterState) -> BTreeMap<IpAddr, PodRef> {
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

fn pod_key(state: &ClusterState, pod: &PodRef, info: &PodInfo) -> LabelKey {
    let labels = state
        .namespaces
        .get(&pod.namespace)
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
            .map_or_else(|| format!("#{id}"), identity_name_str),
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

struct Side {
    address: IpAddr,
    pod: Option<(PodRef, LabelKey)>,
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

/// Whether every address of `peer`'s identity lies inside the rule's
/// ipBlocks (the condition under which egress named ports apply to a pod
/// reached through an ipBlock only; see the compiler).
fn identity_inside_blocks(c: &Compiled, rule: &Rule, identity: u32) -> bool {
    identity != ANY
        && rule.blocks().next().is_some()
        && c.maps
            .ipcache
            .iter()
            .filter(|(n, e)| e.identity == identity && n.prefix_len() == n.max_prefix_len())
            .all(|(n, _)| rule.blocks().any(|b| b.contains(n.addr())))
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
    let peer_field = peer_field(dir);
    let mut peers = Vec::new();
    let mut selector_matched = false;
    match &rule.peers {
        Peers::All => peers.push(format!("{peer_field} absent (every peer)")),
        Peers::List(list) => {
            for (i, p) in list.iter().enumerate() {
                match p {
                    Peer::Pods { .. } => {
                        if peer.pod.as_ref().is_some_and(|(_, k)| p.selects(k)) {
                            selector_matched = true;
                            peers.push(format!("{peer_field}[{i}] selector"));
                        }
                    }
                    Peer::Block(b) => {
                        if b.contains(peer.address) {
                            peers.push(format!("{peer_field}[{i}] ipBlock {}", b.cidr));
                        }
                    }
                }
            }
        }
    }
    if peers.is_empty() {
        return None;
    }
    let mut ports = Vec::new();
    match &rule.ports {
        Ports::All => ports.push("ports absent or empty (every port and protocol)".to_owned()),
        Ports::List(list) => {
            for (i, m) in list.iter().enumerate() {
                let destination = match (m, dir) {
                    (PortMatch::Named { .. }, direction::INGRESS) => Some(endpoint),
                    (PortMatch::Named { .. }, _) => {
                        let reached = matches!(rule.peers, Peers::All)
                            || selector_matched
                            || identity_inside_blocks(c, rule, peer_identity);
                        peer.pod.as_ref().filter(|_| reached).map(|(_, k)| k)
                    }
                    _ => None,
                };
                if has_ports(protocol) && m.matches(protocol, port, destination) {
                    let resolved = matches!(m, PortMatch::Named { .. }).then_some(port);
                    ports.push(describe_port(i, m, resolved));
                }
            }
        }
    }
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
fn judge_side(
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
    if judged.peer.identity != NODE && ep.isolated(dir) {
        for peer_id in Maps::peers_to_probe(ep, dir, judged.peer) {
            for k in Maps::probes_for_peer(ep, dir, peer_id, protocol, port) {
                probed.push(key_report(c, &k));
                if model.policy.contains_key(&k) {
                    break;
                }
            }
            if judged.matched.is_some_and(|m| m.peer_identity == peer_id) {
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
    let peer_is_node = state.node_ips.contains(&peer.address);
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
        rules_allowed: peer_is_node || !isolated || any_rule,
    })
}

fn peer_report(state: &ClusterState, c: &Compiled, model: &Maps, side: &Side) -> PeerReport {
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

/// Explains the flow `q` in `state`, compiled as `compiled`.
pub fn explain(
    state: &ClusterState,
    compiled: &Compiled,
    q: &ExplainQuery,
) -> Result<Explanation, ExplainError> {
    let held = holders(state);
    let addresses = |end: &FlowEnd| -> Result<Vec<IpAddr>, ExplainError> {
        match end {
            FlowEnd::Ip(ip) => Ok(vec![*ip]),
            FlowEnd::Pod(p) => {
                if !state.pods.contains_key(p) {
                    return Err(ExplainError::UnknownPod(p.clone()));
                }
                let ips: Vec<IpAddr> = held
                    .iter()
                    .filter(|(_, h)| *h == p)
                    .map(|(ip, _)| *ip)
                    .collect();
                if ips.is_empty() {
                    Err(ExplainError::NoAddress(p.clone()))
                } else {
                    Ok(ips)
                }
            }
        }
    };
    let (src_ips, dst_ips) = (addresses(&q.src)?, addresses(&q.dst)?);
    let pair = src_ips
        .iter()
        .find_map(|s| {
            dst_ips
                .iter()
                .find(|d| d.is_ipv4() == s.is_ipv4())
                .map(|d| (*s, *d))
        })
        .ok_or_else(|| ExplainError::FamilyMismatch {
            src: format!("{:?}", q.src),
            dst: format!("{:?}", q.dst),
        })?;
    let side = |address: IpAddr| Side {
        address,
        pod: held
            .get(&address)
            .and_then(|p| state.pods.get(p).map(|i| (p.clone(), pod_key(state, p, i)))),
    };
    let (src, dst) = (side(pair.0), side(pair.1));
    let mut model = compiled.maps.to_model(|_| 0);
    model.endpoints.clear();
    let parsed: Vec<ParsedPolicy> = state
        .policies
        .iter()
        .map(|(n, p)| ParsedPolicy::parse(n, p))
        .collect();

    let mut notes = Vec::new();
    let (egress, ingress) = if src.address == dst.address {
        notes.push(
            "source and destination are the same address: a pod may always talk to itself"
                .to_owned(),
        );
        (None, None)
    } else {
        (
            judge_side(
                state,
                compiled,
                &model,
                &parsed,
                direction::EGRESS,
                &src,
                &dst,
                q.protocol,
                q.port,
            ),
            judge_side(
                state,
                compiled,
                &model,
                &parsed,
                direction::INGRESS,
                &dst,
                &src,
                q.protocol,
                q.port,
            ),
        )
    };
    for (end, report, dir) in [(&src, &egress, "egress"), (&dst, &ingress, "ingress")] {
        if report.is_none() && src.address != dst.address {
            let who = end
                .pod
                .as_ref()
                .map_or_else(|| end.address.to_string(), |(p, _)| p.to_string());
            notes.push(format!(
                "{who} is not a local endpoint: its {dir} is not judged on this node"
            ));
        }
    }
    let allowed = [&egress, &ingress]
        .into_iter()
        .flatten()
        .all(|d| d.map_allowed);
    let mut out = Explanation {
        src: peer_report(state, compiled, &model, &src),
        dst: peer_report(state, compiled, &model, &dst),
        protocol: protocol_name(q.protocol).to_owned(),
        port: q.port,
        allowed,
        egress,
        ingress,
        notes,
    };
    if !out.consistent() {
        out.notes
            .push("map verdict and rule verdict disagree: this is a compiler bug".to_owned());
    }
    Ok(out)
}

fn write_side(f: &mut String, label: &str, p: &PeerReport) {
    let who = p.pod.clone().unwrap_or_else(|| {
        if p.node {
            "node".to_owned()
        } else {
            "external".to_owned()
        }
    });
    let _ = writeln!(
        f,
        "  {label}: {who} {} (identity {} {}, class {} {})",
        p.address, p.identity, p.identity_name, p.cidr_identity, p.cidr_identity_name
    );
}

fn write_key(f: &mut String, k: &KeyReport) {
    let _ = write!(
        f,
        "{{endpoint {}, peer {}, {}, {} {}/{}}}",
        k.endpoint_identity, k.peer_identity, k.direction, k.protocol, k.port, k.port_prefix_len
    );
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        let verdict = if self.allowed {
            "ALLOWED".to_owned()
        } else {
            let at: Vec<String> = [&self.egress, &self.ingress]
                .into_iter()
                .flatten()
                .filter(|d| !d.map_allowed)
                .map(|d| format!("{} of {}", d.direction, d.endpoint))
                .collect();
            format!("DROPPED at {}", at.join(" and "))
        };
        let _ = writeln!(s, "flow {} port {}: {verdict}", self.protocol, self.port);
        write_side(&mut s, "src", &self.src);
        write_side(&mut s, "dst", &self.dst);
        for d in [&self.egress, &self.ingress].into_iter().flatten() {
            let _ = writeln!(
                s,
                "{} at {} (identity {} {}): {}",
                d.direction,
                d.endpoint,
                d.endpoint_identity,
                d.endpoint_identity_name,
                if d.isolated {
                    "isolated"
                } else {
                    "not isolated"
                }
            );
            for p in &d.policies {
                let _ = writeln!(
                    s,
                    "  policy {}{}",
                    p.policy,
                    if p.valid {
                        ""
                    } else {
                        " (INVALID: allows nothing)"
                    }
                );
                for e in &p.errors {
                    let _ = writeln!(s, "    error: {e}");
                }
                if p.matched_rules.is_empty() {
                    let _ = writeln!(s, "    no rule matches");
                }
                for r in &p.matched_rules {
                    let _ = writeln!(
                        s,
                        "    rule {}[{}] matches: peers {}; ports {}",
                        d.direction,
                        r.rule_index,
                        r.peers.join(", "),
                        r.ports.join(", ")
                    );
                }
            }
            for k in &d.probed {
                s.push_str("  probe ");
                write_key(&mut s, k);
                let _ = writeln!(s, "{}", if k.present { " present" } else { "" });
            }
            let _ = write!(s, "  map verdict: {}", d.map_reason);
            if let Some(k) = &d.matched_key {
                s.push_str(" via ");
                write_key(&mut s, k);
                if let Some(r) = &k.rule {
                    let _ = write!(s, " from {r}");
                }
            }
            let _ = writeln!(
                s,
                "; rules {}",
                if d.rules_allowed { "allow" } else { "deny" }
            );
        }
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        f.write_str(s.trim_end())
    }
}
