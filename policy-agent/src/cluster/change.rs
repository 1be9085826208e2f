//! The one vocabulary every source speaks: a change of the cluster state.
//!
//! Sources (the manifest directory, the API server's watches, the node's
//! own addresses) publish [`Change`]s; the compiler consumes them. What a
//! change means is stated once, by [`ClusterState::apply`]; the changes
//! between two versions of a keyed collection are found once, by
//! [`keyed_changes`] (which [`changes_between`] and every source use).
use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::ClusterNetworkPolicy;

use super::{
    ClusterState, EndpointSliceInfo, NamespaceInfo, NodeInfo, ObjectRef, PodInfo, PodRef,
    PolicyRef, ServiceInfo, ServiceRef,
};

/// One change of the cluster state.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    UpsertPod(PodRef, PodInfo),
    DeletePod(PodRef),
    UpsertNamespace(String, NamespaceInfo),
    DeleteNamespace(String),
    UpsertPolicy(PolicyRef, Arc<NetworkPolicy>),
    DeletePolicy(PolicyRef),
    UpsertClusterPolicy(String, Arc<ClusterNetworkPolicy>),
    DeleteClusterPolicy(String),
    /// A Node of the cluster (any node's; for `nodes` peers).
    UpsertNodeObject(String, NodeInfo),
    DeleteNodeObject(String),
    UpsertService(ServiceRef, ServiceInfo),
    DeleteService(ServiceRef),
    UpsertEndpointSlice(ObjectRef, EndpointSliceInfo),
    DeleteEndpointSlice(ObjectRef),
    /// The enforcing node's name or its own addresses changed.
    Node {
        name: String,
        ips: Vec<IpAddr>,
    },
    /// The cluster's Service ranges (its ServiceCIDRs, or
    /// `--service-cidr`): every address in them is a frontend.
    ServiceRanges(Vec<IpNet>),
    /// The ranges this node's IPAM hands to its own pods (the Node's
    /// `spec.podCIDRs`, or `--pod-cidr`); empty: none, the pod-range
    /// guard is off. Until the first one, they are not known.
    PodRanges(Vec<IpNet>),
}

/// A kind of object kept by key, and how its changes are spelled.
pub trait Keyed: Clone + PartialEq {
    type Key: Ord + Clone;
    fn upsert(key: Self::Key, value: Self) -> Change;
    fn delete(key: Self::Key) -> Change;
}

/// `Keyed` for a value type: its key type and the two `Change` variants
/// that carry it (`wrap` turns the value into what the variant holds).
macro_rules! keyed {
    ($value:ty, $key:ty, $upsert:ident, $delete:ident $(, $wrap:path)?) => {
        impl Keyed for $value {
            type Key = $key;
            fn upsert(key: $key, value: Self) -> Change {
                Change::$upsert(key, $($wrap)?(value))
            }
            fn delete(key: $key) -> Change {
                Change::$delete(key)
            }
        }
    };
}

keyed!(PodInfo, PodRef, UpsertPod, DeletePod);
keyed!(NamespaceInfo, String, UpsertNamespace, DeleteNamespace);
keyed!(Arc<NetworkPolicy>, PolicyRef, UpsertPolicy, DeletePolicy);
keyed!(
    Arc<ClusterNetworkPolicy>,
    String,
    UpsertClusterPolicy,
    DeleteClusterPolicy
);
keyed!(NodeInfo, String, UpsertNodeObject, DeleteNodeObject);
keyed!(ServiceInfo, ServiceRef, UpsertService, DeleteService);
keyed!(
    EndpointSliceInfo,
    ObjectRef,
    UpsertEndpointSlice,
    DeleteEndpointSlice
);

/// Appends the changes that turn `old` into `new`: an upsert for every
/// key that is new or differs, then a delete for every key that is gone.
pub fn keyed_changes<V: Keyed>(
    old: &BTreeMap<V::Key, V>,
    new: &BTreeMap<V::Key, V>,
    out: &mut Vec<Change>,
) {
    for (k, v) in new {
        if old.get(k) != Some(v) {
            out.push(V::upsert(k.clone(), v.clone()));
        }
    }
    for k in old.keys().filter(|k| !new.contains_key(*k)) {
        out.push(V::delete(k.clone()));
    }
}

