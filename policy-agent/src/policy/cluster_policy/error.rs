//! Why a ClusterNetworkPolicy could not be enforced as written, and what
//! is enforced instead.
use crate::cluster::{ObjectKind, ObjectRef, Problem, Subject};

/// One problem in one ClusterNetworkPolicy: the policy, the field path
/// (`spec.egress[1].to[0].networks[2]`) and what is wrong there, with what
/// the agent enforces in its place.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("clusternetworkpolicy {policy}: {field}: {kind} ({effect})")]
pub struct ClusterPolicyError {
    pub policy: String,
    pub field: String,
    pub kind: ClusterPolicyErrorKind,
    pub effect: Effect,
}

impl ClusterPolicyError {
    /// The same, as a problem report on the policy's field.
    pub fn problem(&self) -> Problem {
        Problem::new(
            Subject::Field {
                kind: ObjectKind::ClusterNetworkPolicy,
                name: ObjectRef::new("", self.policy.clone()),
                field: self.field.clone(),
            },
            format!("{} ({})", self.kind, self.effect),
        )
    }
}

/// What is wrong with the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClusterPolicyErrorKind {
    #[error("{name:?} is a field this version does not understand")]
    UnknownField { name: String },
    #[error("{0} is required")]
    Missing(&'static str),
    #[error("{value:?} is not Admin or Baseline")]
    UnknownTier { value: String },
    #[error("{value} is outside 0-1000")]
    PriorityOutOfRange { value: i64 },
    #[error("exactly one of namespaces and pods must be set")]
    SubjectNotOne,
    #[error("{problem}")]
    BadSelector { problem: String },
    #[error("{value:?} is not Accept, Deny or Pass")]
    UnknownAction { value: String },
    #[error("must hold at least one peer")]
    NoPeers,
    #[error("exactly one field of a peer must be set")]
    PeerNotOne,
    #[error("{value:?} is not a valid CIDR")]
    BadCidr { value: String },
    #[error("domainNames peers are not supported yet")]
    DomainNamesNotSupported,
    #[error("exactly one of tcp, udp, sctp and destinationNamedPort must be set")]
    ProtocolNotOne,
    #[error("exactly one of number and range must be set")]
    PortNotOne,
    #[error("{value} is outside 1-65535")]
    PortOutOfRange { value: i64 },
    #[error("start {start} is not below end {end}")]
    RangeNotIncreasing { start: i64, end: i64 },
    #[error("{value:?} is not a valid port name")]
    BadPortName { value: String },
    #[error("a named port needs pod peers: networks and nodes have no named ports")]
    NamedPortWithoutPods,
    #[error("{count} items, more than the {max} the API allows")]
    TooMany { count: usize, max: usize },
    #[error("{len} characters, more than the 100 the API allows")]
    NameTooLong { len: usize },
}

/// What the agent enforces instead of the field as written. The API's
/// rule: "For "Accept" rules, "fail closed" means: "treat the rule as
/// matching no traffic". For "Deny" and "Pass" rules, "fail closed" means:
/// "treat the rule as a 'Deny all' rule"."
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Reported only: enforcement does not depend on the field.
    ReportedOnly,
    /// An Accept rule that matches nothing.
    RuleMatchesNothing,
    /// A Deny or Pass rule enforced as a Deny of everything.
    RuleDeniesAll,
    /// The policy as a whole is not understood (tier, priority, subject,
    /// bounds): its Accept rules match nothing, its Pass rules deny what
    /// they match, its Deny rules stay; an unreadable subject is every
    /// pod, an unreadable tier is Admin, an unreadable priority is 0.
    PolicyFailsClosed,
}

impl std::fmt::Display for Effect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::ReportedOnly => "reported only",
            Self::RuleMatchesNothing => "the Accept rule matches nothing",
            Self::RuleDeniesAll => "the rule denies everything",
            Self::PolicyFailsClosed => "the policy fails closed",
        })
    }
}
