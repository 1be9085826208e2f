//! Cluster mode against a fake API server on loopback (inside the
//! simulated node's namespace): the agent reaches the same pinned maps as
//! `apply` for the same objects, follows watch events into the datapath
//! (the server's record shows each change arrived as a watch event, not
//! through a re-list), reports invalid policies as Events, rides out an
//! outage with the last state enforced, and converges after a re-list
//! (410 Gone at the start of a watch, and in the middle of one). It reads
//! each kind by a streamed list, and in pages from a server that refuses
//! or ignores the request for one. The Service ranges come from the cluster's ServiceCIDRs and follow them at
//! run time; a cluster without that API is normal. Needs root.

use std::{
    io::{Read as _, Write as _},
    time::{Duration, Instant},
};

use policy_testbed::NetNs;
use policy_testbed::fixtures::{
    conformance::{Backend, Conformance, NODE, cluster_yaml, ns_of},
    fake_apiserver::{FakeApi, Served, StreamingLists, node},
};
use serde::Deserialize as _;
use serde_json::{Value, json};

fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .filter_map(|doc| {
            let v = Value::deserialize(doc).unwrap();
            (!v.is_null()).then_some(v)
        })
        .collect()
}

/// The cluster's objects, `more` (YAML) and this node's Node (without pod
/// ranges: its IPAM does not use them).
pub(crate) fn cluster_objects(c: &Conformance, more: &str) -> Vec<Value> {
    let mut out = objects(&format!(
        "{}---\n{more}",
        cluster_yaml(&c.namespaces, &c.pods)
    ));
    out.push(node(NODE, &[]));
    out
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

pub(crate) fn wait_for(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
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

    let api = FakeApi::start(&c.node().node, cluster_objects(&c, DENY_GAMMA));
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
    // Each kind read once, by a streamed list (the server offers them):
    // no paged list, no second watch, no 410 loop; bookmarks only because
    // the agent asks for them.
    let served = api.served();
    for kind in KINDS {
        let reads: Vec<&Served> = served.iter().filter(|s| s.lists(kind)).collect();
        assert!(
            matches!(reads[..], [Served::Streamed { .. }]),
            "{kind} read once, streamed: {served:#?}"
        );
        let watches = served
            .iter()
            .filter(|s| matches!(s, Served::Watch { kind: k, .. } if *k == kind))
            .count();
        assert_eq!(
            watches, 1,
            "{kind}: the streamed list's watch goes on: {served:#?}"
        );
    }
    assert!(
        !served.iter().any(|s| matches!(s, Served::Gone { .. })),
        "no 410 without compaction: {served:#?}"
    );
    assert!(
        api.requests()
            .iter()
            .filter(|r| r.contains("watch=true"))
            .all(|r| r.contains("allowWatchBookmarks=true")),
        "{:?}",
        api.requests()
    );

    // The watch cache loses its window: 410 Gone in the middle of every
    // open stream (first, while the watchers' backoff is fresh). The
    // watchers read again by a streamed list, watch on from it, and the
    // next change arrives as a watch event.
    let mark = api.served().len();
    api.expire_watches();
    wait_for(
        "re-listed after a 410 mid-stream",
        Duration::from_secs(10),
        || {
            let later = api.served().split_off(mark);
            KINDS.iter().all(|kind| {
                let gone = later.iter().position(|s| {
                    *s == Served::Gone {
                        kind,
                        mid_stream: true,
                    }
                });
                let list = later.iter().rposition(|s| s.lists(kind));
                matches!((gone, list), (Some(g), Some(l)) if g < l)
            })
        },
    );
    let mark = api.served().len();
    let rv = api.apply(pod_relabel(&c, "beta/web"));
    std::thread::sleep(Duration::from_millis(500));
    c.check("after a 410 mid-stream", |f, t, _, _| {
        f == t || f == "(node)" || ns_of(t) != "gamma"
    });
    api.assert_watched(mark, "pods", rv, "pod change after a 410");

    // A policy arriving through a watch event.
    let mark = api.served().len();
    let rv = api.apply(policy(
        "alpha",
        "deny",
        json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
    ));
    c.eventually("watch: new policy", Duration::from_secs(3), |f, t, _, _| {
        f == t || f == "(node)" || (ns_of(t) != "gamma" && ns_of(t) != "alpha")
    });
    api.assert_watched(mark, "networkpolicies", rv, "new policy");

    // A namespace relabelled through a watch event opens gamma to beta.
    let mark = api.served().len();
    let policy_rv = api.apply(policy("gamma", "deny", json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"trusted": "yes"}}}]}]})));
    let ns_rv = api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "beta", "labels": {"team": "b", "env": "prod", "trusted": "yes"}}}));
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
    api.assert_watched(mark, "networkpolicies", policy_rv, "changed policy");
    api.assert_watched(mark, "namespaces", ns_rv, "namespace relabel");

    // An invalid policy: reported as an Event on it; it fails closed.
    let mark = api.served().len();
    let rv = api.apply(policy("beta", "broken", json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"ports": [{"port": 70000}]}]})));
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
    api.assert_watched(mark, "networkpolicies", rv, "invalid policy");

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
    let mark = api.served().len();
    api.set_slow(Duration::from_millis(300));
    api.compact();
    api.set_down(false);
    // The watchers back off exponentially (up to 30 s, reset after 120 s
    // without errors): after the errors of an outage a re-list can take
    // that long. A generous bound, left as soon as it holds.
    c.eventually(
        "converged after the outage",
        Duration::from_secs(60),
        |f, t, _, _| {
            f == t
                || f == "(node)"
                || (ns_of(t) != "gamma" && ns_of(t) != "alpha" && ns_of(t) != "beta")
                || (ns_of(t) == "gamma" && ns_of(f) == "beta")
        },
    );
    api.set_slow(Duration::ZERO);
    // The change made during the outage came by a re-list after 410 Gone
    // (the history it was in is compacted): a streamed list, from which
    // every watcher watches on.
    let later = api.served().split_off(mark);
    assert!(
        later.contains(&Served::Gone {
            kind: "networkpolicies",
            mid_stream: false
        }),
        "{later:#?}"
    );
    assert!(
        later.iter().any(|s| matches!(
            s,
            Served::Streamed {
                kind: "networkpolicies",
                ..
            }
        )),
        "{later:#?}"
    );
    wait_for("watching again", Duration::from_secs(10), || {
        let later = api.served().split_off(mark);
        KINDS.iter().all(|kind| {
            later
                .iter()
                .any(|s| matches!(s, Served::Streamed { kind: k, .. } if k == kind))
        })
    });

    // Deleting a policy through the watch restores traffic.
    let mark = api.served().len();
    let first = api.delete("networkpolicies", "beta", "deny-all");
    let second = api.delete("networkpolicies", "beta", "broken");
    c.eventually("watch: deletion", Duration::from_secs(5), |f, t, _, _| {
        expect_now(f, t) || t == "beta/db"
    });
    api.assert_watched(mark, "networkpolicies", first, "deletion");
    api.assert_watched(mark, "networkpolicies", second, "deletion");
}

