//! The cluster state the compiler reads: plain values, free of kube I/O.
//!
//! Sources (the manifest directory, kube-rs watchers, the node's own
//! addresses) describe it with [`Change`]s; only the fields policy needs
//! are kept, so 10,000 pods stay small. [`Problem`] is how every layer
//! says what it could not enforce as written.
mod address;
mod change;
pub mod cluster_policy;
mod convert;
mod few;
pub mod interned;
mod problem;
mod service;
pub mod staged;

use std::{collections::BTreeMap, fmt, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::NetworkPolicy;

pub use self::cluster_policy::ClusterNetworkPolicy;

pub(crate) use self::convert::protocol_number;
pub use self::{
    address::{parse_cidr_sloppy, parse_ip_sloppy},
    change::{Change, Keyed, changes_between, keyed_changes},
    convert::{ConvertError, namespace_info, node_info, pod_info},
    few::Few,
    interned::{Interner, PodLabels, PodPorts, label_set, namespace_name, pod_labels, pod_ports},
    problem::{ObjectKind, Problem, Subject},
    service::{
        Backend, Endpoint, EndpointSliceInfo, SERVICE_NAME_LABEL, ServiceInfo, ServicePort,
        ServiceRef, SlicePort, Unreadable, backends, endpoint_slice_info, service_info,
    },
};

/// Labels, sorted by key.
pub type Labels = BTreeMap<String, String>;

/// A namespaced object's name: one pointer to one shared allocation. The
/// agent's indexes hold a pod's name many times over (claims, holders,
/// identities, each layer's map); each copy is 8 bytes and a reference
/// count, where two shared strings took 32 per key. A namespace's name is
/// one string for all its objects ([`interned::namespace_name`]). Equal,
/// ordered and hashed by its parts, namespace first.
#[derive(Clone)]
pub struct ObjectRef(Arc<ObjectName>);

/// The parts of an [`ObjectRef`], read through it (`pod.namespace`).
#[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    pub namespace: Arc<str>,
    pub name: Box<str>,
}

impl ObjectRef {
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self(Arc::new(ObjectName {
            namespace: interned::namespace_name(namespace.as_ref()),
            name: Box::from(name.as_ref()),
        }))
    }
}

impl std::ops::Deref for ObjectRef {
    type Target = ObjectName;

    fn deref(&self) -> &ObjectName {
        &self.0
    }
}

impl PartialEq for ObjectRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for ObjectRef {}

impl PartialOrd for ObjectRef {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ObjectRef {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            return std::cmp::Ordering::Equal;
        }
        self.0.cmp(&other.0)
    }
}

impl std::hash::Hash for ObjectRef {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl fmt::Debug for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectRef")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .finish()
    }
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A pod, as far as policy cares.
pub type PodRef = ObjectRef;
/// A NetworkPolicy's name.
pub type PolicyRef = ObjectRef;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceInfo {
    pub labels: Labels,
}

/// A Node as ClusterNetworkPolicy `nodes` peers read it: "It selects the
/// nodeIPs as the peer type by matching on the IPs present in the
/// node.Status.Addresses field of the node."
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub labels: Labels,
    /// Every `status.addresses` entry that is an IP address (Hostname and
    /// DNS entries are not), sorted, once each.
    pub addresses: Vec<IpAddr>,
}

/// A container port a named port can resolve to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerPort {
    pub name: Option<Arc<str>>,
    pub port: u16,
    /// IP protocol number (policy_common::proto::{TCP, UDP, SCTP}).
    pub protocol: u8,
}

/// A pod as far as policy cares: its [`PodFields`] behind one shared
/// pointer. Every copy the agent keeps (the source's, the merged state's,
/// the hand-off's, the compiler's) is a clone of the one the source made,
/// so a pod is held once however many layers know it. It reads as its
/// fields; a write goes to this copy alone (copy on write, as
/// [`Arc::make_mut`]), so it still behaves as a plain value.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PodInfo(Arc<PodFields>);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFields {
    /// Shared with every pod with the same labels
    /// ([`interned::pod_labels`]).
    pub labels: PodLabels,
    /// `spec.nodeName` (None while unscheduled).
    pub node_name: Option<Arc<str>>,
    /// `status.podIPs` (or `status.podIP`), IPv4 and/or IPv6, in their
    /// order (held in place when there is one).
    pub ips: Few<IpAddr>,
    /// Sorted, once each; shared with every pod with the same list
    /// ([`interned::pod_ports`]).
    pub ports: PodPorts,
    /// hostNetwork pods share the node's addresses and are not endpoints.
    pub host_network: bool,
    /// Succeeded or Failed: the pod no longer holds its IPs.
    pub terminal: bool,
    /// `metadata.creationTimestamp` (seconds): when two live pods claim one
    /// IP, the newer one holds it.
    pub created: i64,
    /// `metadata.uid`: tells a sandbox's pod from an older one of the same
    /// name (the CNI hand-off names both).
    pub uid: Option<String>,
}

