//! A NetworkPolicy validated into the compiler's terms.
//!
//! Fail closed: a policy with any error keeps isolating the pods it selects
//! in the directions it declares, but contributes no allow rule at all
//! (dropping the whole policy rather than the one bad rule or peer keeps the
//! author's intent from being half-applied). If its podSelector itself is
//! invalid, every pod of its namespace counts as selected.
use std::collections::BTreeSet;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use policy_common::direction;

use super::{
    error::{PolicyError, PolicyErrorKind},
    peer::{IpBlock, Peer, parse_peer},
    ports::{PortMatch, Ports, parse_port},
    selector::Selector,
};
use crate::{
    cluster::{Labels, PolicyRef},
    identity::LabelKey,
};

/// The peers of one rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peers {
    /// `from`/`to` absent or empty: "If this field is empty or missing,
    /// this rule matches all sources" (destinations), the node and the
    /// world included. The API server drops empty lists, so in cluster mode
    /// `from: []` arrives as absent; manifests mean the same.
    All,
    /// Present with at least one item: "this rule allows traffic only if
    /// the traffic matches at least one item in the from list".
    List(Vec<Peer>),
}

/// One validated ingress or egress rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// [`policy_common::direction`].
    pub direction: u8,
    /// Position in `spec.ingress` / `spec.egress`.
    pub index: usize,
    /// Stable id of (policy, direction, index), see [`rule_ref`].
    pub rule_ref: u32,
    pub peers: Peers,
    pub ports: Ports,
}

impl Rule {
    /// The selector peers (podSelector / namespaceSelector).
    pub fn selector_peers(&self) -> impl Iterator<Item = &Peer> {
        self.peer_list().filter(|p| matches!(p, Peer::Pods { .. }))
    }

    pub fn blocks(&self) -> impl Iterator<Item = &IpBlock> {
        self.peer_list().filter_map(|p| match p {
            Peer::Block(b) => Some(b),
            Peer::Pods { .. } => None,
        })
    }

    fn peer_list(&self) -> impl Iterator<Item = &Peer> {
        match &self.peers {
            Peers::All => [].iter(),
            Peers::List(l) => l.iter(),
        }
    }

    pub fn has_named_ports(&self) -> bool {
        matches!(&self.ports, Ports::List(l) if l.iter().any(|p| matches!(p, PortMatch::Named { .. })))
    }

    /// Whether some selector peer selects pods with `key`.
    pub fn selects_pod(&self, key: &LabelKey) -> bool {
        self.selector_peers().any(|p| p.selects(key))
    }
}

/// A NetworkPolicy in the compiler's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedPolicy {
    pub name: PolicyRef,
    /// `None` when the podSelector is invalid: then every pod of the
    /// namespace is selected (fail closed).
    pub pod_selector: Option<Selector>,
    /// Isolates the selected pods for ingress.
    pub ingress: bool,
    /// Isolates the selected pods for egress.
    pub egress: bool,
    /// Rules of the isolated directions; empty when there is any error.
    pub rules: Vec<Rule>,
    pub errors: Vec<PolicyError>,
}

/// FNV-1a, 32 bit: stable across runs, builds and unrelated policies.
fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The peer list field of a rule in `dir`: `from` (ingress), `to` (egress).
pub fn peer_field(dir: u8) -> &'static str {
    if dir == direction::INGRESS {
        "from"
    } else {
        "to"
    }
}

/// The stable 32-bit id written in `PolicyEntry::rule_ref`: FNV-1a of
/// `namespace/name/ingress|egress/index`.
pub fn rule_ref(policy: &PolicyRef, dir: u8, index: usize) -> u32 {
    fnv1a32(
        format!(
            "{}/{}/{}/{}",
            policy.namespace,
            policy.name,
            direction::name(dir),
            index
        )
        .as_bytes(),
    )
}

fn parse_rule(
    policy: &PolicyRef,
    dir: u8,
    index: usize,
    peers: Option<&Vec<NetworkPolicyPeer>>,
    ports: Option<&Vec<NetworkPolicyPort>>,
    errors: &mut Vec<PolicyError>,
) -> Rule {
    let field = format!("spec.{}[{index}]", direction::name(dir));
    let peer_field = peer_field(dir);
    let peers = match peers {
        // "empty or missing": the same, as for ports below.
        None => Peers::All,
        Some(list) if list.is_empty() => Peers::All,
        Some(list) => Peers::List(
            list.iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    parse_peer(policy, &format!("{field}.{peer_field}[{i}]"), p)
                        .map_err(|e| errors.push(e))
                        .ok()
                })
                .collect(),
        ),
    };
    let ports = match ports {
        None => Ports::All,
        Some(list) if list.is_empty() => Ports::All,
        Some(list) => Ports::List(
            list.iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    parse_port(policy, &format!("{field}.ports[{i}]"), p)
                        .map_err(|e| errors.push(e))
                        .ok()
                })
                .collect(),
        ),
    };
    Rule {
        direction: dir,
        index,
        rule_ref: rule_ref(policy, dir, index),
        peers,
        ports,
    }
}