/// A server without streamed lists: one that refuses the request (422,
/// the feature off) and one that ignores it (a plain watch whose list
/// never ends). Either way each kind is listed in pages after the attempt,
/// watched from the listed version, and the agent reaches the same maps as
/// `apply`; changes then come as watch events.
#[test]
fn a_server_without_streamed_lists_is_listed_in_pages() {
    for (prefix, port, mode) in [
        ("kpager", 19414, StreamingLists::Refused),
        ("kpagei", 19415, StreamingLists::Ignored),
    ] {
        let mut c = Conformance::new(prefix, Backend::Bpf);
        c.write_policies(DENY_GAMMA);
        c.apply_ok();
        let want = comparable(&c.dump());
        c.reset();

        let api = FakeApi::start(&c.node().node, cluster_objects(&c, DENY_GAMMA));
        api.set_streaming_lists(mode);
        let kubeconfig = c.dir.join("kubeconfig");
        api.kubeconfig(&kubeconfig);
        let kc = kubeconfig.to_str().unwrap().to_owned();
        c.start_daemon_with(port, &[], &[("KUBECONFIG", &kc)]);
        assert_eq!(
            comparable(&c.dump()),
            want,
            "{mode:?}: the same maps as apply"
        );

        let served = api.served();
        for kind in KINDS {
            let asked = served.iter().position(|s| match mode {
                StreamingLists::Refused => *s == Served::StreamRefused { kind },
                _ => *s == Served::Watch { kind, from: None },
            });
            let lists: Vec<(usize, u64)> = served
                .iter()
                .enumerate()
                .filter_map(|(i, s)| match s {
                    Served::List { kind: k, rv } if *k == kind => Some((i, *rv)),
                    _ => None,
                })
                .collect();
            assert!(
                matches!((asked, &lists[..]), (Some(a), [(l, _)]) if a < *l),
                "{mode:?}: {kind} asked for a streamed list, then listed once in pages: {served:#?}"
            );
            assert!(
                served.contains(&Served::Watch {
                    kind,
                    from: Some(lists[0].1)
                }),
                "{mode:?}: {kind} watched from its list's version: {served:#?}"
            );
            assert!(
                !served.iter().any(|s| matches!(s, Served::Streamed { .. })),
                "{mode:?}: {served:#?}"
            );
        }

        let mark = api.served().len();
        let rv = api.apply(policy(
            "alpha",
            "deny",
            json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
        ));
        wait_for("the policy watched", Duration::from_secs(5), || {
            api.served().iter().any(
                |s| matches!(s, Served::Event { kind: "networkpolicies", rv: r, .. } if *r == rv),
            )
        });
        api.assert_watched(mark, "networkpolicies", rv, "after a paged list");
    }
}

