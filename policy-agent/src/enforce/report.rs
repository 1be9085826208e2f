//! What one sync did, and what it could not do.
use std::fmt;

/// Something not enforced as asked, naming the object and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// e.g. "pod default/web", "networkpolicy shop/deny", "file a.yaml".
    pub object: String,
    pub reason: String,
}

impl Problem {
    /// A policy that could not be compiled as written.
    pub fn from_policy_error(e: &crate::policy::PolicyError) -> Self {
        Self {
            object: e
                .policy()
                .map(|p| format!("networkpolicy {p}"))
                .unwrap_or_else(|| "networkpolicy".into()),
            reason: e.to_string(),
        }
    }

    /// A manifest that could not be read, converted or merged.
    pub fn manifest(reason: String) -> Self {
        Self {
            object: "manifest".into(),
            reason,
        }
    }

    /// The NetworkPolicy this problem is about, if any (for Kubernetes
    /// Events on it).
    pub fn policy(&self) -> Option<crate::cluster::ObjectRef> {
        let (ns, name) = self
            .object
            .strip_prefix("networkpolicy ")?
            .split_once('/')?;
        Some(crate::cluster::ObjectRef::new(ns, name))
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

/// The outcome of one sync.
#[derive(Clone, Debug, Default)]
pub struct SyncReport {
    /// Map writes applied.
    pub writes: usize,
    /// Local endpoints enforced.
    pub endpoints: usize,
    /// Interfaces newly attached / detached.
    pub attached: Vec<String>,
    pub detached: Vec<String>,
    /// Objects not enforced as written (policies fail closed).
    pub problems: Vec<Problem>,
}

/// Local pods that cannot be enforced yet because they hold no IP.
pub fn unready_local_pods(state: &crate::cluster::ClusterState) -> Vec<Problem> {
    state
        .pods
        .iter()
        .filter(|(_, p)| {
            p.node_name.as_deref() == Some(state.node_name.as_str())
                && !p.host_network
                && !p.terminal
        })
        .filter(|(_, p)| p.ips.is_empty())
        .map(|(r, _)| Problem {
            object: format!("pod {r}"),
            reason: "has no IP (status.podIP/podIPs empty): nothing to enforce on yet".into(),
        })
        .collect()
}
