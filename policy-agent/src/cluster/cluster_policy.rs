//! ClusterNetworkPolicy (`policy.networking.k8s.io/v1alpha2`) as it
//! arrives: every field optional and loosely typed, and every field this
//! version does not know kept, so the compiler's validation can report it and fail
//! closed as the API asks instead of failing to read the object. The
//! cluster model keeps it as read; `policy::cluster_policy` validates it.
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Fields this version does not know, by name.
pub type Unknown = BTreeMap<String, Value>;

pub const API_VERSION: &str = "policy.networking.k8s.io/v1alpha2";

/// How one ClusterNetworkPolicy is enforced, as its status reports it:
/// the generation compiled and what is not enforced as written (the same
/// on every node: validation only, never a node's own shortfall).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Standing {
    pub generation: Option<i64>,
    pub problems: Vec<String>,
}
pub const KIND: &str = "ClusterNetworkPolicy";

/// "ClusterNetworkPolicy is a cluster-wide network policy resource."
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicy {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Spec,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub tier: Option<String>,
    pub priority: Option<i64>,
    pub subject: Option<Subject>,
    pub ingress: Option<Vec<Rule>>,
    pub egress: Option<Vec<Rule>>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// "Exactly one field must be set."
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    pub namespaces: Option<LabelSelector>,
    pub pods: Option<NamespacedPod>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    pub namespace_selector: Option<LabelSelector>,
    pub pod_selector: Option<LabelSelector>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// An ingress rule (`from`) or an egress rule (`to`); the other list is
/// a field the direction does not know.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    pub name: Option<String>,
    pub action: Option<String>,
    pub from: Option<Vec<Peer>>,
    pub to: Option<Vec<Peer>>,
    pub protocols: Option<Vec<Protocol>>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// "Exactly one of the fields must be set for a given peer."
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Peer {
    pub namespaces: Option<LabelSelector>,
    pub pods: Option<NamespacedPod>,
    pub nodes: Option<LabelSelector>,
    pub networks: Option<Vec<String>>,
    pub domain_names: Option<Vec<String>>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// "Exactly one field must be set."
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Protocol {
    pub tcp: Option<ProtocolPorts>,
    pub udp: Option<ProtocolPorts>,
    pub sctp: Option<ProtocolPorts>,
    pub destination_named_port: Option<String>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolPorts {
    pub destination_port: Option<Port>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// "You must specify either Port or Range."
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    pub number: Option<i64>,
    pub range: Option<PortRange>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PortRange {
    pub start: Option<i64>,
    pub end: Option<i64>,
    #[serde(flatten)]
    pub unknown: Unknown,
}