/// What changed from `old` to `new`: the node and the ranges first,
/// then namespaces, pods, policies, cluster policies, Services and their slices (a
/// namespace exists before its pods are read). Pod ranges once known are
/// not forgotten: a state that does not know them changes nothing.
pub fn changes_between(old: &ClusterState, new: &ClusterState) -> Vec<Change> {
    let mut out = Vec::new();
    if old.node_name != new.node_name || old.node_ips != new.node_ips {
        out.push(Change::Node {
            name: new.node_name.clone(),
            ips: new.node_ips.clone(),
        });
    }
    if old.service_ranges != new.service_ranges {
        out.push(Change::ServiceRanges(new.service_ranges.clone()));
    }
    if let Some(ranges) = &new.pod_ranges
        && old.pod_ranges.as_ref() != Some(ranges)
    {
        out.push(Change::PodRanges(ranges.clone()));
    }
    keyed_changes(&old.namespaces, &new.namespaces, &mut out);
    keyed_changes(&old.pods, &new.pods, &mut out);
    keyed_changes(&old.policies, &new.policies, &mut out);
    keyed_changes(&old.nodes, &new.nodes, &mut out);
    keyed_changes(&old.cluster_policies, &new.cluster_policies, &mut out);
    keyed_changes(&old.services, &new.services, &mut out);
    keyed_changes(&old.endpoint_slices, &new.endpoint_slices, &mut out);
    out
}

impl ClusterState {
    /// Applies one change: the meaning of each [`Change`].
    pub fn apply(&mut self, change: &Change) {
        match change {
            Change::UpsertPod(k, v) => {
                self.pods.insert(k.clone(), v.clone());
            }
            Change::DeletePod(k) => {
                self.pods.remove(k);
            }
            Change::UpsertNamespace(k, v) => {
                self.namespaces.insert(k.clone(), v.clone());
            }
            Change::DeleteNamespace(k) => {
                self.namespaces.remove(k);
            }
            Change::UpsertPolicy(k, v) => {
                self.policies.insert(k.clone(), Arc::clone(v));
            }
            Change::DeletePolicy(k) => {
                self.policies.remove(k);
            }
            Change::UpsertClusterPolicy(k, v) => {
                self.cluster_policies.insert(k.clone(), Arc::clone(v));
            }
            Change::DeleteClusterPolicy(k) => {
                self.cluster_policies.remove(k);
            }
            Change::UpsertNodeObject(k, v) => {
                self.nodes.insert(k.clone(), v.clone());
            }
            Change::DeleteNodeObject(k) => {
                self.nodes.remove(k);
            }
            Change::UpsertService(k, v) => {
                self.services.insert(k.clone(), v.clone());
            }
            Change::DeleteService(k) => {
                self.services.remove(k);
            }
            Change::UpsertEndpointSlice(k, v) => {
                self.endpoint_slices.insert(k.clone(), v.clone());
            }
            Change::DeleteEndpointSlice(k) => {
                self.endpoint_slices.remove(k);
            }
            Change::Node { name, ips } => {
                self.node_name.clone_from(name);
                self.node_ips.clone_from(ips);
            }
            Change::ServiceRanges(ranges) => {
                self.service_ranges.clone_from(ranges);
            }
            Change::PodRanges(ranges) => {
                self.pod_ranges = Some(ranges.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ObjectRef;

    #[test]
    fn changes_replayed_on_the_old_state_give_the_new_state() {
        let mut old = ClusterState {
            node_name: "n".into(),
            ..Default::default()
        };
        old.pods
            .insert(ObjectRef::new("a", "p1"), PodInfo::default());
        old.pods
            .insert(ObjectRef::new("a", "p2"), PodInfo::default());
        let mut new = old.clone();
        new.pods.remove(&ObjectRef::new("a", "p1"));
        new.pods
            .get_mut(&ObjectRef::new("a", "p2"))
            .unwrap()
            .labels_mut()
            .insert("x".into(), "y".into());
        new.node_ips = vec!["10.0.0.1".parse().unwrap()];
        new.namespaces.insert("a".into(), NamespaceInfo::default());
        let mut replay = old.clone();
        for c in changes_between(&old, &new) {
            replay.apply(&c);
        }
        assert_eq!(replay.pods, new.pods);
        assert_eq!(replay.namespaces, new.namespaces);
        assert_eq!(replay.node_ips, new.node_ips);
        assert!(changes_between(&new, &replay).is_empty());
    }

    #[test]
    fn pod_ranges_are_unknown_until_said_and_never_forgotten() {
        let old = ClusterState::default();
        let mut new = old.clone();
        assert!(changes_between(&old, &new).is_empty());
        new.pod_ranges = Some(Vec::new());
        assert_eq!(
            changes_between(&old, &new),
            [Change::PodRanges(Vec::new())],
            "none is news"
        );
        let mut replay = old.clone();
        replay.apply(&Change::PodRanges(Vec::new()));
        assert_eq!(replay.pod_ranges, Some(Vec::new()));
        assert!(
            changes_between(&new, &old).is_empty(),
            "not known is no change"
        );
    }
}
