//! No input makes the compiler panic; invalid policies are reported.
//!
//! - arbitrary JSON shaped loosely like a NetworkPolicy, and raw or
//!   mutated YAML, deserialized and compiled (full and incremental);
//! - the corpus (tests/corpus/policies/*.yaml): every tricky or invalid
//!   case found, replayed; `invalid_*.yaml` must report the field named on
//!   their first line (`# field: ...`), the others must compile cleanly,
//!   and all must agree with the spec evaluator on every flow.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod prop_oracle;

use std::{collections::BTreeMap, fs, net::IpAddr, path::PathBuf};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use policy_agent::{
    cluster::{Change, ClusterState, ContainerPort, NamespaceInfo, ObjectRef, PodInfo},
    identity::IdentityAllocator,
    policy::{self, CompileOptions, Compiled, Compiler},
};
use policy_common::{direction, model::has_ports, proto};
use prop_oracle::{World, policy_valid};
use proptest::prelude::*;
use serde_json::{Value, json};

/// A cluster for the corpus: pods in three namespaces, both families,
/// named ports, a remote pod.
fn corpus_cluster() -> ClusterState {
    let mut s = ClusterState {
        node_name: "node-a".into(),
        node_ips: vec!["192.168.0.1".parse().unwrap()],
        ..Default::default()
    };
    for (ns, labels) in [
        ("default", vec![]),
        ("alice", vec![("user", "alice"), ("project", "myproject")]),
        ("prod", vec![("user", "bob"), ("frozen", "yes")]),
    ] {
        let mut l: BTreeMap<String, String> = labels
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        l.insert("kubernetes.io/metadata.name".into(), ns.into());
        s.namespaces.insert(ns.into(), NamespaceInfo { labels: l });
    }
    // (namespace, name, labels, addresses, named ports, node)
    type Pod<'a> = (
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        &'a [&'a str],
        &'a [(&'a str, u8, u16)],
        &'a str,
    );
    let pods: &[Pod] = &[
        (
            "default",
            "db",
            &[("role", "db")],
            &["172.17.0.10", "fd10::10"],
            &[("http", proto::TCP, 6379)],
            "node-a",
        ),
        (
            "default",
            "frontend",
            &[("role", "frontend")],
            &["172.17.1.5", "fd10::11"],
            &[("http", proto::TCP, 8080)],
            "node-a",
        ),
        (
            "default",
            "client",
            &[("role", "client")],
            &["10.0.0.7"],
            &[("dns", proto::UDP, 53)],
            "node-a",
        ),
        (
            "alice",
            "client",
            &[("role", "client")],
            &["10.1.0.5"],
            &[("http", proto::TCP, 80)],
            "node-a",
        ),
        (
            "alice",
            "db",
            &[("role", "db"), ("tier", "legacy")],
            &["10.1.0.6"],
            &[],
            "node-b",
        ),
        (
            "prod",
            "client",
            &[("role", "client")],
            &["10.2.0.5", "fd10:1::5"],
            &[("http", proto::TCP, 8080)],
            "node-a",
        ),
    ];
    for (i, (ns, name, labels, ips, ports, node)) in pods.iter().enumerate() {
        s.pods.insert(
            ObjectRef::new(*ns, *name),
            PodInfo {
                labels: labels
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect(),
                node_name: Some((*node).into()),
                ips: ips.iter().map(|a| a.parse().unwrap()).collect(),
                ports: ports
                    .iter()
                    .map(|(n, p, port)| ContainerPort {
                        name: Some((*n).into()),
                        protocol: *p,
                        port: *port,
                    })
                    .collect(),
                created: i as i64,
                ..Default::default()
            },
        );
    }
    s
}

fn with_policy(np: NetworkPolicy) -> ClusterState {
    let mut s = corpus_cluster();
    let name = np.metadata.name.clone().unwrap_or_else(|| "unnamed".into());
    let ns = np
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    s.policies.insert(ObjectRef::new(ns, name), np);
    s
}

