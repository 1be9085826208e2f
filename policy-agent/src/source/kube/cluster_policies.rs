//! ClusterNetworkPolicies (`policy.networking.k8s.io/v1alpha2`, a CRD of
//! the network-policy-api project) as the cluster serves them.
//!
//! A cluster without the CRD is normal: the list answers 404, that is said
//! once, the other kinds are published without waiting, and the watch
//! keeps retrying (with backoff) so a CRD installed later is picked up
//! without a restart. A CRD removed after it was served takes its objects
//! with it: they are published as deleted. A 403 (RBAC without
//! clusternetworkpolicies) holds every publication back and says so at
//! every retry: enforcing without the cluster's guardrails would open
//! what an Admin Deny closes.
use std::{collections::BTreeMap, sync::Arc};

use futures::{StreamExt as _, stream::BoxStream};
use kube::{
    Api, Client, ResourceExt as _,
    api::{ApiResource, DynamicObject},
    runtime::watcher::{self, Event},
};
use tracing::{info, warn};

use super::{
    initial_list,
    service_cidrs::{Availability, status_code},
    store::Store,
};
use crate::cluster::{
    Change, ClusterNetworkPolicy, ObjectKind, ObjectRef, Problem, cluster_policy,
};

/// The API group, its version and the resource, as RBAC names them.
pub const GROUP: &str = "policy.networking.k8s.io";
pub const VERSION: &str = "v1alpha2";
pub const PLURAL: &str = "clusternetworkpolicies";

/// The resource, for a dynamic API (the agent keeps its own loosely typed
/// copy of the type, see `cluster::cluster_policy`).
pub fn resource() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: cluster_policy::API_VERSION.into(),
        kind: cluster_policy::KIND.into(),
        plural: PLURAL.into(),
    }
}

/// The watch: every event, and every failure (the stream never ends).
pub(super) fn stream<U: Send + 'static>(
    client: Client,
    wrap: fn(Event<DynamicObject>) -> U,
    failed: fn(watcher::Error) -> U,
) -> BoxStream<'static, U> {
    let api = Api::<DynamicObject>::all_with(client, &resource());
    initial_list::events(api, PLURAL)
        .map(move |r| match r {
            Ok(e) => wrap(e),
            Err(e) => failed(e),
        })
        .boxed()
}

/// What the ClusterNetworkPolicy watch knows.
pub(super) struct ClusterPolicies {
    store: Store<Arc<ClusterNetworkPolicy>>,
    availability: Availability,
    /// Objects that do not decode, by name: each keeps its last version
    /// that did (none: left out) and is reported.
    undecodable: BTreeMap<String, Problem>,
}

impl Default for ClusterPolicies {
    fn default() -> Self {
        Self {
            store: Store::default(),
            availability: Availability::Unknown,
            undecodable: BTreeMap::new(),
        }
    }
}

/// The policy as the compiler reads it, without what policy never reads.
fn decode(obj: &DynamicObject) -> Result<(String, ClusterNetworkPolicy), String> {
    let value = serde_json::to_value(obj).map_err(|e| e.to_string())?;
    let mut cnp: ClusterNetworkPolicy =
        serde_json::from_value(value).map_err(|e| format!("does not decode: {e}"))?;
    cnp.metadata.managed_fields = None;
    crate::cluster::staged::keep_staged_annotation(&mut cnp.metadata);
    cnp.metadata.owner_references = None;
    Ok((obj.name_any(), cnp))
}

impl ClusterPolicies {
    /// Whether the other kinds may be published: listed, or no CRD.
    pub fn settled(&self) -> bool {
        self.store.synced() || self.availability == Availability::Absent
    }

    /// Applies one watch event, appending the changes; true when a
    /// (re-)list completed.
    pub fn apply(&mut self, event: Event<DynamicObject>, out: &mut Vec<Change>) -> bool {
        if let Event::Delete(obj) = &event {
            self.undecodable.remove(&obj.name_any());
        }
        if matches!(event, Event::InitDone) && self.availability != Availability::Served {
            if self.availability != Availability::Unknown {
                info!("ClusterNetworkPolicies readable: enforcing the cluster's guardrails");
            }
            self.availability = Availability::Served;
        }
        let undecodable = &mut self.undecodable;
        self.store.apply(
            event,
            |obj| match decode(obj) {
                Ok((name, cnp)) => {
                    undecodable.remove(&name);
                    Some((name, Arc::new(cnp)))
                }
                Err(reason) => {
                    let name = obj.name_any();
                    warn!(policy = %name, %reason, "a ClusterNetworkPolicy does not decode: its last version that did stays enforced");
                    let problem = Problem::object(
                        ObjectKind::ClusterNetworkPolicy,
                        ObjectRef::new("", name.clone()),
                        format!("{reason}; its last version that decoded stays enforced (none: left out)"),
                    );
                    undecodable.insert(name, problem);
                    None
                }
            },
            out,
        )
    }

