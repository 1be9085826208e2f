//! The staged view beside the enforcing compiler (see `cluster::staged`):
//! a second compiler, fed every change with staged policies as written,
//! that exists only while some policy is staged. It starts as a copy of
//! the enforcing compiler, so its cost is paid only while it is used.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::SystemTime,
};

use tracing::info;

use crate::{
    cluster::{
        Change, ObjectKind, ObjectRef, PodRef, Problem,
        staged::{StagedPolicy, staging_of},
    },
    identity::IdentityAllocator,
    mapstate::StagedView,
    policy::Compiler,
};

/// A staged policy as last seen: since when, and its upsert.
struct Staged {
    since: SystemTime,
    upsert: Change,
}

/// The staged compiler, with identity numbers of its own (the view is
/// judged by address, never by the enforcing compiler's numbers).
struct Shadow {
    compiler: Compiler,
    ids: IdentityAllocator,
}

#[derive(Default)]
pub struct Staging {
    staged: BTreeMap<StagedPolicy, Staged>,
    shadow: Option<Shadow>,
    view: Option<Arc<StagedView>>,
}

impl Staging {
    /// What the enforcing compiler gets of `changes` (a staged policy is a
    /// deleted one to it), and the changes as written when the staged
    /// compiler already exists (it follows them after the enforcing one).
    pub fn split(&mut self, changes: Vec<Change>) -> (Vec<Change>, Option<Vec<Change>>) {
        // Copied only while the staged compiler exists: nothing is staged
        // most of the time, and a first batch holds the whole cluster.
        let raw = self.shadow.is_some().then(|| changes.clone());
        let mut enforced = Vec::with_capacity(changes.len());
        for change in changes {
            match staging_of(&change) {
                Some((policy, true)) => {
                    let since = match self.staged.get(&policy) {
                        Some(s) => s.since,
                        None => {
                            info!(policy = %policy, "staged: evaluated and reported, not enforced");
                            SystemTime::now()
                        }
                    };
                    enforced.push(policy.deletion());
                    self.staged.insert(
                        policy,
                        Staged {
                            since,
                            upsert: change,
                        },
                    );
                }
                Some((policy, false)) => {
                    if self.staged.remove(&policy).is_some() {
                        info!(policy = %policy, "no longer staged");
                    }
                    enforced.push(change);
                }
                None => enforced.push(change),
            }
        }
        (enforced, raw)
    }

    /// Brings the staged compiler up to date after `enforcing` compiled
    /// the same batch (`raw`: what [`Self::split`] returned); returns
    /// whether the view changed.
    pub fn follow(
        &mut self,
        enforcing: &Compiler,
        enforcing_ids: &IdentityAllocator,
        raw: Option<Vec<Change>>,
    ) -> bool {
        if self.staged.is_empty() {
            self.shadow = None;
            return self.view.take().is_some();
        }
        let ops = match (&mut self.shadow, raw) {
            (Some(shadow), Some(raw)) => shadow.compiler.apply(raw, &mut shadow.ids).len(),
            _ => {
                // The first staged policy (or a batch the shadow missed):
                // start from what is enforced, then add every staged one.
                let mut shadow = Shadow {
                    compiler: enforcing.clone(),
                    ids: enforcing_ids.clone(),
                };
                let upserts = self.staged.values().map(|s| s.upsert.clone());
                shadow.compiler.apply(upserts, &mut shadow.ids);
                self.shadow = Some(shadow);
                usize::MAX
            }
        };
        let since: BTreeMap<StagedPolicy, SystemTime> = self
            .staged
            .iter()
            .map(|(p, s)| (p.clone(), s.since))
            .collect();
        let stale = self.view.as_ref().is_none_or(|v| v.staged != since);
        if ops == 0 && !stale {
            return false;
        }
        if let Some(shadow) = &self.shadow {
            self.view = Some(Arc::new(StagedView::new(shadow.compiler.maps(), since)));
        }
        true
    }

    /// Local pods the staged view judges (in some direction) and the
    /// enforcing one does not: their flows must be tracked to be recorded.
    pub fn tracked(&self, enforcing: &Compiler) -> BTreeSet<PodRef> {
        let Some(shadow) = &self.shadow else {
            return BTreeSet::new();
        };
        use policy_common::{direction, endpoint::EndpointInfo};
        let judged =
            |ep: &EndpointInfo| ep.judged(direction::INGRESS) || ep.judged(direction::EGRESS);
        let enforced = &enforcing.maps().endpoints;
        shadow
            .compiler
            .maps()
            .endpoints
            .iter()
            .filter(|(pod, ep)| judged(ep) && !enforced.get(*pod).is_some_and(judged))
            .map(|(pod, _)| pod.clone())
            .collect()
    }

