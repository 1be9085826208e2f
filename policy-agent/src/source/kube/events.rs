//! Problems as Kubernetes Events on what they are about: invalid
//! NetworkPolicies, Service and EndpointSlice fields that do not read,
//! ServiceCIDRs, and the node itself.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event as K8sEvent, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use crate::cluster::{ObjectKind, ObjectRef, Problem, Subject};

/// What an Event is about: an object, or the node itself.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Object(ObjectKind, ObjectRef),
    Node,
}

/// The Event reason for a problem with an object of `kind`; None: no
/// Event from every node (pods and namespaces: their problems are the
/// node's to log; ClusterNetworkPolicies: the status writer's).
fn event_reason(kind: ObjectKind) -> Option<&'static str> {
    match kind {
        ObjectKind::NetworkPolicy => Some("InvalidNetworkPolicy"),
        ObjectKind::Service => Some("InvalidService"),
        ObjectKind::EndpointSlice => Some("InvalidEndpointSlice"),
        ObjectKind::ServiceCidr => Some("InvalidServiceCIDR"),
        // One agent of the cluster reports these (see `status.rs`).
        ObjectKind::ClusterNetworkPolicy => None,
        ObjectKind::Pod | ObjectKind::Namespace => None,
    }
}

/// Reports problems as Kubernetes Events, once per distinct problem:
/// invalid NetworkPolicies on the policy, unreadable fields on their
/// Service, EndpointSlice or ServiceCIDR, node problems (a full map, an
/// interface that cannot be attached, pod ranges not known) on the Node.
pub async fn publish_events(client: Client, node: String, mut rx: UnboundedReceiver<Vec<Problem>>) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "policy-agent".into(),
            instance: Some(node.clone()),
        },
    );
    let mut reported: BTreeMap<(Target, String), ()> = BTreeMap::new();
    while let Some(problems) = rx.recv().await {
        let current: BTreeMap<(Target, String), ()> = problems
            .iter()
            .filter_map(|p| {
                let target = match (&p.subject, p.subject.object()) {
                    (_, Some((kind, name))) if event_reason(kind).is_some() => {
                        Target::Object(kind, name.clone())
                    }
                    (Subject::Node, _) => Target::Node,
                    _ => return None,
                };
                // A field's problem names the field: one Event each.
                let note = match &p.subject {
                    Subject::Field { field, .. } => format!("{field}: {}", p.reason),
                    _ => p.reason.clone(),
                };
                Some(((target, note), ()))
            })
            .collect();
        for (target, reason) in current.keys().filter(|k| !reported.contains_key(*k)) {
            let (reference, why) = match target {
                Target::Object(object, name) => {
                    let (api_version, kind) = object.api();
                    let reference = ObjectReference {
                        api_version: Some(api_version.into()),
                        kind: Some(kind.into()),
                        namespace: (!name.namespace.is_empty()).then(|| name.namespace.to_string()),
                        name: Some(name.name.to_string()),
                        ..Default::default()
                    };
                    (reference, event_reason(*object).unwrap_or("NotEnforced"))
                }
                Target::Node => {
                    let reference = ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Node".into()),
                        name: Some(node.clone()),
                        ..Default::default()
                    };
                    (reference, "NotEnforced")
                }
            };
            let event = K8sEvent {
                type_: EventType::Warning,
                reason: why.into(),
                note: Some(truncate(reason, 1000)),
                action: "Enforce".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&event, &reference).await {
                warn!(target = ?target, error = %e, "cannot publish an Event");
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
