//! Invalid NetworkPolicies as Kubernetes Events on them.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event as K8sEvent, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use crate::cluster::{ObjectKind, ObjectRef, Problem};

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
            .filter_map(|p| p.policy().map(|r| ((r.clone(), p.reason.clone()), ())))
            .collect();
        for (policy, reason) in current.keys().filter(|k| !reported.contains_key(*k)) {
            let (api_version, kind) = ObjectKind::NetworkPolicy.api();
            let reference = ObjectReference {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
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