    /// The view the flow pipeline judges records against.
    pub fn view(&self) -> Option<Arc<StagedView>> {
        self.view.clone()
    }

    /// What is wrong with the staged policies themselves (an invalid one
    /// is reported as it would be enforced: failing closed).
    pub fn problems(&self) -> Vec<Problem> {
        let Some(shadow) = &self.shadow else {
            return Vec::new();
        };
        let staged = |kind: ObjectKind, name: &ObjectRef| {
            let policy = match kind {
                ObjectKind::NetworkPolicy => StagedPolicy::NetworkPolicy {
                    namespace: name.namespace.to_string(),
                    name: name.name.to_string(),
                },
                ObjectKind::ClusterNetworkPolicy => StagedPolicy::ClusterNetworkPolicy {
                    name: name.name.to_string(),
                },
                _ => return false,
            };
            self.staged.contains_key(&policy)
        };
        shadow
            .compiler
            .problems()
            .into_iter()
            .filter(|p| p.subject.object().is_some_and(|(k, n)| staged(k, n)))
            .map(|mut p| {
                p.reason = format!("(staged) {}", p.reason);
                p
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use policy_common::{direction, proto, verdict::Reason};

    use super::*;
    use crate::{
        cluster::{ClusterState, ObjectRef, changes_between},
        mapstate::rule_name_text,
        source::manifests::{LoadedManifests, load_text},
    };

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: s}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {podIPs: [{ip: 10.1.0.10}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {podIPs: [{ip: 10.1.0.12}]}
"#;

    fn staged(yes: bool) -> &'static str {
        if yes {
            "\n  annotations: {policy-agent/staged: \"true\"}"
        } else {
            ""
        }
    }

    fn deny_db(staged_: bool) -> String {
        format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: deny-db\n  namespace: shop{}\nspec:\n  podSelector: {{matchLabels: {{app: db}}}}\n  policyTypes: [Ingress]\n",
            staged(staged_)
        )
    }

    fn state(policies: &str) -> ClusterState {
        let mut loaded = LoadedManifests::default();
        load_text(
            Path::new("c.yaml"),
            &format!("{CLUSTER}\n---\n{policies}"),
            &mut loaded,
        );
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
        loaded.cluster_state("n1", vec!["192.168.0.1".parse().unwrap()])
    }

    /// The enforcer's steps, without a datapath.
    struct Harness {
        compiler: Compiler,
        ids: IdentityAllocator,
        staging: Staging,
        last: ClusterState,
        marked: BTreeSet<PodRef>,
    }

    impl Harness {
        fn new() -> Self {
            Self {
                compiler: Compiler::new(Default::default()),
                ids: IdentityAllocator::new(),
                staging: Staging::default(),
                last: ClusterState::default(),
                marked: BTreeSet::new(),
            }
        }

        fn enforce(&mut self, next: ClusterState) {
            let changes = changes_between(&self.last, &next);
            self.last = next;
            let (changes, raw) = self.staging.split(changes);
            self.compiler.apply(changes, &mut self.ids);
            self.staging.follow(&self.compiler, &self.ids, raw);
            self.marked = self.staging.tracked(&self.compiler);
            self.compiler.track_staged(self.marked.clone());
        }

        fn flags(&self, pod: &str) -> u32 {
            let (ns, name) = pod.split_once('/').unwrap();
            self.compiler.maps().endpoints[&ObjectRef::new(ns, name)].flags
        }

        fn staged(&self, enforced: Reason) -> Option<(Reason, Vec<String>)> {
            let view = self.staging.view()?;
            let v = view.judge(
                "shop/db",
                direction::INGRESS,
                "10.1.0.10".parse().unwrap(),
                proto::TCP,
                80,
                enforced,
            )?;
            let names = view
                .rule_names
                .iter()
                .filter(|(k, _)| k.id == v.endpoint_identity || k.id == v.rule.network_policy)
                .map(|(_, n)| rule_name_text(n).policy)
                .collect();
            Some((v.reason, names))
        }
    }

    #[test]
    fn a_staged_policy_is_judged_beside_the_enforced_ones_and_enforced_once_unstaged() {
        use policy_common::endpoint::{ENDPOINT_INGRESS_ISOLATED, ENDPOINT_STAGED};
        let mut h = Harness::new();
        h.enforce(state(&deny_db(true)));
        // Not enforced: db is isolated in no direction, only tracked.
        assert_eq!(h.flags("shop/db") & ENDPOINT_INGRESS_ISOLATED, 0);
        assert_ne!(h.flags("shop/db") & ENDPOINT_STAGED, 0);
        assert_eq!(
            h.flags("shop/web") & ENDPOINT_STAGED,
            0,
            "web is not touched"
        );
        // The staged view would drop what is allowed now, naming it.
        let (reason, names) = h.staged(Reason::AllowNotIsolated).unwrap();
        assert_eq!(reason, Reason::DropPolicy);
        assert_eq!(names, ["deny-db"]);
        // A verdict it would not change is not reported.
        assert_eq!(h.staged(Reason::DropPolicy), None);

        // Un-staged: enforced in the same sync, and the view is gone.
        h.enforce(state(&deny_db(false)));
        assert_ne!(h.flags("shop/db") & ENDPOINT_INGRESS_ISOLATED, 0);
        assert_eq!(h.flags("shop/db") & ENDPOINT_STAGED, 0);
        assert!(h.staging.view().is_none());
        assert!(h.marked.is_empty());

        // Staged again: no longer enforced, reported again.
        h.enforce(state(&deny_db(true)));
        assert_eq!(h.flags("shop/db") & ENDPOINT_INGRESS_ISOLATED, 0);
        assert!(h.staged(Reason::AllowNotIsolated).is_some());
        // Deleted: nothing staged, nothing tracked for it.
        h.enforce(state(""));
        assert!(h.staging.view().is_none());
        assert_eq!(h.flags("shop/db") & ENDPOINT_STAGED, 0);
    }

    #[test]
    fn a_staged_allow_reports_what_it_would_admit() {
        let allow_web = format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: allow-web\n  namespace: shop{}\nspec:\n  podSelector: {{matchLabels: {{app: db}}}}\n  ingress: [{{from: [{{podSelector: {{matchLabels: {{app: web}}}}}}]}}]\n",
            staged(true)
        );
        let mut h = Harness::new();
        h.enforce(state(&format!("{}\n---\n{allow_web}", deny_db(false))));
        // db is isolated already: nothing to mark.
        assert!(h.marked.is_empty());
        let (reason, names) = h.staged(Reason::DropPolicy).unwrap();
        assert_eq!(reason, Reason::AllowPolicy);
        assert!(names.contains(&"allow-web".to_owned()), "{names:?}");
    }

    #[test]
    fn a_staged_cluster_policy_is_judged_in_its_tier() {
        let guard = format!(
            "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata:\n  name: guard{}\nspec:\n  tier: Admin\n  priority: 5\n  subject: {{namespaces: {{}}}}\n  ingress:\n  - {{name: no-web, action: Deny, from: [{{namespaces: {{}}}}]}}\n",
            staged(true)
        );
        let mut h = Harness::new();
        h.enforce(state(&guard));
        use policy_common::endpoint::ENDPOINT_INGRESS_TIERED;
        assert_eq!(
            h.flags("shop/db") & ENDPOINT_INGRESS_TIERED,
            0,
            "not enforced"
        );
        let view = h.staging.view().unwrap();
        let v = view
            .judge(
                "shop/db",
                direction::INGRESS,
                "10.1.0.10".parse().unwrap(),
                proto::TCP,
                80,
                Reason::AllowNotIsolated,
            )
            .unwrap();
        assert_eq!(v.reason, Reason::DropAdminTier);
        let key = policy_common::rule_name::RuleKey::new(
            policy_common::rule_name::kind::ADMIN,
            direction::INGRESS,
            v.rule.admin.rank(),
        );
        let text = rule_name_text(&view.rule_names[&key]);
        assert_eq!(
            (text.policy.as_str(), text.rule.as_str()),
            ("guard", "no-web")
        );
        assert_eq!(
            view.staged
                .keys()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["ClusterNetworkPolicy guard"]
        );
    }
}
