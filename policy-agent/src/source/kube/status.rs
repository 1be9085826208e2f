//! The status of ClusterNetworkPolicies, written by one agent of the
//! cluster: whoever holds a Lease (`policy-agent-status` in the agent's
//! namespace). Validation is the same on every node, so one writer says
//! it once per change, where a thousand nodes would otherwise race to
//! write the same condition and publish the same Event.
//!
//! The API text: "For `v1alpha2` of this API the CNP status field is
//! simply defined as a list of metav1.conditions ... it is up to each
//! implementation to report what they see fit." Each policy gets one
//! condition, `Accepted`: True (reason `Enforced`) when every field is
//! enforced as written, False (reason `NotEnforcedAsWritten`) with the
//! fields that are not and what was enforced instead (a rule that fails
//! closed). `observedGeneration` is the generation compiled. Written by
//! server-side apply as field manager `policy-agent`, so conditions
//! other controllers own are left alone. A False condition also becomes
//! one Warning Event on the policy.
//!
//! The Lease: held for [`LEASE_SECONDS`], renewed every [`RENEW`]. A
//! holder that stops renewing is replaced once its record has not changed
//! for a whole lease duration on this agent's own clock (no trust in
//! other nodes' clocks). A new holder writes every condition again.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::ObjectReference},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{DynamicObject, Patch, PatchParams, PostParams},
    runtime::events::{Event as K8sEvent, EventType, Recorder, Reporter},
};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

use super::cluster_policies;
use crate::cluster::cluster_policy::{self, Standing};

pub const LEASE_NAME: &str = "policy-agent-status";
pub const LEASE_SECONDS: i32 = 15;
const RENEW: Duration = Duration::from_secs(5);
pub const CONDITION: &str = "Accepted";
const MANAGER: &str = "policy-agent";
/// What one message may hold (the API allows 32 KiB).
const MESSAGE_MAX: usize = 4096;

/// Every ClusterNetworkPolicy the compiler holds, by name.
pub type Standings = BTreeMap<String, Standing>;

/// A condition as written: (status, reason, message, observed generation).
type Written = (&'static str, &'static str, String, Option<i64>);