const KINDS: [&str; 3] = ["pods", "namespaces", "networkpolicies"];

/// A pod of the cluster with an extra label (no policy selects on it).
fn pod_relabel(c: &Conformance, id: &str) -> Value {
    let (ns, name) = id.split_once('/').unwrap();
    let mut spec = c.pods.iter().find(|p| p.id() == id).unwrap().clone();
    spec.labels.insert("touched".into(), "yes".into());
    let yaml = cluster_yaml(&[], &[spec]);
    let obj = objects(&yaml).into_iter().next().unwrap();
    assert_eq!(
        (
            obj["metadata"]["namespace"].as_str(),
            obj["metadata"]["name"].as_str()
        ),
        (Some(ns), Some(name))
    );
    obj
}

/// GET from inside `ns`; the JSON lines of the body, read until the
/// server closes or `read_for` has passed.
fn get_lines(ns: &NetNs, port: u16, path: &str, read_for: Duration) -> Vec<Value> {
    let path = path.to_owned();
    ns.spawn(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: fake\r\n\r\n").unwrap();
        let deadline = Instant::now() + read_for;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        let text = String::from_utf8_lossy(&got).into_owned();
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        body.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect::<Vec<Value>>()
    })
    .unwrap()
    .join()
    .unwrap()
    .unwrap()
}

fn types(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .map(|l| match l["type"].as_str() {
            Some("ERROR") => format!("ERROR {}", l["object"]["code"]),
            Some(t) => t.to_owned(),
            None => "LIST".to_owned(),
        })
        .collect()
}

