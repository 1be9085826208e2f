//! Cluster mode against a fake API server on loopback (inside the
//! simulated node's namespace): the agent reaches the same pinned maps as
//! `apply` for the same objects, follows watch events into the datapath,
//! reports invalid policies as Events, rides out an outage with the last
//! state enforced, and converges after a re-list (410 Gone). Needs root.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use serde::Deserialize as _;
use serde_json::{Value, json};
use support::{
    conformance::{Backend, Conformance, cluster_yaml, ns_of},
    fake_apiserver::FakeApi,
};

fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .filter_map(|doc| {
            let v = Value::deserialize(doc).unwrap();
            (!v.is_null()).then_some(v)
        })
        .collect()
}

fn policy(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

const DENY_GAMMA: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: gamma}\nspec: {podSelector: {}, policyTypes: [Ingress]}\n";

/// The policy-relevant parts of a dump (revisions and attach modes left out).
fn comparable(dump: &Value) -> Value {
    let mut endpoints = dump["endpoints"].clone();
    for e in endpoints.as_array_mut().unwrap() {
        e.as_object_mut().unwrap().remove("revision");
    }
    json!({"endpoints": endpoints, "identities": dump["identities"], "ipcache": dump["ipcache"], "policy": dump["policy"]})
}

fn wait_for(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn cluster_mode_matches_apply_follows_watches_and_rides_out_outages() {
    let mut c = Conformance::new("kmode", Backend::Bpf);
    c.write_policies(DENY_GAMMA);

    // The reference: `apply` on manifests of the same objects.
    c.apply_ok();
    let want = comparable(&c.dump());
    c.reset();

    let api = FakeApi::start(
        &c.node().node,
        objects(&format!(
            "{}---\n{DENY_GAMMA}",
            cluster_yaml(&c.namespaces, &c.pods)
        )),
    );
    let kubeconfig = c.dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kc = kubeconfig.to_str().unwrap().to_owned();
    c.start_daemon_with(19410, &[], &[("KUBECONFIG", &kc)]);
    assert_eq!(
        comparable(&c.dump()),
        want,
        "cluster mode must reach the same maps as apply"
    );
    c.check("cluster mode: deny gamma", |f, t, _, _| {
        f == t || f == "(node)" || ns_of(t) != "gamma"
    });
    assert!(
        api.requests().iter().any(|r| r.contains("watch=true")),
        "the agent watches"
    );

    // A policy arriving through a watch event.
    api.apply(policy(
        "alpha",
        "deny",
        json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
    ));
    c.eventually("watch: new policy", Duration::from_secs(3), |f, t, _, _| {
        f == t || f == "(node)" || (ns_of(t) != "gamma" && ns_of(t) != "alpha")
    });

    // A namespace relabelled through a watch event opens gamma to beta.
    api.apply(policy("gamma", "deny", json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"trusted": "yes"}}}]}]})));
    api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "beta", "labels": {"team": "b", "env": "prod", "trusted": "yes"}}}));
    c.eventually(
        "watch: namespace relabel",
        Duration::from_secs(3),
        |f, t, _, _| {
            f == t
                || f == "(node)"
                || (ns_of(t) != "gamma" && ns_of(t) != "alpha")
                || (ns_of(t) == "gamma" && ns_of(f) == "beta")
        },
    );

    // An invalid policy: reported as an Event on it; it fails closed.
    api.apply(policy("beta", "broken", json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"ports": [{"port": 70000}]}]})));
    wait_for(
        "an Event on the invalid policy",
        Duration::from_secs(5),
        || {
            api.events().iter().any(|e| {
                e["regarding"]["name"] == "broken" && e["reason"] == "InvalidNetworkPolicy"
            })
        },
    );
    let expect_now = |f: &str, t: &str| {
        f == t
            || f == "(node)"
            || (ns_of(t) != "gamma" && ns_of(t) != "alpha" && t != "beta/db")
            || (ns_of(t) == "gamma" && ns_of(f) == "beta")
    };
    c.eventually(
        "invalid policy fails closed",
        Duration::from_secs(3),
        |f, t, _, _| expect_now(f, t),
    );

    // Outage: connections drop and are refused. The last state stays.
    api.set_down(true);
    api.apply(policy(
        "beta",
        "deny-all",
        json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
    ));
    std::thread::sleep(Duration::from_secs(2));
    c.check("outage: last state enforced", |f, t, _, _| expect_now(f, t));
    let metrics = c.http_get(19410, "/readyz");
    assert!(
        metrics.starts_with("HTTP/1.1 200"),
        "still ready during the outage: {metrics}"
    );

    // Back, with history compacted: the watchers re-list (410 Gone) and
    // the agent converges, slow responses notwithstanding.
    api.set_slow(Duration::from_millis(300));
    api.compact();
    api.set_down(false);
    c.eventually(
        "converged after the outage",
        Duration::from_secs(15),
        |f, t, _, _| {
            f == t
                || f == "(node)"
                || (ns_of(t) != "gamma" && ns_of(t) != "alpha" && ns_of(t) != "beta")
                || (ns_of(t) == "gamma" && ns_of(f) == "beta")
        },
    );
    api.set_slow(Duration::ZERO);

    // Deleting a policy through the watch restores traffic.
    api.delete("networkpolicies", "beta", "deny-all");
    api.delete("networkpolicies", "beta", "broken");
    c.eventually("watch: deletion", Duration::from_secs(5), |f, t, _, _| {
        expect_now(f, t) || t == "beta/db"
    });
}