    /// A failed list or watch.
    pub fn failed(&mut self, error: &watcher::Error, out: &mut Vec<Change>) {
        match status_code(error) {
            Some(404) => {
                if self.availability == Availability::Served {
                    warn!(
                        "the ClusterNetworkPolicy API is gone (CRD removed): its policies are withdrawn"
                    );
                    // The CRD's objects went with it: an empty re-list.
                    for event in [Event::Init, Event::InitDone] {
                        self.store.apply(
                            event,
                            |o: &DynamicObject| {
                                decode(o).ok().map(|(name, cnp)| (name, Arc::new(cnp)))
                            },
                            out,
                        );
                    }
                    self.undecodable.clear();
                } else if self.availability != Availability::Absent {
                    info!(
                        "the cluster serves no ClusterNetworkPolicy API (CRD not installed): none enforced; watching for it"
                    );
                }
                self.availability = Availability::Absent;
            }
            Some(403) => {
                warn!(error = %error, "may not list ClusterNetworkPolicies: nothing is published until RBAC grants list and watch on clusternetworkpolicies (the last state stays enforced)");
                self.availability = Availability::Forbidden;
            }
            _ => {
                if self.availability != Availability::Served {
                    warn!(error = %error, "cannot list ClusterNetworkPolicies yet; retrying");
                }
            }
        }
    }

    pub fn problems(&self) -> impl Iterator<Item = &Problem> {
        self.undecodable.values()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn object(name: &str, spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": cluster_policy::API_VERSION,
            "kind": cluster_policy::KIND,
            "metadata": {"name": name, "generation": 2, "managedFields": [{"manager": "kubectl"}]},
            "spec": spec,
            "status": {"conditions": []},
        }))
        .unwrap()
    }

    fn gone() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
            kube::core::Status::failure("not found", "NotFound").with_code(404),
        )))
    }

    #[test]
    fn a_policy_decodes_without_what_policy_never_reads() {
        let (name, cnp) = decode(&object(
            "p",
            serde_json::json!({"tier": "Admin", "priority": 3}),
        ))
        .unwrap();
        assert_eq!(name, "p");
        assert_eq!(cnp.spec.priority, Some(3));
        assert_eq!(cnp.metadata.generation, Some(2));
        assert!(cnp.metadata.managed_fields.is_none());
    }

    #[test]
    fn no_crd_settles_and_a_removed_crd_withdraws_its_policies() {
        let mut cnps = ClusterPolicies::default();
        let mut out = Vec::new();
        assert!(!cnps.settled());
        cnps.failed(&gone(), &mut out);
        assert!(
            cnps.settled(),
            "a cluster without the CRD holds nothing back"
        );
        assert!(out.is_empty());
        for e in [
            Event::Init,
            Event::InitApply(object("p", serde_json::json!({"tier": "Admin"}))),
            Event::InitDone,
        ] {
            cnps.apply(e, &mut out);
        }
        assert!(matches!(&out[..], [Change::UpsertClusterPolicy(n, _)] if n == "p"));
        out.clear();
        cnps.failed(&gone(), &mut out);
        assert!(
            matches!(&out[..], [Change::DeleteClusterPolicy(n)] if n == "p"),
            "{out:?}"
        );
        assert!(cnps.settled());
    }

    #[test]
    fn forbidden_holds_publication_and_an_undecodable_policy_keeps_its_last_version() {
        let mut cnps = ClusterPolicies::default();
        let mut out = Vec::new();
        let forbidden = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
            kube::core::Status::failure("forbidden", "Forbidden").with_code(403),
        )));
        cnps.failed(&forbidden, &mut out);
        assert!(!cnps.settled(), "guardrails unknown: nothing published");
        for e in [
            Event::Init,
            Event::InitApply(object("p", serde_json::json!({"priority": 1}))),
            Event::InitDone,
        ] {
            cnps.apply(e, &mut out);
        }
        assert!(cnps.settled());
        out.clear();
        cnps.apply(
            Event::Apply(object("p", serde_json::json!({"priority": "high"}))),
            &mut out,
        );
        assert!(out.is_empty(), "the last version that decoded stays");
        assert_eq!(cnps.problems().count(), 1);
        cnps.apply(
            Event::Apply(object("p", serde_json::json!({"priority": 2}))),
            &mut out,
        );
        assert_eq!(out.len(), 1);
        assert_eq!(cnps.problems().count(), 0);
    }
}
