//! ClusterNetworkPolicy in cluster mode, against the fake API server: a
//! cluster without the CRD is served as normal, a CRD installed at run
//! time is picked up without a restart, policies arriving through the
//! watch are enforced (real traffic, the whole matrix), and one agent (the
//! Lease holder, taking over from one that stopped renewing) writes each
//! policy's status once per change, with one Event for a policy not
//! enforced as written. Needs root.
use std::time::Duration;

use policy_agent::source::kube::{CONDITION, LEASE_NAME};
use policy_testbed::fixtures::{
    conformance::{Backend, Conformance, NODE, is_node, ns_of},
    fake_apiserver::FakeApi,
};
use serde_json::{Value, json};

use crate::cluster_mode::{cluster_objects, wait_for};

fn cnp(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy", "metadata": {"name": name, "generation": 1}, "spec": spec})
}

/// The conditions the agent wrote on `name`, last patch first.
fn conditions(api: &FakeApi, name: &str) -> Vec<Value> {
    api.status_patches()
        .into_iter()
        .rev()
        .filter(|(n, _)| n == name)
        .map(|(_, body)| body["status"]["conditions"][0].clone())
        .collect()
}

#[test]
fn cluster_policies_are_watched_enforced_and_reported_once() {
    let mut c = Conformance::new("cnpkube", Backend::Bpf);
    let api = FakeApi::start(&c.node().node, cluster_objects(&c, ""));
    let kubeconfig = c.dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kc = kubeconfig.to_str().unwrap().to_owned();
    // Another agent holds the status Lease and then stops renewing it.
    let other = std::time::Instant::now();
    api.put_lease(
        "default",
        LEASE_NAME,
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": LEASE_NAME, "namespace": "default"},
               "spec": {"holderIdentity": "node-other", "leaseDurationSeconds": 15, "leaseTransitions": 1}}),
    );
    // No CRD: ready all the same, nothing denied.
    c.start_daemon_with(19420, &[], &[("KUBECONFIG", &kc)]);
    c.check("no CRD: open", |_, _, _, _| true);

    // The CRD is installed and an Admin Deny lands: gamma loses beta.
    api.set_served("clusternetworkpolicies", true);
    api.apply(cnp(
        "deny-beta-to-gamma",
        json!({"tier": "Admin", "priority": 10,
               "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "gamma"}}},
               "ingress": [{"name": "no-beta", "action": "Deny",
                            "from": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "beta"}}}]}]}),
    ));
    c.eventually(
        "a CRD installed at run time is watched",
        Duration::from_secs(30),
        |f, t, _, _| is_node(f) || f == t || !(ns_of(f) == "beta" && ns_of(t) == "gamma"),
    );

    // Its status: Accepted, written once the other holder's Lease went
    // stale (unchanged for its duration, on this agent's clock), and not
    // before.
    wait_for("Accepted=True", Duration::from_secs(45), || {
        conditions(&api, "deny-beta-to-gamma")
            .first()
            .is_some_and(|c| {
                c["type"] == CONDITION && c["status"] == "True" && c["observedGeneration"] == 1
            })
    });
    assert!(
        other.elapsed() >= Duration::from_secs(15),
        "written while another agent held the Lease"
    );
    let lease = api.lease("default", LEASE_NAME).expect("the status Lease");
    assert_eq!(lease["spec"]["holderIdentity"], NODE);
    assert_eq!(lease["spec"]["leaseTransitions"], 2);

    // A policy with a field this version does not know fails closed (its
    // Deny matches everything) and is reported: False, one Event.
    api.apply(cnp(
        "future-field",
        json!({"tier": "Admin", "priority": 20,
               "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "alpha"}}},
               "ingress": [{"action": "Deny", "from": [{"namespaces": {"matchLabels": {"team": "nobody"}}}],
                            "frobnicate": true}]}),
    ));
    c.eventually(
        "an unknown field in a Deny fails closed",
        Duration::from_secs(15),
        |f, t, _, _| {
            is_node(f)
                || f == t
                || !(ns_of(t) == "alpha" || (ns_of(f) == "beta" && ns_of(t) == "gamma"))
        },
    );
    wait_for("Accepted=False", Duration::from_secs(15), || {
        conditions(&api, "future-field").first().is_some_and(|c| {
            c["status"] == "False"
                && c["reason"] == "NotEnforcedAsWritten"
                && c["message"].as_str().unwrap_or("").contains("frobnicate")
        })
    });
    // Once per change: further syncs (a relabelled pod, a resync) write
    // neither status nor Event again.
    let patches = api.status_patches().len();
    api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "beta", "labels": {"team": "b", "env": "prod", "extra": "yes"}}}));
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        api.status_patches().len(),
        patches,
        "{:#?}",
        api.status_patches()
    );
    let events: Vec<Value> = api
        .events()
        .into_iter()
        .filter(|e| e["reason"] == "InvalidClusterNetworkPolicy")
        .collect();
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["regarding"]["name"], "future-field");

    // Fixed: True again, the Deny of beta still holds.
    api.apply(cnp(
        "future-field",
        json!({"tier": "Admin", "priority": 20,
               "subject": {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "alpha"}}},
               "ingress": [{"action": "Deny", "from": [{"namespaces": {"matchLabels": {"team": "nobody"}}}]}]}),
    ));
    c.eventually("fixed", Duration::from_secs(15), |f, t, _, _| {
        is_node(f) || f == t || !(ns_of(f) == "beta" && ns_of(t) == "gamma")
    });
    wait_for("Accepted=True again", Duration::from_secs(15), || {
        conditions(&api, "future-field")
            .first()
            .is_some_and(|c| c["status"] == "True")
    });
    c.stop_daemon();
}
