//! `NetworkPolicyPeer`: selectors or an ipBlock.
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{IPBlock, NetworkPolicyPeer};

use super::{
    error::{PolicyError, PolicyErrorKind},
    selector::Selector,
};
use crate::{cluster::PolicyRef, identity::LabelKey};

/// Which namespaces a selector peer looks in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Namespaces {
    /// namespaceSelector absent: "the policy's own namespace".
    Own(String),
    /// "Selects namespaces using cluster-scoped labels."
    Matching(Selector),
}

/// A validated `ipBlock`: prefixes normalized (host bits cleared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpBlock {
    pub cidr: IpNet,
    pub except: Vec<IpNet>,
}

impl IpBlock {
    /// "IPBlock describes a particular CIDR ... that is allowed ... Except is
    /// a slice of CIDRs that should not be included within an IPBlock."
    /// A v4 block never contains a v6 address and vice versa.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidr.contains(&ip) && !self.except.iter().any(|e| e.contains(&ip))
    }

    /// Every prefix this block carves out of the address space.
    pub fn prefixes(&self) -> impl Iterator<Item = IpNet> + '_ {
        std::iter::once(self.cidr).chain(self.except.iter().copied())
    }
}

/// One validated peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// podSelector and/or namespaceSelector. "If namespaceSelector is also
    /// set, then the NetworkPolicyPeer as a whole selects the pods matching
    /// podSelector in the Namespaces selected by NamespaceSelector.
    /// Otherwise it selects the pods matching podSelector in the policy's
    /// own namespace." podSelector absent with a namespaceSelector: "all
    /// pods in the namespaces selected by namespaceSelector".
    Pods {
        namespaces: Namespaces,
        pods: Selector,
    },
    Block(IpBlock),
}

impl Peer {
    /// Whether a pod with `key` is selected by this (selector) peer.
    pub fn selects(&self, key: &LabelKey) -> bool {
        match self {
            Self::Pods { namespaces, pods } => {
                let ns_ok = match namespaces {
                    Namespaces::Own(ns) => *key.namespace == **ns,
                    Namespaces::Matching(sel) => sel.matches(&key.namespace_labels),
                };
                ns_ok && pods.matches(&key.labels)
            }
            Self::Block(_) => false,
        }
    }
}

/// Parses a CIDR, normalizing host bits: the API accepts `10.1.2.3/8` and
/// means `10.0.0.0/8`.
pub fn parse_cidr(s: &str) -> Option<IpNet> {
    s.trim().parse::<IpNet>().ok().map(|n| n.trunc())
}

fn parse_block(policy: &PolicyRef, field: &str, b: &IPBlock) -> Result<IpBlock, PolicyError> {
    let cidr = parse_cidr(&b.cidr).ok_or_else(|| {
        PolicyError::new(
            policy,
            format!("{field}.cidr"),
            PolicyErrorKind::BadCidr {
                value: b.cidr.clone(),
            },
        )
    })?;
    let mut except = Vec::new();
    for (i, raw) in b.except.iter().flatten().enumerate() {
        let f = format!("{field}.except[{i}]");
        let e = parse_cidr(raw).ok_or_else(|| {
            PolicyError::new(
                policy,
                f.clone(),
                PolicyErrorKind::BadCidr { value: raw.clone() },
            )
        })?;
        // "Except values will be rejected if they are outside the cidr
        // range": each must be a strict subset of cidr.
        if !(cidr.contains(&e) && e.prefix_len() > cidr.prefix_len()) {
            return Err(PolicyError::new(
                policy,
                f,
                PolicyErrorKind::ExceptOutsideCidr {
                    except: raw.clone(),
                    cidr: b.cidr.clone(),
                },
            ));
        }
        except.push(e);
    }
    except.sort();
    except.dedup();
    Ok(IpBlock { cidr, except })
}

/// Validates one peer at `field` (`spec.ingress[0].from[1]`).
pub fn parse_peer(
    policy: &PolicyRef,
    field: &str,
    p: &NetworkPolicyPeer,
) -> Result<Peer, PolicyError> {
    let selector = |sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
                    name: &str| {
        Selector::parse(sel).map_err(|(sub, problem)| {
            PolicyError::new(
                policy,
                format!("{field}.{name}.{sub}"),
                PolicyErrorKind::BadSelector { problem },
            )
        })
    };
    match (&p.ip_block, &p.pod_selector, &p.namespace_selector) {
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => Err(PolicyError::new(
            policy,
            field,
            PolicyErrorKind::IpBlockWithSelector,
        )),
        (Some(b), None, None) => Ok(Peer::Block(parse_block(
            policy,
            &format!("{field}.ipBlock"),
            b,
        )?)),
        (None, None, None) => Err(PolicyError::new(policy, field, PolicyErrorKind::EmptyPeer)),
        (None, pods, namespaces) => {
            let pods = match pods {
                Some(s) => selector(s, "podSelector")?,
                None => Selector::everything(),
            };
            let namespaces = match namespaces {
                Some(s) => Namespaces::Matching(selector(s, "namespaceSelector")?),
                None => Namespaces::Own(policy.namespace.to_string()),
            };
            Ok(Peer::Pods { namespaces, pods })
        }
    }
}