/// The condition a standing asks for: (status, reason, message).
fn condition(standing: &Standing) -> (&'static str, &'static str, String) {
    if standing.problems.is_empty() {
        return ("True", "Enforced", "enforced as written".into());
    }
    let mut message = standing.problems.join("; ");
    if message.len() > MESSAGE_MAX {
        let mut end = MESSAGE_MAX;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    ("False", "NotEnforcedAsWritten", message)
}

/// The Lease, as this agent last saw it.
struct LeaseHolder {
    api: Api<Lease>,
    identity: String,
    /// The record last seen and when this agent first saw it.
    seen: Option<(String, Instant)>,
}

enum Held {
    Yes,
    No,
}

impl LeaseHolder {
    fn record(identity: &str, previous: Option<&Lease>) -> Lease {
        let now = MicroTime(Timestamp::now());
        let mut spec = previous.and_then(|l| l.spec.clone()).unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(identity) {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(identity.into());
        spec.lease_duration_seconds = Some(LEASE_SECONDS);
        spec.renew_time = Some(now);
        Lease {
            metadata: ObjectMeta {
                name: Some(LEASE_NAME.into()),
                resource_version: previous.and_then(|l| l.metadata.resource_version.clone()),
                ..Default::default()
            },
            spec: Some(spec),
        }
    }

    /// One round: takes, renews or waits for the Lease.
    async fn round(&mut self) -> Result<Held, kube::Error> {
        let Some(lease) = self.api.get_opt(LEASE_NAME).await? else {
            let fresh = Self::record(&self.identity, None);
            return Ok(
                match self.api.create(&PostParams::default(), &fresh).await {
                    Ok(_) => Held::Yes,
                    Err(kube::Error::Api(s)) if s.code == 409 => Held::No,
                    Err(e) => return Err(e),
                },
            );
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        let version = lease.metadata.resource_version.clone().unwrap_or_default();
        let stale = match &self.seen {
            Some((v, since)) if *v == version => {
                let duration = spec.lease_duration_seconds.unwrap_or(LEASE_SECONDS).max(1);
                since.elapsed() > Duration::from_secs(duration as u64)
            }
            _ => {
                self.seen = Some((version, Instant::now()));
                false
            }
        };
        if !ours && !stale && spec.holder_identity.is_some() {
            return Ok(Held::No);
        }
        let record = Self::record(&self.identity, Some(&lease));
        match self
            .api
            .replace(LEASE_NAME, &PostParams::default(), &record)
            .await
        {
            Ok(_) => Ok(Held::Yes),
            // Someone else wrote it first.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Held::No),
            Err(e) => Err(e),
        }
    }
}

/// Writes the status of every ClusterNetworkPolicy while this agent holds
/// the Lease, until `standings` closes.
pub async fn write_status(
    client: Client,
    namespace: String,
    identity: String,
    mut standings: watch::Receiver<Standings>,
) {
    let mut lease = LeaseHolder {
        api: Api::namespaced(client.clone(), &namespace),
        identity: identity.clone(),
        seen: None,
    };
    let policies = Api::<DynamicObject>::all_with(client.clone(), &cluster_policies::resource());
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "policy-agent".into(),
            instance: Some(identity),
        },
    );
    // What this holder wrote, by policy: the condition and its time.
    let mut written: BTreeMap<String, (Written, Timestamp)> = BTreeMap::new();
    let mut holding = false;
    let mut failing = false;
    let mut tick = tokio::time::interval(RENEW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                match lease.round().await {
                    Ok(Held::Yes) => {
                        if !holding {
                            info!(lease = LEASE_NAME, %namespace, "writing ClusterNetworkPolicy status for the cluster");
                            written.clear();
                        }
                        holding = true;
                        failing = false;
                    }
                    Ok(Held::No) => {
                        if holding {
                            info!(lease = LEASE_NAME, "another agent writes ClusterNetworkPolicy status now");
                        }
                        holding = false;
                        failing = false;
                    }
                    Err(e) => {
                        if !failing {
                            warn!(error = %e, lease = LEASE_NAME, %namespace, "cannot hold the status Lease; ClusterNetworkPolicy status is not written from here");
                        }
                        failing = true;
                        holding = false;
                    }
                }
            }
            changed = standings.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
        if !holding {
            continue;
        }
        let current = standings.borrow_and_update().clone();
        written.retain(|name, _| current.contains_key(name));
        for (name, standing) in &current {
            let (status, reason, message) = condition(standing);
            let want = (status, reason, message, standing.generation);
            let since = match written.get(name) {
                Some((had, _)) if *had == want => continue,
                // The time of the last transition of the status itself.
                Some((had, at)) if had.0 == want.0 => *at,
                _ => Timestamp::now(),
            };
            let patch = json!({
                "apiVersion": cluster_policy::API_VERSION,
                "kind": cluster_policy::KIND,
                "metadata": {"name": name},
                "status": {"conditions": [{
                    "type": CONDITION,
                    "status": want.0,
                    "reason": want.1,
                    "message": want.2,
                    "observedGeneration": want.3,
                    "lastTransitionTime": since.to_string(),
                }]},
            });
            let params = PatchParams::apply(MANAGER).force();
            match policies
                .patch_status(name, &params, &Patch::Apply(&patch))
                .await
            {
                Ok(_) => {
                    if want.0 == "False" {
                        publish(&recorder, name, &want.2).await;
                    }
                    written.insert(name.clone(), (want, since));
                }
                // Deleted meanwhile: the next standing drops it.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    warn!(policy = %name, error = %e, "cannot write a ClusterNetworkPolicy's status; retrying")
                }
            }
        }
    }
}

async fn publish(recorder: &Recorder, name: &str, message: &str) {
    let reference = ObjectReference {
        api_version: Some(cluster_policy::API_VERSION.into()),
        kind: Some(cluster_policy::KIND.into()),
        name: Some(name.into()),
        ..Default::default()
    };
    let event = K8sEvent {
        type_: EventType::Warning,
        reason: "InvalidClusterNetworkPolicy".into(),
        note: Some(message.chars().take(1000).collect()),
        action: "Enforce".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &reference).await {
        warn!(policy = %name, error = %e, "cannot publish an Event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standing_without_problems_is_accepted_and_one_with_is_not() {
        let ok = condition(&Standing {
            generation: Some(3),
            problems: vec![],
        });
        assert_eq!((ok.0, ok.1), ("True", "Enforced"));
        let long = "x".repeat(MESSAGE_MAX);
        let bad = condition(&Standing {
            generation: Some(3),
            problems: vec!["spec.tier: \"Top\" is not Admin or Baseline".into(), long],
        });
        assert_eq!((bad.0, bad.1), ("False", "NotEnforcedAsWritten"));
        assert!(bad.2.starts_with("spec.tier"));
        assert!(bad.2.len() <= MESSAGE_MAX + '…'.len_utf8());
    }
}
