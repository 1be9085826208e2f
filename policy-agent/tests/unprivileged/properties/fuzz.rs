//! No input makes the compiler panic; invalid policies are reported.
//!
//! - arbitrary JSON shaped loosely like a NetworkPolicy, and raw or
//!   mutated YAML, deserialized and compiled (full and incremental);
//! - structured manifests: valid NetworkPolicy documents (of the spec
//!   evaluator's generator) with fields removed, extra fields, values of
//!   the wrong type, huge lists and deep nesting, written as block or flow
//!   YAML (in a `List` sometimes), read by the agent's manifest loader; a
//!   floor on how many reach the compiler keeps the fuzzer from testing
//!   the YAML parser alone;
//! - the corpus (tests/corpus/policies/*.yaml): every tricky or invalid
//!   case found, replayed; `invalid_*.yaml` must report the field named on
//!   their first line (`# field: ...`), the others must compile cleanly,
//!   and all must agree with the spec evaluator on every flow.
use std::{collections::BTreeMap, fs, net::IpAddr, path::PathBuf};

use crate::support::oracle::{World, policy_valid};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use policy_agent::source::manifests::{LoadedManifests, load_text};
use policy_agent::{
    cluster::{Change, ClusterState, ContainerPort, NamespaceInfo, ObjectRef, PodFields},
    identity::IdentityAllocator,
    policy::{self, CompileOptions, Compiled, Compiler},
};
use policy_common::{direction, model::has_ports, proto};
use proptest::{
    prelude::*,
    test_runner::{Config, TestRunner},
};
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
            PodFields {
                labels: std::sync::Arc::new(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).into(), (*v).into()))
                        .collect(),
                ),
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
            }
            .into(),
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
    s.policies.insert(ObjectRef::new(ns, name), np.into());
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
            ..CompileOptions::default()
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
            ..CompileOptions::default()
        },
    );
    let (name, np) = state.policies.iter().next().unwrap();
    inc.apply([Change::UpsertPolicy(name.clone(), np.clone())], &mut ids2);
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
    let mut addrs: Vec<IpAddr> = state.pods.values().flat_map(|p| p.ips.to_vec()).collect();
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
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/unprivileged/corpus/policies");
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

// ------------------------------------------------------ structured manifests

/// One change to a valid document.
#[derive(Clone, Debug)]
enum Mutation {
    /// Remove the field at this (wrapping) position among all map entries.
    Remove(usize),
    /// Add an unknown field (possibly deeply nested) to the map here.
    Extra(usize, Value),
    /// Replace the value here with one of another type.
    WrongType(usize, Value),
    /// Grow the list here to this many items (repeating its first).
    Huge(usize, usize),
    /// Replace the value here with a deep nest of lists and maps.
    Deep(usize, usize),
}

/// Every (container, key) path in `v`: map entries by key, list items by
/// index.
fn paths(v: &Value, at: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                at.push(PathStep::Key(k.clone()));
                out.push(at.clone());
                paths(child, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                at.push(PathStep::Index(i));
                out.push(at.clone());
                paths(child, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone, Debug)]
enum PathStep {
    Key(String),
    Index(usize),
}

fn get_mut<'a>(v: &'a mut Value, path: &[PathStep]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, step| match step {
        PathStep::Key(k) => v.get_mut(k.as_str()),
        PathStep::Index(i) => v.get_mut(*i),
    })
}

fn nest(depth: usize) -> Value {
    (0..depth).fold(json!("bottom"), |inner, i| {
        if i % 2 == 0 {
            json!([inner])
        } else {
            json!({ "n": inner })
        }
    })
}

