//! A rule against one flow, one spec sentence per helper (as
//! kube-network-policies' `evaluate*` functions read). `explain` judges a
//! flow with these; the compiler uses the same ones where it decides the
//! same question for a whole identity, so an explanation and the map
//! entries cannot read the spec differently.
use std::net::IpAddr;

use super::{
    parse::{Peers, Rule},
    peer::Peer,
    ports::{PortMatch, Ports},
};
use crate::identity::LabelKey;

/// Which peers of a rule match a peer: by index in `from`/`to`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeersMatch {
    /// `from`/`to` absent or empty: "this rule matches all sources"
    /// (destinations).
    pub all: bool,
    /// Selector peers (podSelector / namespaceSelector) that select the
    /// peer pod.
    pub selectors: Vec<usize>,
    /// ipBlocks that contain the peer address.
    pub blocks: Vec<usize>,
}

impl PeersMatch {
    /// "Traffic is allowed ... if it matches at least one item".
    pub fn any(&self) -> bool {
        self.all || !self.selectors.is_empty() || !self.blocks.is_empty()
    }
}

/// "If this field is empty or missing, this rule matches all sources.
/// If this field is present and contains at least one item, this rule
/// allows traffic only if the traffic matches at least one item in the
/// from list." A selector peer matches a pod (`pod`: its identity key,
/// None for a non-pod address); an ipBlock matches the address.
pub fn evaluate_peers(rule: &Rule, pod: Option<&LabelKey>, address: IpAddr) -> PeersMatch {
    let mut out = PeersMatch::default();
    match &rule.peers {
        Peers::All => out.all = true,
        Peers::List(list) => {
            for (i, peer) in list.iter().enumerate() {
                match peer {
                    Peer::Pods { .. } => {
                        if pod.is_some_and(|k| peer.selects(k)) {
                            out.selectors.push(i);
                        }
                    }
                    Peer::Block(b) => {
                        if b.contains(address) {
                            out.blocks.push(i);
                        }
                    }
                }
            }
        }
    }
    out
}

/// "If this field is empty or missing, this rule matches all ports ...
/// If this field is present and contains at least one item, then this rule
/// allows traffic only if the traffic matches at least one port in the
/// list." Returns the matching entries by index (`None`: ports absent or
/// empty, every port and protocol matches). A named port resolves on
/// `destination` (no destination pod: no match).
pub fn evaluate_ports(
    ports: &Ports,
    protocol: u8,
    port: u16,
    destination: impl Fn(&PortMatch) -> Option<LabelKey>,
) -> Option<Vec<usize>> {
    match ports {
        Ports::All => None,
        Ports::List(list) => Some(
            list.iter()
                .enumerate()
                .filter(|(_, m)| {
                    policy_common::proto::has_ports(protocol)
                        && m.matches(protocol, port, destination(m).as_ref())
                })
                .map(|(i, _)| i)
                .collect(),
        ),
    }
}

/// Named ports "resolve on the destination pod". In egress the
/// destination is the peer; the rule resolves a name on a peer pod it
/// reaches: one its selectors select, any pod when `to` is absent, or a pod
/// all of whose addresses (`addresses`: every address of the peer's
/// identity) lie inside the rule's ipBlocks. A pod inside an ipBlock only
/// in part is not reached by the name (fail closed: the policy map keys a
/// named port by the peer's identity, which would open its other
/// addresses).
pub fn evaluate_named_port_reach<'a>(
    rule: &Rule,
    selector_matched: bool,
    addresses: impl IntoIterator<Item = &'a IpAddr>,
) -> bool {
    selector_matched || matches!(rule.peers, Peers::All) || addresses_inside_blocks(rule, addresses)
}

/// Whether the rule has ipBlocks and every one of `addresses` (at least
/// one) lies inside one of them.
fn addresses_inside_blocks<'a>(
    rule: &Rule,
    addresses: impl IntoIterator<Item = &'a IpAddr>,
) -> bool {
    if rule.blocks().next().is_none() {
        return false;
    }
    let mut any = false;
    for ip in addresses {
        any = true;
        if !rule.blocks().any(|b| b.contains(*ip)) {
            return false;
        }
    }
    any
}
