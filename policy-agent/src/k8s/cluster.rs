//! Cluster mode: watchers on Pods (every node: remote pod IPs feed the
//! ipcache), Namespaces and NetworkPolicies, kept as plain values (no
//! managed fields, annotations or status), published as snapshots.
//!
//! A snapshot is published only once every watcher has completed its
//! initial list, and after a re-list (410 Gone, a reconnect) only once the
//! re-list is complete: the datapath never sees a half-listed cluster.
//! While the API server is unreachable nothing is published, so the last
//! state stays enforced; the watchers retry with backoff.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::{
    core::v1::{Namespace, ObjectReference, Pod},
    networking::v1::NetworkPolicy,
};
use kube::{
    Api, Client, ResourceExt as _,
    runtime::{
        WatchStreamExt as _,
        events::{Event as K8sEvent, EventType, Recorder, Reporter},
        watcher::{self, Event},
    },
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tracing::{debug, info, warn};

use crate::{
    cluster::{ClusterState, NamespaceInfo, ObjectRef, PodInfo, namespace_info, pod_info},
    daemon::SourceUpdate,
    enforce::Problem,
    policy::Change,
};

/// A watched kind's objects, with the buffer of a re-list in progress.
struct Store<V> {
    live: BTreeMap<ObjectRef, V>,
    relist: Option<BTreeMap<ObjectRef, V>>,
    synced: bool,
}

impl<V> Default for Store<V> {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            relist: None,
            synced: false,
        }
    }
}

/// What one watch event did to a store.
enum Applied<V> {
    Nothing,
    /// An object changed (None: deleted).
    Changed(ObjectRef, Option<V>),
    /// A (re-)list completed: the whole store may differ.
    Relisted,
}

impl<V: Clone + PartialEq> Store<V> {
    /// Applies one watch event.
    fn apply<K>(
        &mut self,
        event: Event<K>,
        mut convert: impl FnMut(&K) -> Option<(ObjectRef, V)>,
    ) -> Applied<V> {
        match event {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                Applied::Nothing
            }
            Event::InitApply(obj) => {
                if let (Some(buf), Some((k, v))) = (self.relist.as_mut(), convert(&obj)) {
                    buf.insert(k, v);
                }
                Applied::Nothing
            }
            Event::InitDone => {
                if let Some(buf) = self.relist.take() {
                    self.live = buf;
                }
                self.synced = true;
                Applied::Relisted
            }
            Event::Apply(obj) => match convert(&obj) {
                // Status churn of objects whose policy-relevant part stayed.
                Some((k, v)) if self.live.get(&k) == Some(&v) => Applied::Nothing,
                Some((k, v)) => {
                    self.live.insert(k.clone(), v.clone());
                    Applied::Changed(k, Some(v))
                }
                None => Applied::Nothing,
            },
            Event::Delete(obj) => match convert(&obj) {
                Some((k, _)) if self.live.remove(&k).is_some() => Applied::Changed(k, None),
                _ => Applied::Nothing,
            },
        }
    }
}

fn pod_ref(p: &Pod) -> ObjectRef {
    ObjectRef::new(p.namespace().unwrap_or_default(), p.name_any())
}

/// The pods, and a problem for each pod that cannot be converted. A problem
/// lasts until the pod converts, is deleted, or is missing from a re-list.
#[derive(Default)]
struct Pods {
    store: Store<PodInfo>,
    problems: BTreeMap<ObjectRef, Problem>,
    /// Every pod of the re-list in progress, convertible or not.
    relisted: BTreeSet<ObjectRef>,
}

impl Pods {
    fn apply(&mut self, event: Event<Pod>) -> Applied<PodInfo> {
        let mut deleted = None;
        match &event {
            Event::Init => self.relisted.clear(),
            Event::InitApply(p) => {
                self.relisted.insert(pod_ref(p));
            }
            Event::Delete(p) => deleted = Some(pod_ref(p)),
            Event::InitDone | Event::Apply(_) => {}
        }
        let relist_done = matches!(event, Event::InitDone);
        let problems = &mut self.problems;
        let applied = self.store.apply(event, |p| match pod_info(p) {
            Ok((k, v)) => {
                problems.remove(&k);
                Some((k, v))
            }
            Err(err) => {
                let k = pod_ref(p);
                problems.insert(
                    k.clone(),
                    Problem {
                        object: format!("pod {k}"),
                        reason: err.to_string(),
                    },
                );
                None
            }
        });
        // After the store, whose conversion of a deleted pod may report it.
        if let Some(k) = deleted {
            self.problems.remove(&k);
        }
        if relist_done {
            let listed = std::mem::take(&mut self.relisted);
            self.problems.retain(|k, _| listed.contains(k));
        }
        applied
    }
}

