//! Something not enforced as written, and what it is about.
//!
//! Every layer reports the same type: a source (a manifest that does not
//! decode, a pod whose status does not convert), the compiler (a policy
//! field that is invalid), a datapath (a pod whose interface cannot be
//! found). The subject is typed, so a consumer (Kubernetes Events on the
//! object, metrics) never parses a message back.
use std::{fmt, path::PathBuf};

use super::ObjectRef;

/// The kinds of Kubernetes objects the agent reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectKind {
    Namespace,
    Pod,
    NetworkPolicy,
    Service,
    EndpointSlice,
    /// `networking.k8s.io/v1` ServiceCIDR (cluster-scoped).
    ServiceCidr,
    /// `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy
    /// (cluster-scoped).
    ClusterNetworkPolicy,
}

impl ObjectKind {
    /// `apiVersion` and `kind`, as an Event's involved object names them.
    pub fn api(self) -> (&'static str, &'static str) {
        match self {
            Self::Namespace => ("v1", "Namespace"),
            Self::Pod => ("v1", "Pod"),
            Self::NetworkPolicy => ("networking.k8s.io/v1", "NetworkPolicy"),
            Self::Service => ("v1", "Service"),
            Self::EndpointSlice => ("discovery.k8s.io/v1", "EndpointSlice"),
            Self::ServiceCidr => ("networking.k8s.io/v1", "ServiceCIDR"),
            Self::ClusterNetworkPolicy => (
                super::cluster_policy::API_VERSION,
                super::cluster_policy::KIND,
            ),
        }
    }

    /// The lower-case name used in messages ("networkpolicy").
    pub fn name(self) -> &'static str {
        match self {
            Self::Namespace => "namespace",
            Self::Pod => "pod",
            Self::NetworkPolicy => "networkpolicy",
            Self::Service => "service",
            Self::EndpointSlice => "endpointslice",
            Self::ServiceCidr => "servicecidr",
            Self::ClusterNetworkPolicy => "clusternetworkpolicy",
        }
    }
}

/// What a problem is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    /// A manifest file, or one document of it (1-based).
    Document {
        file: PathBuf,
        document: Option<usize>,
    },
    /// A Kubernetes object (cluster-scoped ones have an empty namespace).
    Object { kind: ObjectKind, name: ObjectRef },
    /// One field of an object, as `kubectl explain` spells its path
    /// (`spec.ingress[0].ports[1].endPort`).
    Field {
        kind: ObjectKind,
        name: ObjectRef,
        field: String,
    },
    /// The node itself: its interfaces, its addresses, the datapath.
    Node,
}

impl Subject {
    /// The object the subject is (or is a field of).
    pub fn object(&self) -> Option<(ObjectKind, &ObjectRef)> {
        match self {
            Self::Object { kind, name } | Self::Field { kind, name, .. } => Some((*kind, name)),
            Self::Document { .. } | Self::Node => None,
        }
    }
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let object = |f: &mut fmt::Formatter<'_>, kind: &ObjectKind, name: &ObjectRef| {
            if name.namespace.is_empty() {
                write!(f, "{} {}", kind.name(), name.name)
            } else {
                write!(f, "{} {name}", kind.name())
            }
        };
        match self {
            Self::Document {
                file,
                document: Some(d),
            } => write!(f, "{} (document {d})", file.display()),
            Self::Document {
                file,
                document: None,
            } => write!(f, "{}", file.display()),
            Self::Object { kind, name } => object(f, kind, name),
            Self::Field { kind, name, field } => {
                object(f, kind, name)?;
                write!(f, ": {field}")
            }
            Self::Node => f.write_str("node"),
        }
    }
}

/// Something not enforced as written: its subject and why.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Problem {
    pub subject: Subject,
    pub reason: String,
}

impl Problem {
    pub fn new(subject: Subject, reason: impl Into<String>) -> Self {
        Self {
            subject,
            reason: reason.into(),
        }
    }

    /// A problem with an object as a whole.
    pub fn object(kind: ObjectKind, name: ObjectRef, reason: impl Into<String>) -> Self {
        Self::new(Subject::Object { kind, name }, reason)
    }

    /// A problem of the node (interfaces, datapath).
    pub fn node(reason: impl Into<String>) -> Self {
        Self::new(Subject::Node, reason)
    }

    /// The NetworkPolicy the problem is about, if any (for an Event on it).
    pub fn policy(&self) -> Option<&ObjectRef> {
        match self.subject.object() {
            Some((ObjectKind::NetworkPolicy, name)) => Some(name),
            _ => None,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.subject, self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_what_they_are_about() {
        let field = Problem::new(
            Subject::Field {
                kind: ObjectKind::NetworkPolicy,
                name: ObjectRef::new("shop", "deny"),
                field: "spec.ingress[0].ports[0].endPort".into(),
            },
            "90 is below port 100",
        );
        assert_eq!(
            field.to_string(),
            "networkpolicy shop/deny: spec.ingress[0].ports[0].endPort: 90 is below port 100"
        );
        assert_eq!(field.policy(), Some(&ObjectRef::new("shop", "deny")));
        let doc = Problem::new(
            Subject::Document {
                file: "a.yaml".into(),
                document: Some(3),
            },
            "not valid YAML",
        );
        assert_eq!(doc.to_string(), "a.yaml (document 3): not valid YAML");
        assert_eq!(doc.policy(), None);
        let ns = Problem::object(ObjectKind::Namespace, ObjectRef::new("", "x"), "bad");
        assert_eq!(ns.to_string(), "namespace x: bad");
    }
}
