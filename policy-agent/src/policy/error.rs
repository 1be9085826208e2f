//! Why a policy could not be compiled as written.
use crate::{cluster::PolicyRef, identity::IdentityError};

/// One problem in one NetworkPolicy. Each names the policy and the field
/// path (`spec.ingress[0].ports[1].endPort`), as `kubectl explain` spells it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("networkpolicy {policy}: {field}: {value:?} is not a valid CIDR")]
    BadCidr {
        policy: PolicyRef,
        field: String,
        value: String,
    },
    #[error("networkpolicy {policy}: {field}: {except} is not a strict subset of cidr {cidr}")]
    ExceptOutsideCidr {
        policy: PolicyRef,
        field: String,
        except: String,
        cidr: String,
    },
    #[error(
        "networkpolicy {policy}: {field}: ipBlock cannot be combined with podSelector or namespaceSelector in one peer"
    )]
    IpBlockWithSelector { policy: PolicyRef, field: String },
    #[error(
        "networkpolicy {policy}: {field}: a peer must set podSelector, namespaceSelector or ipBlock"
    )]
    EmptyPeer { policy: PolicyRef, field: String },
    #[error("networkpolicy {policy}: {field}: {value:?} is not TCP, UDP or SCTP")]
    UnknownProtocol {
        policy: PolicyRef,
        field: String,
        value: String,
    },
    #[error("networkpolicy {policy}: {field}: {value} is outside 1-65535")]
    PortOutOfRange {
        policy: PolicyRef,
        field: String,
        value: i64,
    },
    #[error("networkpolicy {policy}: {field}: {value:?} is not a valid port name (IANA_SVC_NAME)")]
    BadPortName {
        policy: PolicyRef,
        field: String,
        value: String,
    },
    #[error("networkpolicy {policy}: {field}: endPort requires a numeric port")]
    EndPortWithoutNumericPort { policy: PolicyRef, field: String },
    #[error("networkpolicy {policy}: {field}: {end_port} is below port {port}")]
    EndPortBelowPort {
        policy: PolicyRef,
        field: String,
        port: i32,
        end_port: i32,
    },
    #[error("networkpolicy {policy}: {field}: {problem}")]
    BadSelector {
        policy: PolicyRef,
        field: String,
        problem: String,
    },
    #[error("networkpolicy {policy}: {field}: {value:?} is not Ingress or Egress")]
    BadPolicyType {
        policy: PolicyRef,
        field: String,
        value: String,
    },
    /// Not a problem of any one policy, but reported with them.
    #[error("identity allocation failed: {0}")]
    Identity(#[from] IdentityError),
}

impl PolicyError {
    /// The policy the problem is in (none for identity exhaustion).
    pub fn policy(&self) -> Option<&PolicyRef> {
        match self {
            Self::BadCidr { policy, .. }
            | Self::ExceptOutsideCidr { policy, .. }
            | Self::IpBlockWithSelector { policy, .. }
            | Self::EmptyPeer { policy, .. }
            | Self::UnknownProtocol { policy, .. }
            | Self::PortOutOfRange { policy, .. }
            | Self::BadPortName { policy, .. }
            | Self::EndPortWithoutNumericPort { policy, .. }
            | Self::EndPortBelowPort { policy, .. }
            | Self::BadSelector { policy, .. }
            | Self::BadPolicyType { policy, .. } => Some(policy),
            Self::Identity(_) => None,
        }
    }

    /// The field path the problem is in.
    pub fn field(&self) -> &str {
        match self {
            Self::BadCidr { field, .. }
            | Self::ExceptOutsideCidr { field, .. }
            | Self::IpBlockWithSelector { field, .. }
            | Self::EmptyPeer { field, .. }
            | Self::UnknownProtocol { field, .. }
            | Self::PortOutOfRange { field, .. }
            | Self::BadPortName { field, .. }
            | Self::EndPortWithoutNumericPort { field, .. }
            | Self::EndPortBelowPort { field, .. }
            | Self::BadSelector { field, .. }
            | Self::BadPolicyType { field, .. } => field,
            Self::Identity(_) => "",
        }
    }
}