enum Update {
    Pod(Box<Event<Pod>>),
    Namespace(Box<Event<Namespace>>),
    Policy(Box<Event<NetworkPolicy>>),
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
    watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .map(move |r| match r {
            Ok(e) => wrap(e),
            Err(e) => Update::Failed(label, e),
        })
        .boxed()
}

/// Keeps only what policy reads: no managed fields, annotations or owners.
fn strip_policy(p: &NetworkPolicy) -> NetworkPolicy {
    let mut p = p.clone();
    p.metadata.managed_fields = None;
    p.metadata.annotations = None;
    p.metadata.owner_references = None;
    p
}

/// Watches the cluster and publishes a snapshot once every kind is listed
/// (and after every re-list), deltas in between, until `tx` closes.
pub async fn watch(
    client: Client,
    node: String,
    settle: Duration,
    tx: UnboundedSender<SourceUpdate>,
) {
    let mut updates = futures::stream::select_all([
        stream(Api::<Pod>::all(client.clone()), "pods", |e| {
            Update::Pod(Box::new(e))
        }),
        stream(Api::<Namespace>::all(client.clone()), "namespaces", |e| {
            Update::Namespace(Box::new(e))
        }),
        stream(
            Api::<NetworkPolicy>::all(client.clone()),
            "networkpolicies",
            |e| Update::Policy(Box::new(e)),
        ),
    ]);
    let mut pods = Pods::default();
    let mut namespaces: Store<NamespaceInfo> = Store::default();
    let mut policies: Store<NetworkPolicy> = Store::default();
    let mut changes: Vec<Change> = Vec::new();
    let mut snapshot_due = true;
    let mut dirty = false;
    let mut failing = false;
    loop {
        let next = if dirty {
            tokio::time::timeout(settle, updates.next()).await
        } else {
            Ok(updates.next().await)
        };
        match next {
            Ok(Some(update)) => {
                let mut relisted = false;
                match update {
                    Update::Pod(e) => match pods.apply(*e) {
                        Applied::Changed(k, Some(v)) => changes.push(Change::UpsertPod(k, v)),
                        Applied::Changed(k, None) => changes.push(Change::DeletePod(k)),
                        Applied::Relisted => relisted = true,
                        Applied::Nothing => {}
                    },
                    Update::Namespace(e) => {
                        let applied = namespaces.apply(*e, |n| {
                            namespace_info(n)
                                .ok()
                                .map(|(name, info)| (ObjectRef::new("", name), info))
                        });
                        match applied {
                            Applied::Changed(k, Some(v)) => {
                                changes.push(Change::UpsertNamespace(k.name, v))
                            }
                            Applied::Changed(k, None) => {
                                changes.push(Change::DeleteNamespace(k.name))
                            }
                            Applied::Relisted => relisted = true,
                            Applied::Nothing => {}
                        }
                    }
                    Update::Policy(e) => {
                        let applied = policies.apply(*e, |p| {
                            Some((
                                ObjectRef::new(
                                    p.namespace().unwrap_or_else(|| "default".into()),
                                    p.name_any(),
                                ),
                                strip_policy(p),
                            ))
                        });
                        match applied {
                            Applied::Changed(k, Some(v)) => {
                                changes.push(Change::UpsertPolicy(k, Box::new(v)))
                            }
                            Applied::Changed(k, None) => changes.push(Change::DeletePolicy(k)),
                            Applied::Relisted => relisted = true,
                            Applied::Nothing => {}
                        }
                    }
                    Update::Failed(kind, e) => {
                        if !failing {
                            warn!(kind, error = %e, "watch failed; keeping the last state enforced and retrying");
                        }
                        failing = true;
                    }
                }
                if relisted {
                    // After a re-list only a whole snapshot is exact.
                    snapshot_due = true;
                    changes.clear();
                    if failing {
                        info!("watches recovered");
                        failing = false;
                    }
                }
                dirty = true;
            }
            Ok(None) => return,
            Err(_) => {
                // Settled: publish once every kind has been listed.
                dirty = false;
                if !(pods.store.synced && namespaces.synced && policies.synced) {
                    continue;
                }
                let problems: Vec<Problem> = pods.problems.values().cloned().collect();
                let update = if snapshot_due {
                    snapshot_due = false;
                    changes.clear();
                    let state = ClusterState {
                        node_name: node.clone(),
                        node_ips: Vec::new(),
                        namespaces: namespaces
                            .live
                            .iter()
                            .map(|(k, v)| (k.name.clone(), v.clone()))
                            .collect(),
                        pods: pods.store.live.clone(),
                        policies: policies.live.clone(),
                    };
                    debug!(
                        pods = state.pods.len(),
                        policies = state.policies.len(),
                        "publishing cluster state"
                    );
                    SourceUpdate::Snapshot { state, problems }
                } else if changes.is_empty() {
                    continue;
                } else {
                    SourceUpdate::Delta {
                        changes: std::mem::take(&mut changes),
                        problems,
                    }
                };
                if tx.send(update).is_err() {
                    return;
                }
            }
        }
    }
}

