//! Why a policy could not be compiled as written.
use crate::cluster::{ObjectKind, PolicyRef, Problem, Subject};

/// One problem in one NetworkPolicy: the policy, the field path
/// (`spec.ingress[0].ports[1].endPort`, as `kubectl explain` spells it)
/// and what is wrong there.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("networkpolicy {policy}: {field}: {kind}")]
pub struct PolicyError {
    pub policy: PolicyRef,
    pub field: String,
    pub kind: PolicyErrorKind,
}

/// What is wrong with the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyErrorKind {
    #[error("{value:?} is not a valid CIDR")]
    BadCidr { value: String },
    #[error("{except} is not a strict subset of cidr {cidr}")]
    ExceptOutsideCidr { except: String, cidr: String },
    #[error("ipBlock cannot be combined with podSelector or namespaceSelector in one peer")]
    IpBlockWithSelector,
    #[error("a peer must set podSelector, namespaceSelector or ipBlock")]
    EmptyPeer,
    #[error("{value:?} is not TCP, UDP or SCTP")]
    UnknownProtocol { value: String },
    #[error("{value} is outside 1-65535")]
    PortOutOfRange { value: i64 },
    #[error("{value:?} is not a valid port name (IANA_SVC_NAME)")]
    BadPortName { value: String },
    #[error("endPort requires a numeric port")]
    EndPortWithoutNumericPort,
    #[error("{end_port} is below port {port}")]
    EndPortBelowPort { port: i32, end_port: i32 },
    #[error("{problem}")]
    BadSelector { problem: String },
    #[error("{value:?} is not Ingress or Egress")]
    BadPolicyType { value: String },
    /// Valid, but past a budget of compiled state: it fails closed too.
    #[error("{0}")]
    Refused(super::compiler::Refusal),
}

impl PolicyError {
    pub fn new(policy: &PolicyRef, field: impl Into<String>, kind: PolicyErrorKind) -> Self {
        Self {
            policy: policy.clone(),
            field: field.into(),
            kind,
        }
    }

    /// The policy the problem is in.
    pub fn policy(&self) -> &PolicyRef {
        &self.policy
    }

    /// The field path the problem is in.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The same, as a problem report on the policy's field.
    pub fn problem(&self) -> Problem {
        Problem::new(
            Subject::Field {
                kind: ObjectKind::NetworkPolicy,
                name: self.policy.clone(),
                field: self.field.clone(),
            },
            self.kind.to_string(),
        )
    }
}
