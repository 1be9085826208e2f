//! The API server as a source: watchers on Pods (every node: remote pod
//! IPs feed the ipcache), Namespaces, Nodes (labels and addresses, for
//! ClusterNetworkPolicy `nodes` peers), NetworkPolicies, Services and
//! EndpointSlices (the frontends judged after DNAT, and `explain`'s
//! backends), ClusterNetworkPolicies (a CRD that may be absent; see
//! `cluster_policies.rs`), and ServiceCIDRs (the Service ranges, unless
//! `--service-cidr` gives them; see `service_cidrs.rs`), kept as plain
//! values (no managed fields, annotations or status beyond what policy
//! reads).
//!
//! Changes are published only once every watcher has completed its
//! initial list (streamed where the server offers it, in pages where not:
//! `initial_list.rs`), and a re-list (410 Gone, a reconnect) is buffered until
//! it is complete and then published as its difference from what was
//! known: the datapath never sees a half-listed cluster. While the API
//! server is unreachable nothing is published, so the last state stays
//! enforced; the watchers retry with backoff.
mod cluster_policies;
mod events;
mod initial_list;
mod pod_ranges;
mod service_cidrs;
mod status;
mod store;

use std::{sync::Arc, time::Duration};

use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod, Service},
    discovery::v1::EndpointSlice,
    networking::v1::{NetworkPolicy, ServiceCIDR},
};
use kube::{
    Api, Client, ResourceExt as _,
    api::DynamicObject,
    runtime::watcher::{self, Event},
};
use tracing::{debug, info, warn};

use self::{
    cluster_policies::ClusterPolicies,
    service_cidrs::ServiceCidrs,
    store::{Converted, Pods, Store},
};
pub use self::{
    events::publish_events,
    pod_ranges::{node_pod_cidrs, read_pod_ranges},
    status::{CONDITION, LEASE_NAME, Standings, write_status},
};
use super::{Sink, SourceId, SourceUpdate};
use crate::cluster::{
    Change, EndpointSliceInfo, NamespaceInfo, NodeInfo, ObjectKind, ObjectRef, Problem,
    ServiceInfo, endpoint_slice_info, namespace_info, node_info, service_info,
};

/// What is read with `get` only. Nothing now: this node's own Node object
/// (its `spec.podCIDRs`, when `--pod-cidr` is not given; see
/// `pod_ranges.rs`) is read with the grant of the Node watch.
pub const READ_ONCE: [(&str, &str); 0] = [];

/// What the watchers read, as RBAC names it: (API group, resource).
pub const WATCHED: [(&str, &str); 8] = [
    ("", "pods"),
    // Every Node's labels and addresses: ClusterNetworkPolicy `nodes` peers.
    ("", "nodes"),
    ("", "namespaces"),
    ("networking.k8s.io", "networkpolicies"),
    ("", "services"),
    ("discovery.k8s.io", "endpointslices"),
    ("networking.k8s.io", "servicecidrs"),
    (cluster_policies::GROUP, cluster_policies::PLURAL),
];

enum Update {
    Pod(Box<Event<Pod>>),
    Namespace(Box<Event<Namespace>>),
    Policy(Box<Event<NetworkPolicy>>),
    Node(Box<Event<Node>>),
    Service(Box<Event<Service>>),
    Slice(Box<Event<EndpointSlice>>),
    ServiceCidr(Box<Event<ServiceCIDR>>),
    ClusterPolicy(Box<Event<DynamicObject>>),
    ClusterPolicyFailed(watcher::Error),
    Failed(&'static str, watcher::Error),
}

fn stream<K>(
    api: Api<K>,
    label: &'static str,
    wrap: fn(Event<K>) -> Update,
) -> BoxStream<'static, Update>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    initial_list::events(api, label)
        .map(move |r| match r {
            Ok(e) => wrap(e),
            Err(e) => Update::Failed(label, e),
        })
        .boxed()
}

/// The ServiceCIDR watch: as [`stream`], ending after a 404 (the cluster
/// does not serve the API; said once, by [`ServiceCidrs::failed`]).
fn service_cidr_stream(api: Api<ServiceCIDR>) -> BoxStream<'static, Update> {
    // Ended without polling the watcher again: a poll would send the
    // next request.
    let events = initial_list::events(api, "servicecidrs");
    futures::stream::unfold(Some(events), |events| async move {
        let mut events = events?;
        Some(match events.next().await? {
            Ok(e) => (Update::ServiceCidr(Box::new(e)), Some(events)),
            Err(e) => {
                let ended = service_cidrs::not_served(&e);
                (
                    Update::Failed("servicecidrs", e),
                    (!ended).then_some(events),
                )
            }
        })
    })
    .boxed()
}

/// Keeps only what policy reads: no managed fields, owners, or annotations
/// but the one that stages a policy.
fn strip_policy(p: &NetworkPolicy) -> NetworkPolicy {
    let mut p = p.clone();
    p.metadata.managed_fields = None;
    crate::cluster::staged::keep_staged_annotation(&mut p.metadata);
    p.metadata.owner_references = None;
    p
}

fn policy_entry(p: &NetworkPolicy) -> Option<(ObjectRef, Arc<NetworkPolicy>)> {
    Some((
        ObjectRef::new(
            p.namespace().unwrap_or_else(|| "default".into()),
            p.name_any(),
        ),
        Arc::new(strip_policy(p)),
    ))
}