fn mutate(doc: &mut Value, m: &Mutation) {
    let mut all = Vec::new();
    paths(doc, &mut Vec::new(), &mut all);
    if all.is_empty() {
        return;
    }
    let pick = |i: usize| all[i % all.len()].clone();
    match m {
        Mutation::Remove(i) => {
            let path = pick(*i);
            if let Some((PathStep::Key(k), parent)) = path.split_last()
                && let Some(Value::Object(map)) = get_mut(doc, parent)
            {
                map.remove(k);
            }
        }
        Mutation::Extra(i, value) => {
            let path = pick(*i);
            if let Some(Value::Object(map)) = get_mut(doc, &path[..path.len() - 1]) {
                map.insert(format!("unknownField{i}"), value.clone());
            }
        }
        Mutation::WrongType(i, value) => {
            if let Some(slot) = get_mut(doc, &pick(*i)) {
                // Another type than it had.
                let same = std::mem::discriminant(slot) == std::mem::discriminant(value);
                *slot = if same {
                    json!({"wrong": [1, "two"]})
                } else {
                    value.clone()
                };
            }
        }
        Mutation::Huge(i, n) => {
            let lists: Vec<Vec<PathStep>> = all
                .iter()
                .filter(|p| matches!(get_mut(&mut doc.clone(), p), Some(Value::Array(a)) if !a.is_empty()))
                .cloned()
                .collect();
            if lists.is_empty() {
                return;
            }
            if let Some(Value::Array(a)) = get_mut(doc, &lists[i % lists.len()]) {
                let first = a[0].clone();
                a.resize(*n, first);
            }
        }
        Mutation::Deep(i, depth) => {
            if let Some(slot) = get_mut(doc, &pick(*i)) {
                *slot = nest(*depth);
            }
        }
    }
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let wrong = prop_oneof![
        Just(json!(80)),
        Just(json!("80")),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!(true)),
        Just(Value::Null),
        Just(json!("")),
        Just(json!([])),
        Just(json!({})),
        Just(json!(["TCP", 80])),
        Just(json!({"port": "http"})),
        Just(json!(18446744073709551615u64)),
    ];
    prop_oneof![
        3 => any::<usize>().prop_map(Mutation::Remove),
        3 => (any::<usize>(), prop_oneof![Just(json!("x")), Just(json!({"a": {"b": [1, 2, {"c": null}]}})), (1usize..130).prop_map(nest)])
            .prop_map(|(i, v)| Mutation::Extra(i, v)),
        3 => (any::<usize>(), wrong).prop_map(|(i, v)| Mutation::WrongType(i, v)),
        1 => (any::<usize>(), prop_oneof![Just(100usize), Just(500)]).prop_map(|(i, n)| Mutation::Huge(i, n)),
        1 => (any::<usize>(), prop_oneof![Just(20usize), Just(64), Just(130)]).prop_map(|(i, d)| Mutation::Deep(i, d)),
    ]
}

/// A NetworkPolicy manifest: a valid document of the spec evaluator's
/// generator, changed by 0-3 mutations, as block or flow YAML, alone or
/// inside a `List`.
fn manifest() -> impl Strategy<Value = String> {
    (
        crate::support::oracle::policy(&["default", "alice", "prod"]),
        proptest::collection::vec(mutation(), 0..=3),
        any::<bool>(),
        prop_oneof![4 => Just(false), 1 => Just(true)],
    )
        .prop_map(|(np, mutations, flow, in_list)| {
            let mut doc = serde_json::to_value(&np).unwrap();
            doc["apiVersion"] = json!("networking.k8s.io/v1");
            doc["kind"] = json!("NetworkPolicy");
            for m in &mutations {
                mutate(&mut doc, m);
            }
            if in_list {
                doc = json!({"apiVersion": "v1", "kind": "List", "items": [doc]});
            }
            // JSON is flow-style YAML.
            if flow {
                serde_json::to_string(&doc).unwrap()
            } else {
                serde_yaml::to_string(&doc).unwrap()
            }
        })
}

/// Structured manifests go through the agent's loader; whatever it reads
/// as a NetworkPolicy is compiled (full and incremental) and checked
/// against the spec evaluator, and enough of them must get that far.
#[test]
fn structured_manifests_reach_the_compiler() {
    const CASES: u32 = 256;
    let reached = std::sync::atomic::AtomicU32::new(0);
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&manifest(), |text| {
            let mut loaded = LoadedManifests::default();
            load_text(std::path::Path::new("fuzz.yaml"), &text, &mut loaded);
            // One document, one outcome at most (a List whose items were
            // mutated away holds nothing).
            prop_assert!(
                loaded.policies.len() + loaded.errors.len() <= 1,
                "one document, one outcome: {:?} {:?}",
                loaded.policies,
                loaded.errors
            );
            for (_, np) in &loaded.policies {
                let mut np = np.clone();
                // The corpus cluster's namespaces, named.
                np.metadata.name = Some("fuzz".into());
                let state = with_policy(np.clone());
                let c = compile_checked(np)?;
                // The spec evaluator walks every rule per flow: huge
                // documents are compiled and checked for errors only.
                if text.len() < 20_000 {
                    prop_assert!(
                        agrees_with_spec(&state, &c).is_ok(),
                        "{:?}",
                        agrees_with_spec(&state, &c)
                    );
                }
                reached.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            // The whole loader path too: no panic, problems named.
            let state = loaded.cluster_state("node-a", vec!["192.168.0.1".parse().unwrap()]);
            let _ = policy::compile(&state, &mut IdentityAllocator::new());
            Ok(())
        })
        .unwrap();
    let reached = reached.into_inner();
    // About half of the documents survive their mutations; a generator
    // that stopped producing parseable policies would test the parser only.
    assert!(
        reached >= CASES * 4 / 10,
        "only {reached} of {CASES} structured manifests reached the compiler"
    );
    eprintln!("{reached} of {CASES} structured manifests reached the compiler");
}
