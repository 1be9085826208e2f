//! Staged policies: a NetworkPolicy or ClusterNetworkPolicy annotated
//! `policy-agent/staged: "true"` is compiled and evaluated, but never
//! changes a verdict. The enforcing compiler never sees it (to it, a
//! staged policy is a deleted one); a second, staged view compiles every
//! policy, and each new flow whose verdict the staged view would change is
//! reported with what would decide it.
//!
//! Removing the annotation is an ordinary update of the policy: the sync
//! that carries it enforces the policy, so there is no moment when it is
//! neither staged nor enforced.
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{Change, ClusterState};

/// The annotation that stages a policy.
pub const STAGED_ANNOTATION: &str = "policy-agent/staged";

/// Whether `meta` stages its object: the annotation is `"true"` (any
/// other value, or none, enforces it; a typo enforces rather than opens).
pub fn is_staged(meta: &ObjectMeta) -> bool {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(STAGED_ANNOTATION))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// Keeps only the staging annotation (sources strip what policy never
/// reads; this one it does).
pub fn keep_staged_annotation(meta: &mut ObjectMeta) {
    let staged = is_staged(meta);
    meta.annotations =
        staged.then(|| BTreeMap::from([(STAGED_ANNOTATION.to_owned(), "true".to_owned())]));
}

/// A staged policy's kind and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StagedPolicy {
    NetworkPolicy { namespace: String, name: String },
    ClusterNetworkPolicy { name: String },
}

impl StagedPolicy {
    /// "NetworkPolicy" or "ClusterNetworkPolicy".
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NetworkPolicy { .. } => "NetworkPolicy",
            Self::ClusterNetworkPolicy { .. } => "ClusterNetworkPolicy",
        }
    }

    /// The namespace ("" for a ClusterNetworkPolicy).
    pub fn namespace(&self) -> &str {
        match self {
            Self::NetworkPolicy { namespace, .. } => namespace,
            Self::ClusterNetworkPolicy { .. } => "",
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Self::NetworkPolicy { name, .. } | Self::ClusterNetworkPolicy { name } => name,
        }
    }
}

impl std::fmt::Display for StagedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NetworkPolicy { namespace, name } => {
                write!(f, "NetworkPolicy {namespace}/{name}")
            }
            Self::ClusterNetworkPolicy { name } => write!(f, "ClusterNetworkPolicy {name}"),
        }
    }
}

/// Which policy a change is about, and whether it stages it (`true`: an
/// upsert with the annotation) or not (an upsert without it, or a
/// deletion). None for changes of other objects.
pub fn staging_of(change: &Change) -> Option<(StagedPolicy, bool)> {
    match change {
        Change::UpsertPolicy(key, np) => Some((
            StagedPolicy::NetworkPolicy {
                namespace: key.namespace.to_string(),
                name: key.name.to_string(),
            },
            is_staged(&np.metadata),
        )),
        Change::DeletePolicy(key) => Some((
            StagedPolicy::NetworkPolicy {
                namespace: key.namespace.to_string(),
                name: key.name.to_string(),
            },
            false,
        )),
        Change::UpsertClusterPolicy(name, cnp) => Some((
            StagedPolicy::ClusterNetworkPolicy { name: name.clone() },
            is_staged(&cnp.metadata),
        )),
        Change::DeleteClusterPolicy(name) => Some((
            StagedPolicy::ClusterNetworkPolicy { name: name.clone() },
            false,
        )),
        _ => None,
    }
}

impl StagedPolicy {
    /// What the enforcing compiler gets instead of staging this policy:
    /// its deletion.
    pub fn deletion(&self) -> Change {
        match self {
            Self::NetworkPolicy { namespace, name } => {
                Change::DeletePolicy(super::ObjectRef::new(namespace.clone(), name.clone()))
            }
            Self::ClusterNetworkPolicy { name } => Change::DeleteClusterPolicy(name.clone()),
        }
    }
}

impl ClusterState {
    /// The staged policies of this state.
    pub fn staged_policies(&self) -> Vec<StagedPolicy> {
        let nps = self
            .policies
            .iter()
            .filter(|(_, p)| is_staged(&p.metadata))
            .map(|(k, _)| StagedPolicy::NetworkPolicy {
                namespace: k.namespace.to_string(),
                name: k.name.to_string(),
            });
        let cnps = self
            .cluster_policies
            .iter()
            .filter(|(_, p)| is_staged(&p.metadata))
            .map(|(n, _)| StagedPolicy::ClusterNetworkPolicy { name: n.clone() });
        nps.chain(cnps).collect()
    }

    /// This state as enforced: without its staged policies.
    pub fn enforced(&self) -> ClusterState {
        let mut out = self.clone();
        out.policies.retain(|_, p| !is_staged(&p.metadata));
        out.cluster_policies.retain(|_, p| !is_staged(&p.metadata));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ObjectRef;
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use std::sync::Arc;

    fn policy(annotation: Option<&str>) -> NetworkPolicy {
        let mut np = NetworkPolicy::default();
        np.metadata.name = Some("p".into());
        np.metadata.namespace = Some("ns".into());
        if let Some(v) = annotation {
            np.metadata.annotations = Some(BTreeMap::from([
                (STAGED_ANNOTATION.to_owned(), v.to_owned()),
                ("other".to_owned(), "x".to_owned()),
            ]));
        }
        np
    }

    #[test]
    fn only_true_stages() {
        assert!(is_staged(&policy(Some("true")).metadata));
        assert!(is_staged(&policy(Some(" True ")).metadata));
        for v in [None, Some("false"), Some("yes"), Some("")] {
            assert!(!is_staged(&policy(v).metadata), "{v:?}");
        }
    }

    #[test]
    fn a_staged_upsert_is_a_deletion_to_the_enforcer() {
        let key = ObjectRef::new("ns", "p");
        let staged = Change::UpsertPolicy(key.clone(), Arc::new(policy(Some("true"))));
        let (p, stages) = staging_of(&staged).unwrap();
        assert_eq!((p.to_string(), stages), ("NetworkPolicy ns/p".into(), true));
        assert!(matches!(p.deletion(), Change::DeletePolicy(k) if k == key));
        let unstaged = Change::UpsertPolicy(key.clone(), Arc::new(policy(None)));
        assert_eq!(staging_of(&unstaged).map(|(_, s)| s), Some(false));
        assert_eq!(
            staging_of(&Change::DeletePolicy(key)).map(|(_, s)| s),
            Some(false)
        );
        assert!(staging_of(&Change::DeleteNamespace("ns".into())).is_none());
    }

    #[test]
    fn keeping_the_annotation_drops_the_others() {
        let mut meta = policy(Some("true")).metadata;
        keep_staged_annotation(&mut meta);
        assert_eq!(meta.annotations.as_ref().map(BTreeMap::len), Some(1));
        assert!(is_staged(&meta));
        let mut meta = policy(Some("no")).metadata;
        keep_staged_annotation(&mut meta);
        assert_eq!(meta.annotations, None);
    }
}