/// Reports invalid NetworkPolicies as Kubernetes Events on them, once per
/// distinct problem.
pub async fn publish_events(client: Client, node: String, mut rx: UnboundedReceiver<Vec<Problem>>) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "policy-agent".into(),
            instance: Some(node),
        },
    );
    let mut reported: BTreeMap<(ObjectRef, String), ()> = BTreeMap::new();
    while let Some(problems) = rx.recv().await {
        let current: BTreeMap<(ObjectRef, String), ()> = problems
            .iter()
            .filter_map(|p| p.policy().map(|r| ((r, p.reason.clone()), ())))
            .collect();
        for (policy, reason) in current.keys().filter(|k| !reported.contains_key(*k)) {
            let reference = ObjectReference {
                api_version: Some("networking.k8s.io/v1".into()),
                kind: Some("NetworkPolicy".into()),
                namespace: Some(policy.namespace.clone()),
                name: Some(policy.name.clone()),
                ..Default::default()
            };
            let event = K8sEvent {
                type_: EventType::Warning,
                reason: "InvalidNetworkPolicy".into(),
                note: Some(truncate(reason, 1000)),
                action: "Enforce".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&event, &reference).await {
                warn!(policy = %policy, error = %e, "cannot publish an Event");
            }
        }
        reported = current;
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use k8s_openapi::{api::core::v1::PodStatus, apimachinery::pkg::apis::meta::v1::ObjectMeta};

    use super::*;

    fn pod(name: &str, ip: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("a".into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                pod_ip: Some(ip.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn problem_pods(pods: &Pods) -> Vec<String> {
        pods.problems.keys().map(|k| k.to_string()).collect()
    }

    #[test]
    fn an_unchanged_pod_is_no_change() {
        let mut pods = Pods::default();
        let first = pods.apply(Event::Apply(pod("p", "10.0.0.1")));
        assert!(matches!(first, Applied::Changed(_, Some(_))));
        let again = pods.apply(Event::Apply(pod("p", "10.0.0.1")));
        assert!(matches!(again, Applied::Nothing));
        let moved = pods.apply(Event::Apply(pod("p", "10.0.0.2")));
        assert!(matches!(moved, Applied::Changed(_, Some(_))));
    }

    #[test]
    fn a_pod_problem_lasts_until_the_pod_converts_or_goes_away() {
        let mut pods = Pods::default();
        pods.apply(Event::Apply(pod("bad", "not-an-ip")));
        assert_eq!(problem_pods(&pods), ["a/bad"]);
        pods.apply(Event::Apply(pod("bad", "10.0.0.9")));
        assert!(problem_pods(&pods).is_empty());

        pods.apply(Event::Apply(pod("bad", "not-an-ip")));
        assert_eq!(problem_pods(&pods), ["a/bad"]);
        pods.apply(Event::Delete(pod("bad", "not-an-ip")));
        assert!(problem_pods(&pods).is_empty());

        // Listed with a problem, then missing from the next re-list.
        for event in [
            Event::Init,
            Event::InitApply(pod("bad", "not-an-ip")),
            Event::InitDone,
        ] {
            pods.apply(event);
        }
        assert_eq!(problem_pods(&pods), ["a/bad"]);
        for event in [
            Event::Init,
            Event::InitApply(pod("good", "10.0.0.1")),
            Event::InitDone,
        ] {
            pods.apply(event);
        }
        assert!(problem_pods(&pods).is_empty());
        assert_eq!(pods.store.live.len(), 1);
    }
}