/// The fake server itself keeps the API server's resourceVersion rules,
/// so the agent's behaviour against it means what it would mean against
/// a real one.
#[test]
fn the_fake_api_server_keeps_resource_version_semantics() {
    let ns = NetNs::create("kfakeapi").unwrap();
    let ns_obj =
        |name: &str| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
    let api = FakeApi::start(&ns, vec![ns_obj("one")]);
    let list = get_lines(&ns, api.port, "/api/v1/namespaces", Duration::from_secs(2));
    let listed: u64 = list[0]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();

    // A watch from the listed version, no bookmarks asked: the change made
    // during it, and nothing else (no BOOKMARK in 1.5 s).
    let watch = |q: &str, read: Duration| {
        get_lines(
            &ns,
            api.port,
            &format!("/api/v1/namespaces?watch=true&{q}"),
            read,
        )
    };
    let later = std::thread::scope(|s| {
        let h = s.spawn(|| {
            watch(
                &format!("resourceVersion={listed}"),
                Duration::from_millis(1500),
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        api.apply(ns_obj("two"));
        h.join().unwrap()
    });
    assert_eq!(types(&later), ["ADDED"], "{later:?}");

    // Asked for, bookmarks come.
    let with = watch(
        &format!("resourceVersion={listed}&allowWatchBookmarks=true"),
        Duration::from_millis(1500),
    );
    assert!(types(&with).contains(&"BOOKMARK".to_owned()), "{with:?}");

    // Compaction: the old version is gone (410 at once), the version a
    // list returns now is not.
    api.compact();
    assert_eq!(
        types(&watch(
            &format!("resourceVersion={listed}"),
            Duration::from_secs(2)
        )),
        ["ERROR 410"]
    );
    let now: u64 = get_lines(&ns, api.port, "/api/v1/namespaces", Duration::from_secs(2))[0]
        ["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        watch(
            &format!("resourceVersion={now}"),
            Duration::from_millis(500)
        )
        .is_empty()
    );

    // No version: the current objects, as ADDED.
    assert_eq!(
        types(&watch("", Duration::from_millis(500))),
        ["ADDED", "ADDED"]
    );

    // A streamed list: the current objects, then the bookmark that ends
    // them, at the current version; the watch goes on.
    let streamed = watch(
        "resourceVersion=0&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
        Duration::from_millis(300),
    );
    assert_eq!(
        types(&streamed),
        ["ADDED", "ADDED", "BOOKMARK"],
        "{streamed:?}"
    );
    let end = &streamed[2]["object"]["metadata"];
    assert_eq!(end["annotations"]["k8s.io/initial-events-end"], "true");
    assert_eq!(end["resourceVersion"], json!(now.to_string()));
    // Without resourceVersionMatch, or with the feature off: 422 Invalid.
    let refused = |q: &str| {
        let lines = watch(q, Duration::from_millis(500));
        (lines[0]["code"].clone(), lines[0]["reason"].clone())
    };
    let invalid = (json!(422), json!("Invalid"));
    assert_eq!(
        refused("allowWatchBookmarks=true&sendInitialEvents=true"),
        invalid
    );
    api.set_streaming_lists(StreamingLists::Refused);
    assert_eq!(
        refused(
            "allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
        ),
        invalid
    );
    // Ignored: a plain watch, the list never ended.
    api.set_streaming_lists(StreamingLists::Ignored);
    assert_eq!(
        types(&watch(
            "allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
            Duration::from_millis(300)
        )),
        ["ADDED", "ADDED"]
    );
    api.set_streaming_lists(StreamingLists::Served);

    // Expiry ends an open stream with 410.
    let ended = std::thread::scope(|s| {
        let h = s.spawn(|| watch(&format!("resourceVersion={now}"), Duration::from_secs(3)));
        std::thread::sleep(Duration::from_millis(300));
        api.expire_watches();
        h.join().unwrap()
    });
    assert_eq!(types(&ended), ["ERROR 410"], "{ended:?}");
    assert!(api.served().contains(&Served::Gone {
        kind: "namespaces",
        mid_stream: true
    }));
}

fn service_cidr(name: &str, cidrs: &[&str], ready: Option<bool>) -> Value {
    let mut v = json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": name}, "spec": {"cidrs": cidrs}});
    if let Some(ready) = ready {
        v["status"] = json!({"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }, "reason": "", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}]});
    }
    v
}

/// The Service ranges in the pinned `SERVICES` map.
fn service_ranges(c: &Conformance) -> Vec<String> {
    c.dump()["services"]
        .as_array()
        .unwrap_or_else(|| panic!("no services in the dump"))
        .iter()
        .filter(|s| s["range"] == true)
        .map(|s| s["prefix"].as_str().unwrap().to_owned())
        .collect()
}

/// The Service ranges come from the cluster's ServiceCIDRs (those whose
/// Ready is not False) and follow them while the agent runs, without a
/// restart; `--service-cidr` wins over them.
#[test]
fn the_service_ranges_follow_the_clusters_service_cidrs() {
    let mut c = Conformance::new("kcidr", Backend::Bpf);
    let mut objs = cluster_objects(&c, "");
    objs.push(service_cidr(
        "kubernetes",
        &["10.96.0.0/16", "fd00:96::/112"],
        Some(true),
    ));
    let api = FakeApi::start(&c.node().node, objs);
    let kubeconfig = c.dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kc = kubeconfig.to_str().unwrap().to_owned();
    c.start_daemon_with(19412, &[], &[("KUBECONFIG", &kc)]);
    assert_eq!(service_ranges(&c), ["10.96.0.0/16", "fd00:96::/112"]);

    // A new ServiceCIDR (not Ready yet: new) covers its range at once.
    api.apply(service_cidr("extra", &["10.97.0.0/16"], None));
    wait_for("a new ServiceCIDR", Duration::from_secs(5), || {
        service_ranges(&c).contains(&"10.97.0.0/16".to_owned())
    });
    // Ready False: it hands out no ClusterIP any more.
    api.apply(service_cidr("extra", &["10.97.0.0/16"], Some(false)));
    wait_for(
        "a ServiceCIDR no longer Ready",
        Duration::from_secs(5),
        || service_ranges(&c) == ["10.96.0.0/16", "fd00:96::/112"],
    );
    // Pod traffic is untouched throughout.
    c.check("no policy", |_, _, _, _| true);

    // The flag wins: ServiceCIDRs are not read at all.
    c.stop_daemon();
    let before = api.requests().len();
    c.start_daemon_with(
        19412,
        &["--service-cidr", "10.100.0.0/16"],
        &[("KUBECONFIG", &kc)],
    );
    assert_eq!(service_ranges(&c), ["10.100.0.0/16"]);
    let read: Vec<String> = api.requests()[before..]
        .iter()
        .filter(|r| r.contains("servicecidrs"))
        .cloned()
        .collect();
    assert!(read.is_empty(), "with --service-cidr: {read:?}");
}

/// A cluster without the ServiceCIDR API (before Kubernetes 1.33) answers
/// 404: the agent runs on without ranges, asks once, and does not retry.
#[test]
fn a_cluster_without_the_service_cidr_api_is_normal() {
    let mut c = Conformance::new("knocidr", Backend::Bpf);
    let api = FakeApi::start(&c.node().node, cluster_objects(&c, DENY_GAMMA));
    api.set_served("servicecidrs", false);
    let kubeconfig = c.dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kc = kubeconfig.to_str().unwrap().to_owned();
    c.start_daemon_with(19413, &[], &[("KUBECONFIG", &kc)]);
    c.check("deny gamma, without ServiceCIDRs", |f, t, _, _| {
        f == t || f == "(node)" || ns_of(t) != "gamma"
    });
    assert!(service_ranges(&c).is_empty());
    std::thread::sleep(Duration::from_secs(3));
    let asked = api
        .requests()
        .iter()
        .filter(|r| r.contains("servicecidrs"))
        .count();
    assert_eq!(asked, 1, "{:?}", api.requests());
}