fn namespace_entry(n: &Namespace) -> Option<(String, NamespaceInfo)> {
    namespace_info(n).ok()
}

fn node_entry(n: &Node) -> Option<(String, NodeInfo)> {
    node_info(n).ok()
}

/// Watches the cluster and publishes every object once each kind is
/// listed, then what changed once the watches have nothing more ready
/// (and `settle` passed quietly, where it is not zero), until `sink` is
/// closed. With `service_cidrs`, the Service ranges too (without:
/// `--service-cidr` gives them).
pub async fn watch(client: Client, settle: Duration, sink: Sink, service_cidrs: bool) {
    let mut streams = vec![
        stream(Api::<Pod>::all(client.clone()), "pods", |e| {
            Update::Pod(Box::new(e))
        }),
        stream(Api::<Namespace>::all(client.clone()), "namespaces", |e| {
            Update::Namespace(Box::new(e))
        }),
        stream(Api::<Node>::all(client.clone()), "nodes", |e| {
            Update::Node(Box::new(e))
        }),
        stream(
            Api::<NetworkPolicy>::all(client.clone()),
            "networkpolicies",
            |e| Update::Policy(Box::new(e)),
        ),
        stream(Api::<Service>::all(client.clone()), "services", |e| {
            Update::Service(Box::new(e))
        }),
        stream(
            Api::<EndpointSlice>::all(client.clone()),
            "endpointslices",
            |e| Update::Slice(Box::new(e)),
        ),
        cluster_policies::stream(
            client.clone(),
            |e| Update::ClusterPolicy(Box::new(e)),
            Update::ClusterPolicyFailed,
        ),
    ];
    let mut cidrs = ServiceCidrs::default();
    if service_cidrs {
        streams.push(service_cidr_stream(Api::<ServiceCIDR>::all(client.clone())));
    } else {
        cidrs.not_watched();
    }
    let mut updates = futures::stream::select_all(streams);
    let mut pods = Pods::default();
    let mut services: Converted<Service, ServiceInfo> =
        Converted::new(ObjectKind::Service, service_info);
    let mut slices: Converted<EndpointSlice, EndpointSliceInfo> =
        Converted::new(ObjectKind::EndpointSlice, endpoint_slice_info);
    let mut namespaces: Store<NamespaceInfo> = Store::default();
    let mut nodes: Store<NodeInfo> = Store::default();
    let mut policies: Store<Arc<NetworkPolicy>> = Store::default();
    let mut cluster_policies = ClusterPolicies::default();
    let mut changes: Vec<Change> = Vec::new();
    let mut dirty = false;
    let mut failing = false;
    // The first update goes out (even empty) once every kind is listed.
    let mut published: Option<Vec<Problem>> = None;
    loop {
        let next = if dirty {
            tokio::time::timeout(settle, updates.next()).await
        } else {
            Ok(updates.next().await)
        };
        match next {
            Ok(Some(update)) => {
                let relisted = match update {
                    Update::Pod(e) => pods.apply(*e, &mut changes),
                    Update::Namespace(e) => namespaces.apply(*e, namespace_entry, &mut changes),
                    Update::Node(e) => nodes.apply(*e, node_entry, &mut changes),
                    Update::Policy(e) => policies.apply(*e, policy_entry, &mut changes),
                    Update::Service(e) => services.apply(*e, &mut changes),
                    Update::Slice(e) => slices.apply(*e, &mut changes),
                    Update::ServiceCidr(e) => cidrs.apply(*e),
                    Update::ClusterPolicy(e) => cluster_policies.apply(*e, &mut changes),
                    Update::ClusterPolicyFailed(e) => {
                        // Its own account of 404 and 403: no CRD is normal.
                        cluster_policies.failed(&e, &mut changes);
                        false
                    }
                    Update::Failed("servicecidrs", e) => {
                        // Optional: never holds the other kinds back.
                        cidrs.failed(&e);
                        false
                    }
                    Update::Failed(kind, e) => {
                        if !failing {
                            warn!(kind, error = %e, "watch failed; keeping the last state enforced and retrying");
                        }
                        failing = true;
                        false
                    }
                };
                if relisted && failing {
                    info!("watches recovered");
                    failing = false;
                }
                dirty = true;
            }
            Ok(None) => return,
            Err(_) => {
                // Settled: publish once every kind has been listed.
                dirty = false;
                let synced = pods.store.synced()
                    && namespaces.synced()
                    && nodes.synced()
                    && policies.synced()
                    && services.store.synced()
                    && slices.store.synced()
                    && cluster_policies.settled()
                    && cidrs.settled();
                if !synced {
                    continue;
                }
                cidrs.changes(&mut changes);
                let mut problems: Vec<Problem> = pods
                    .problems()
                    .chain(services.problems())
                    .chain(slices.problems())
                    .chain(cluster_policies.problems())
                    .cloned()
                    .collect();
                problems.extend(cidrs.problems());
                if changes.is_empty() && published.as_ref() == Some(&problems) {
                    continue;
                }
                published = Some(problems.clone());
                // Logged before it is sent: the sync worker may take it
                // (and finish) before this task runs again.
                debug!(changes = changes.len(), "cluster changes published");
                let update = SourceUpdate {
                    source: SourceId::Kube,
                    changes: std::mem::take(&mut changes),
                    problems,
                };
                if !sink.send(update) {
                    return;
                }
            }
        }
    }
}