impl ParsedPolicy {
    /// Validates `np`, stored under `name` (its namespace is the policy's).
    pub fn parse(name: &PolicyRef, np: &NetworkPolicy) -> Self {
        let default;
        let spec = match np.spec.as_ref() {
            Some(s) => s,
            None => {
                default = NetworkPolicySpec::default();
                &default
            }
        };
        let mut errors = Vec::new();

        // "An empty podSelector selects all pods in this namespace."
        let pod_selector = match &spec.pod_selector {
            None => Some(Selector::everything()),
            Some(sel) => match Selector::parse(sel) {
                Ok(s) => Some(s),
                Err((sub, problem)) => {
                    errors.push(PolicyError::new(
                        name,
                        format!("spec.podSelector.{sub}"),
                        PolicyErrorKind::BadSelector { problem },
                    ));
                    None
                }
            },
        };

        // "If this field is not specified, it will default based on the
        // existence of ingress or egress rules; policies that contain an
        // egress section are assumed to affect egress, and all policies
        // (whether or not they contain an ingress section) are assumed to
        // affect ingress." An egress section means a non-empty list; an
        // empty policyTypes list is defaulted the same way.
        let has_egress = spec.egress.as_ref().is_some_and(|e| !e.is_empty());
        let (mut ingress, mut egress) = (true, has_egress);
        if let Some(types) = spec.policy_types.as_ref().filter(|t| !t.is_empty()) {
            (ingress, egress) = (false, false);
            for (i, t) in types.iter().enumerate() {
                match t.as_str() {
                    "Ingress" => ingress = true,
                    "Egress" => egress = true,
                    other => {
                        errors.push(PolicyError::new(
                            name,
                            format!("spec.policyTypes[{i}]"),
                            PolicyErrorKind::BadPolicyType {
                                value: other.to_owned(),
                            },
                        ));
                    }
                }
            }
            if errors
                .iter()
                .any(|e| matches!(e.kind, PolicyErrorKind::BadPolicyType { .. }))
            {
                // Unknown intent: isolate both ways.
                (ingress, egress) = (true, true);
            }
        }

        // Every rule is validated, also those of a direction the policy does
        // not isolate (the API server validates them all); only the rules of
        // isolated directions are kept.
        let mut rules = Vec::new();
        for (i, r) in spec.ingress.iter().flatten().enumerate() {
            let rule = parse_rule(
                name,
                direction::INGRESS,
                i,
                r.from.as_ref(),
                r.ports.as_ref(),
                &mut errors,
            );
            if ingress {
                rules.push(rule);
            }
        }
        for (i, r) in spec.egress.iter().flatten().enumerate() {
            let rule = parse_rule(
                name,
                direction::EGRESS,
                i,
                r.to.as_ref(),
                r.ports.as_ref(),
                &mut errors,
            );
            if egress {
                rules.push(rule);
            }
        }
        if !errors.is_empty() {
            rules.clear();
        }
        Self {
            name: name.clone(),
            pod_selector,
            ingress,
            egress,
            rules,
            errors,
        }
    }

    pub fn is_valid(&self) -> bool {
        self.errors.is_empty()
    }

    /// Whether the policy isolates its selected pods in `dir`.
    pub fn isolates(&self, dir: u8) -> bool {
        if dir == direction::INGRESS {
            self.ingress
        } else {
            self.egress
        }
    }

    /// "Selects the pods to which this NetworkPolicy object applies ... in
    /// the policy's namespace" (all of them if the selector is invalid).
    pub fn selects(&self, namespace: &str, labels: &Labels) -> bool {
        namespace == &*self.name.namespace
            && self.pod_selector.as_ref().is_none_or(|s| s.matches(labels))
    }

    /// The prefixes the policy's ipBlocks carve out.
    pub fn prefixes(&self) -> BTreeSet<IpNet> {
        self.rules
            .iter()
            .flat_map(|r| r.blocks())
            .flat_map(IpBlock::prefixes)
            .collect()
    }

    pub fn rules_in(&self, dir: u8) -> impl Iterator<Item = &Rule> {
        self.rules.iter().filter(move |r| r.direction == dir)
    }
}