impl PodFields {
    /// This pod's own copy of its labels, to change (the shared set stays
    /// as the other pods hold it).
    pub fn labels_mut(&mut self) -> &mut Labels {
        Arc::make_mut(&mut self.labels)
    }
}

impl From<PodFields> for PodInfo {
    fn from(fields: PodFields) -> Self {
        Self(Arc::new(fields))
    }
}

impl std::ops::Deref for PodInfo {
    type Target = PodFields;
    fn deref(&self) -> &PodFields {
        &self.0
    }
}

impl std::ops::DerefMut for PodInfo {
    /// This copy's own fields: the others keep theirs.
    fn deref_mut(&mut self) -> &mut PodFields {
        Arc::make_mut(&mut self.0)
    }
}

impl std::fmt::Debug for PodInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Everything the compiler reads.
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    /// The node this agent enforces on.
    pub node_name: String,
    /// The node's own addresses: always allowed.
    pub node_ips: Vec<IpAddr>,
    pub namespaces: BTreeMap<String, NamespaceInfo>,
    pub pods: BTreeMap<PodRef, PodInfo>,
    /// Shared with the changes that carried them (and, in manifests mode,
    /// the files that hold them): one copy of each object.
    pub policies: BTreeMap<PolicyRef, Arc<NetworkPolicy>>,
    /// ClusterNetworkPolicies by name (cluster-scoped).
    pub cluster_policies: BTreeMap<String, Arc<ClusterNetworkPolicy>>,
    /// Every Node of the cluster by name (`nodes` peers).
    pub nodes: BTreeMap<String, NodeInfo>,
    pub services: BTreeMap<ServiceRef, ServiceInfo>,
    pub endpoint_slices: BTreeMap<ObjectRef, EndpointSliceInfo>,
    /// The cluster's Service ranges, sorted, host bits clear.
    pub service_ranges: Vec<IpNet>,
    /// This node's pod ranges, sorted, host bits clear; None: not known
    /// (yet): a datapath keeps the guard it holds.
    pub pod_ranges: Option<Vec<IpNet>>,
}

impl ClusterState {
    /// The slices of `service`.
    pub fn slices_of<'a>(
        &'a self,
        service: &'a ServiceRef,
    ) -> impl Iterator<Item = &'a EndpointSliceInfo> + 'a {
        self.endpoint_slices
            .range(ObjectRef::new(service.namespace.clone(), "")..)
            .take_while(move |(k, _)| k.namespace == service.namespace)
            .map(|(_, s)| s)
            .filter(move |s| s.service.as_ref() == Some(service))
    }
}

/// Ranges as the model keeps them: host bits clear, sorted, once each.
pub fn normalized_ranges(nets: impl IntoIterator<Item = IpNet>) -> Vec<IpNet> {
    let mut out: Vec<IpNet> = nets.into_iter().map(|n| n.trunc()).collect();
    out.sort();
    out.dedup();
    out
}

/// Local pods that cannot be enforced yet because they hold no IP.
pub fn unready_local_pods<'a>(
    node_name: &str,
    pods: impl IntoIterator<Item = (&'a PodRef, &'a PodInfo)>,
) -> Vec<Problem> {
    pods.into_iter()
        .filter(|(_, p)| {
            p.node_name.as_deref() == Some(node_name)
                && !p.host_network
                && !p.terminal
                && p.ips.is_empty()
        })
        .map(|(r, _)| {
            Problem::object(
                ObjectKind::Pod,
                r.clone(),
                "has no IP (status.podIP/podIPs empty): nothing to enforce on yet",
            )
        })
        .collect()
}
