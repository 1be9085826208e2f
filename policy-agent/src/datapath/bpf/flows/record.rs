//! A flow record with names: what `policy-agent flows --json` prints, the
//! flow log writes and the subscribers' socket carries.
use std::fmt;

use serde::{Deserialize, Serialize};

/// One new flow judged by policy, or one dropped packet, named.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flow {
    /// RFC 3339, UTC.
    pub time: String,
    /// "ingress" or "egress", of `pod`.
    pub direction: String,
    /// The local pod ("namespace/name").
    pub pod: String,
    pub peer: Peer,
    /// The peer's label identity as `dump` names it (None: the peer has
    /// none, only an address class).
    pub peer_identity: Option<String>,
    /// "TCP", "UDP", "SCTP", "ICMP", "ICMPv6", or the protocol number.
    pub protocol: String,
    /// The destination port (None for protocols without ports).
    pub port: Option<u16>,
    pub verdict: Verdict,
    /// `Reason::name()`.
    pub reason: String,
    /// The rules or policies that decided it (see [`super::naming`]).
    pub policies: Vec<PolicyRef>,
    /// What the staged policies would decide instead (None: no staged
    /// verdict, or the same one).
    pub staged: Option<Staged>,
}

/// The other end: its address, and the local pod holding it if one does
/// (`{"pod": "ns/name", "ip": "..."}` or `{"ip": "..."}`). The address is
/// always there: a rule may admit one family of a pod and not the other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    pub ip: String,
}

impl Peer {
    pub fn pod(pod: impl Into<String>, ip: impl Into<String>) -> Self {
        Self {
            pod: Some(pod.into()),
            ip: ip.into(),
        }
    }

    pub fn ip(ip: impl Into<String>) -> Self {
        Self {
            pod: None,
            ip: ip.into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Drop,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Drop => "drop",
        }
    }
}

/// A policy, or one rule of it, that decided a flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRef {
    /// "NetworkPolicy" or "ClusterNetworkPolicy".
    pub kind: String,
    /// None for a ClusterNetworkPolicy.
    pub namespace: Option<String>,
    /// The policy's name; "unknown rule 0x…" when no name was ever seen.
    pub name: String,
    /// The rule's index in its policy's list (None: the whole policy, as
    /// for the policies isolating a pod).
    pub rule: Option<u32>,
    /// The rule's `name`, when it has one.
    pub rule_name: Option<String>,
    /// "Admin" or "Baseline" for a ClusterNetworkPolicy.
    pub tier: Option<String>,
    /// A ClusterNetworkPolicy's priority.
    pub priority: Option<u32>,
}

pub const NETWORK_POLICY: &str = "NetworkPolicy";
pub const CLUSTER_NETWORK_POLICY: &str = "ClusterNetworkPolicy";

impl PolicyRef {
    /// Whether this is the policy `[namespace/]name` (any namespace when
    /// none is given).
    pub fn is(&self, namespace: Option<&str>, name: &str) -> bool {
        self.name == name && namespace.is_none_or(|ns| self.namespace.as_deref() == Some(ns))
    }

    /// Whether no name was known for it.
    pub fn is_unknown(&self) -> bool {
        self.name.starts_with("unknown ")
    }
}

impl fmt::Display for PolicyRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(tier) = &self.tier {
            write!(f, "{tier}:")?;
        }
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name)?,
            None => write!(f, "{}", self.name)?,
        }
        match (self.rule, &self.rule_name) {
            (Some(i), Some(n)) => write!(f, "[{i} {n:?}]"),
            (Some(i), None) => write!(f, "[{i}]"),
            (None, Some(n)) => write!(f, " ({n})"),
            (None, None) => Ok(()),
        }
    }
}

/// The verdict the staged policies would give.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staged {
    pub verdict: Verdict,
    pub reason: String,
    pub policies: Vec<PolicyRef>,
}

impl Flow {
    /// Whether `[namespace/]name` decided it, or would under staging.
    pub fn names_policy(&self, namespace: Option<&str>, name: &str) -> bool {
        let staged = self.staged.iter().flat_map(|s| s.policies.iter());
        self.policies
            .iter()
            .chain(staged)
            .any(|p| p.is(namespace, name))
    }

    /// The peer pod, if the peer is one.
    pub fn peer_pod(&self) -> Option<&str> {
        self.peer.pod.as_deref()
    }
}

fn write_policies(f: &mut fmt::Formatter<'_>, policies: &[PolicyRef]) -> fmt::Result {
    if policies.is_empty() {
        return write!(f, "-");
    }
    for (i, p) in policies.iter().enumerate() {
        if i > 0 {
            write!(f, ",")?;
        }
        write!(f, "{p}")?;
    }
    Ok(())
}

/// `time direction pod peer protocol/port verdict reason policies`.
impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peer = self.peer.pod.as_ref().unwrap_or(&self.peer.ip);
        write!(
            f,
            "{} {} {} {peer} {}",
            self.time, self.direction, self.pod, self.protocol
        )?;
        if let Some(port) = self.port {
            write!(f, "/{port}")?;
        }
        write!(f, " {} {} ", self.verdict.name(), self.reason)?;
        write_policies(f, &self.policies)?;
        if let Some(s) = &self.staged {
            write!(f, " staged {} {} ", s.verdict.name(), s.reason)?;
            write_policies(f, &s.policies)?;
        }
        Ok(())
    }
}

/// What the subscribers' socket carries: the flow, and the packet detail
/// `policy-agent events` prints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowEvent {
    #[serde(flatten)]
    pub flow: Flow,
    /// "address:port" of the packet's source and destination.
    pub src: String,
    pub dst: String,
    /// The peer's address class, named.
    pub peer_class: String,
}