/// Compiles (full and incremental) and checks the outcome is sound.
fn compile_checked(np: NetworkPolicy) -> Result<Compiled, TestCaseError> {
    let state = with_policy(np.clone());
    let mut ids = IdentityAllocator::new();
    let full = policy::compile_with(
        &state,
        &mut ids,
        CompileOptions {
            all_pods_local: true,
        },
    );
    prop_assert_eq!(
        full.errors.is_empty(),
        policy_valid(&np),
        "errors: {:?}",
        full.errors
    );
    for e in &full.errors {
        prop_assert!(e.to_string().starts_with("networkpolicy "), "{}", e);
        prop_assert!(e.field().starts_with("spec."), "{}", e);
    }
    // The same policy arriving as a change to a running compiler.
    let mut ids2 = IdentityAllocator::new();
    let mut inc = Compiler::build(
        &corpus_cluster(),
        &mut ids2,
        CompileOptions {
            all_pods_local: true,
        },
    );
    let (name, np) = state.policies.iter().next().unwrap();
    inc.apply(
        [Change::UpsertPolicy(name.clone(), Box::new(np.clone()))],
        &mut ids2,
    );
    prop_assert_eq!(inc.maps(), &full.maps);
    Ok(full)
}

/// Every flow between the cluster's addresses agrees with the oracle.
fn agrees_with_spec(state: &ClusterState, c: &Compiled) -> Result<(), String> {
    let model = c.maps.to_model(|_| 0);
    let world = World::new(state, true);
    let owner: BTreeMap<IpAddr, ObjectRef> = c
        .local_pods
        .iter()
        .flat_map(|(p, ips)| ips.iter().map(move |ip| (*ip, p.clone())))
        .collect();
    let mut addrs: Vec<IpAddr> = state.pods.values().flat_map(|p| p.ips.clone()).collect();
    addrs.extend(
        [
            "172.17.1.1",
            "172.17.9.9",
            "10.0.0.200",
            "8.8.8.8",
            "2001:db8::1",
            "192.168.0.1",
        ]
        .map(|a| a.parse::<IpAddr>().unwrap()),
    );
    let flows = [
        (proto::TCP, 6379),
        (proto::TCP, 8080),
        (proto::TCP, 80),
        (proto::TCP, 5978),
        (proto::UDP, 53),
        (proto::UDP, 8003),
        (proto::SCTP, 9),
        (proto::TCP, 32768),
        (proto::ICMP, 0),
    ];
    for s in &addrs {
        for d in addrs
            .iter()
            .filter(|d| d.is_ipv4() == s.is_ipv4() && *d != s)
        {
            for (p, port) in flows {
                let port = if has_ports(p) { port } else { 0 };
                let mut got = true;
                if let Some(ep) = owner.get(s).and_then(|o| c.maps.endpoints.get(o)) {
                    got &= !model
                        .judge(ep, direction::EGRESS, *d, p, port)
                        .reason
                        .is_drop();
                }
                if let Some(ep) = owner.get(d).and_then(|o| c.maps.endpoints.get(o)) {
                    got &= !model
                        .judge(ep, direction::INGRESS, *s, p, port)
                        .reason
                        .is_drop();
                }
                let want = world.allows(*s, *d, p, port);
                if got != want {
                    return Err(format!(
                        "{s} -> {d} proto {p} port {port}: maps {got}, spec {want}"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn corpus() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/policies");
    let mut files: Vec<(String, String)> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn corpus_policies_compile_and_fail_closed() {
    let files = corpus();
    assert!(files.len() >= 30, "corpus went missing: {}", files.len());
    for (name, text) in files {
        let np: NetworkPolicy =
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let state = with_policy(np.clone());
        let c = compile_checked(np).unwrap_or_else(|e| panic!("{name}: {e}"));
        if name.starts_with("invalid_") {
            let field = text
                .lines()
                .next()
                .and_then(|l| l.strip_prefix("# field: "))
                .unwrap_or_else(|| panic!("{name}: first line must be '# field: ...'"));
            assert!(
                c.errors.iter().any(|e| e.field() == field),
                "{name}: want an error at {field}, got {:?}",
                c.errors.iter().map(ToString::to_string).collect::<Vec<_>>()
            );
        } else {
            assert!(c.errors.is_empty(), "{name}: {:?}", c.errors);
        }
        agrees_with_spec(&state, &c).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

// ------------------------------------------------------------ structured junk

fn leaf() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![
            Just(0i64),
            Just(-1),
            Just(80),
            Just(65535),
            Just(65536),
            Just(i64::from(i32::MAX) + 1),
            any::<i64>()
        ]
        .prop_map(Value::from),
        prop_oneof![
            Just("TCP"),
            Just("UDP"),
            Just("SCTP"),
            Just("tcp"),
            Just("http"),
            Just("In"),
            Just("NotIn"),
            Just("Exists"),
            Just("DoesNotExist"),
            Just("Ingress"),
            Just("Egress"),
            Just("10.0.0.0/8"),
            Just("10.0.0.0/33"),
            Just("::/0"),
            Just("fd00::/64"),
            Just(""),
            Just("0.0.0.0/0"),
            Just("a")
        ]
        .prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::from),
    ]
    .boxed()
}

fn maybe(v: impl Strategy<Value = Value> + 'static) -> BoxedStrategy<Option<Value>> {
    prop_oneof![3 => Just(None), 1 => leaf().prop_map(Some), 12 => v.prop_map(Some)].boxed()
}

fn obj(fields: Vec<(&'static str, Option<Value>)>) -> Value {
    Value::Object(
        fields
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v)))
            .collect(),
    )
}

fn list_of(v: impl Strategy<Value = Value> + 'static) -> BoxedStrategy<Value> {
    proptest::collection::vec(v, 0..3)
        .prop_map(Value::Array)
        .boxed()
}

fn selector_json() -> BoxedStrategy<Value> {
    let req = (maybe(leaf()), maybe(leaf()), maybe(list_of(leaf())))
        .prop_map(|(k, o, v)| obj(vec![("key", k), ("operator", o), ("values", v)]));
    (
        maybe(proptest::collection::btree_map("[a-z]{0,3}", leaf(), 0..3).prop_map(|m| json!(m))),
        maybe(list_of(req)),
    )
        .prop_map(|(l, e)| obj(vec![("matchLabels", l), ("matchExpressions", e)]))
        .boxed()
}

fn peer_json() -> BoxedStrategy<Value> {
    let block = (maybe(leaf()), maybe(list_of(leaf())))
        .prop_map(|(c, e)| obj(vec![("cidr", c), ("except", e)]));
    (maybe(selector_json()), maybe(selector_json()), maybe(block))
        .prop_map(|(p, n, b)| {
            obj(vec![
                ("podSelector", p),
                ("namespaceSelector", n),
                ("ipBlock", b),
            ])
        })
        .boxed()
}

fn port_json() -> BoxedStrategy<Value> {
    (maybe(leaf()), maybe(leaf()), maybe(leaf()))
        .prop_map(|(p, port, end)| obj(vec![("protocol", p), ("port", port), ("endPort", end)]))
        .boxed()
}

fn rule_json(peers: &'static str) -> BoxedStrategy<Value> {
    (maybe(list_of(peer_json())), maybe(list_of(port_json())))
        .prop_map(move |(f, p)| obj(vec![(peers, f), ("ports", p)]))
        .boxed()
}

fn policy_json() -> BoxedStrategy<Value> {
    (
        maybe(selector_json()),
        maybe(list_of(leaf())),
        maybe(list_of(rule_json("from"))),
        maybe(list_of(rule_json("to"))),
        prop_oneof![Just("default"), Just("alice")],
    )
        .prop_map(|(sel, types, ingress, egress, ns)| {
            json!({
                "metadata": {"name": "fuzz", "namespace": ns},
                "spec": obj(vec![("podSelector", sel), ("policyTypes", types), ("ingress", ingress), ("egress", egress)]),
            })
        })
        .boxed()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_policy_shaped_json_never_panics(v in policy_json()) {
        if let Ok(np) = serde_json::from_value::<NetworkPolicy>(v) {
            let state = with_policy(np.clone());
            let c = compile_checked(np)?;
            prop_assert!(agrees_with_spec(&state, &c).is_ok(), "{:?}", agrees_with_spec(&state, &c));
        }
    }

    #[test]
    fn garbage_yaml_never_panics(text in "\\PC{0,200}") {
        if let Ok(np) = serde_yaml::from_str::<NetworkPolicy>(&text) {
            compile_checked(np)?;
        }
    }

    #[test]
    fn mutated_corpus_never_panics(pick in 0usize..100, edits in proptest::collection::vec((0usize..4000, "\\PC{0,3}"), 1..4)) {
        let files = corpus();
        let mut text = files[pick % files.len()].1.clone();
        for (at, with) in edits {
            let mut at = at % (text.len() + 1);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            let end = (at + 2).min(text.len());
            let end = (end..=text.len()).find(|i| text.is_char_boundary(*i)).unwrap_or(text.len());
            text.replace_range(at..end, &with);
        }
        if let Ok(np) = serde_yaml::from_str::<NetworkPolicy>(&text) {
            compile_checked(np)?;
        }
    }
}
