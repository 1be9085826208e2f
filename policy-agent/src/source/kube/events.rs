//! Invalid NetworkPolicies as Kubernetes Events on them.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event as K8sEvent, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use crate::cluster::{ObjectKind, ObjectRef, Problem, Subject};

/// What an Event is about: a policy, or the node itself.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Policy(ObjectRef),
    Node,
}

/// Reports problems as Kubernetes Events, once per distinct problem:
/// invalid NetworkPolicies on the policy, node problems (a full map, an
/// interface that cannot be attached) on the Node.
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
                let target = match (&p.subject, p.policy()) {
                    (_, Some(policy)) => Target::Policy(policy.clone()),
                    (Subject::Node, None) => Target::Node,
                    _ => return None,
                };
                Some(((target, p.reason.clone()), ()))
            })
            .collect();
        for (target, reason) in current.keys().filter(|k| !reported.contains_key(*k)) {
            let (reference, why) = match target {
                Target::Policy(policy) => {
                    let (api_version, kind) = ObjectKind::NetworkPolicy.api();
                    let reference = ObjectReference {
                        api_version: Some(api_version.into()),
                        kind: Some(kind.into()),
                        namespace: Some(policy.namespace.clone()),
                        name: Some(policy.name.clone()),
                        ..Default::default()
                    };
                    (reference, "InvalidNetworkPolicy")
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
