//! explain: the verdict from the maps and the reasons from the rules.
use crate::support::world::*;
use policy_agent::{
    mapstate::identity_addresses,
    policy::{self, ExplainError, ExplainQuery, FlowEnd},
};
use policy_common::identity::WORLD;

fn world() -> World {
    let mut w = World::new();
    w.ns("other", &[("team", "x")]);
    w.pod("default/web", &[("app", "web")], &["10.0.0.10"])
        .ports = vec![named_port("http", TCP, 8080)].into();
    w.pod("default/client", &[("app", "client")], &["10.0.0.11"]);
    w.pod("other/x", &[("app", "x")], &["10.0.1.1"]).node_name = Some("node-b".into());
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: nobody}}}, {podSelector: {matchLabels: {app: client}}}]\n    ports: [{port: 22}, {port: http}]");
    w.policy("metadata: {name: broken}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - ports: [{port: 0}]");
    w
}

fn q(src: &str, dst: &str, protocol: u8, port: u16) -> ExplainQuery {
    let end = |s: &str| match s.parse() {
        Ok(a) => FlowEnd::Ip(a),
        Err(_) => FlowEnd::Pod(obj(s)),
    };
    ExplainQuery {
        src: end(src),
        dst: end(dst),
        protocol,
        port,
    }
}

#[test]
fn allowed_flow_names_the_policy_rule_peer_and_port() {
    let mut w = world();
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/client", "default/web", TCP, 8080),
    )
    .unwrap();
    assert!(ex.allowed && ex.consistent());
    let ing = ex.ingress.as_ref().expect("web is local");
    assert!(ing.isolated);
    assert_eq!(ing.map_reason, "allow_policy");
    let web = ing
        .policies
        .iter()
        .find(|p| p.policy == "default/web")
        .unwrap();
    assert_eq!(web.matched_rules.len(), 1);
    assert_eq!(web.matched_rules[0].rule_index, 0);
    assert_eq!(
        web.matched_rules[0].peers,
        vec!["from[1] selector".to_owned()]
    );
    assert_eq!(
        web.matched_rules[0].ports,
        vec!["ports[1] TCP \"http\" = 8080".to_owned()]
    );
    let broken = ing
        .policies
        .iter()
        .find(|p| p.policy == "default/broken")
        .unwrap();
    assert!(!broken.valid && broken.matched_rules.is_empty());
    let key = ing.matched_key.as_ref().unwrap();
    assert_eq!(
        (key.port, key.port_prefix_len, key.present),
        (8080, 16, true)
    );
    assert_eq!(key.rule.as_deref(), Some("default/web ingress[0]"));
    assert_eq!(key.peer_identity, ex.src.identity);
    let text = ex.to_string();
    assert!(text.starts_with("flow TCP port 8080: ALLOWED"), "{text}");
    assert!(text.contains("ingress at default/web"), "{text}");
    assert!(
        text.contains("policy default/broken (INVALID: allows nothing)"),
        "{text}"
    );
    assert!(
        text.contains("error: networkpolicy default/broken: spec.ingress[0].ports[0].port"),
        "{text}"
    );
}

#[test]
fn dropped_flow_lists_the_probes() {
    let mut w = world();
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/client", "default/web", TCP, 80),
    )
    .unwrap();
    assert!(!ex.allowed && ex.consistent());
    let ing = ex.ingress.as_ref().unwrap();
    assert_eq!(ing.map_reason, "drop_policy");
    assert!(ing.matched_key.is_none());
    assert!(!ing.probed.is_empty() && ing.probed.iter().all(|k| !k.present));
    assert!(
        ing.probed
            .iter()
            .any(|k| k.peer_identity == ex.src.identity && k.port == 80)
    );
    assert!(
        ing.probed.iter().all(|k| k.peer_identity != WORLD),
        "no entry of web names an address class, so none is probed"
    );
    assert!(ing.policies.iter().all(|p| p.matched_rules.is_empty()));
    assert!(
        ex.to_string()
            .starts_with("flow TCP port 80: DROPPED at ingress of default/web"),
        "{ex}"
    );
    // Once an ipBlock names a class, the address's class is probed too.
    w.policy("metadata: {name: block}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{ipBlock: {cidr: 192.0.2.0/24}}]");
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/client", "default/web", TCP, 80),
    )
    .unwrap();
    let ing = ex.ingress.as_ref().unwrap();
    assert_eq!(ing.map_reason, "drop_policy");
    assert!(
        ing.probed.iter().any(|k| k.peer_identity == WORLD),
        "the class of the address is probed too: {:?}",
        ing.probed
    );
}

#[test]
fn egress_side_is_reported_when_the_source_is_local() {
    let mut w = world();
    w.policy("metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/24}}]");
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/client", "default/web", TCP, 22),
    )
    .unwrap();
    assert!(ex.allowed && ex.consistent());
    let eg = ex.egress.as_ref().unwrap();
    assert_eq!(
        eg.policies[0].matched_rules[0].peers,
        vec!["to[0] ipBlock 10.0.0.0/24".to_owned()]
    );
    assert!(ex.ingress.is_some());
}

#[test]
fn remote_pods_are_not_judged_unless_all_pods_are_local() {
    let mut w = world();
    w.policy(
        "metadata: {name: x, namespace: other}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]",
    );
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/client", "other/x", TCP, 80),
    )
    .unwrap();
    assert!(ex.allowed && ex.ingress.is_none());
    assert!(
        ex.notes
            .iter()
            .any(|n| n.contains("other/x is not a local endpoint")),
        "{:?}",
        ex.notes
    );
    let all = w.compile_all_local();
    let ex = policy::explain(
        &all.state,
        &all.compiled,
        &q("default/client", "other/x", TCP, 80),
    )
    .unwrap();
    assert!(!ex.allowed && ex.consistent());
}

#[test]
fn explanation_serializes_to_json() {
    let mut w = world();
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("203.0.113.5", "default/web", UDP, 53),
    )
    .unwrap();
    let json = serde_json::to_value(&ex).unwrap();
    assert_eq!(json["allowed"], false);
    assert_eq!(json["protocol"], "UDP");
    assert_eq!(json["src"]["cidr_identity"], WORLD);
    assert_eq!(json["ingress"]["endpoint"], "default/web");
    assert_eq!(json["ingress"]["map_reason"], "drop_policy");
}

#[test]
fn node_and_self_are_explained() {
    let mut w = world();
    let run = w.compile();
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q(NODE_V4, "default/web", TCP, 1),
    )
    .unwrap();
    assert!(ex.allowed && ex.src.node);
    assert_eq!(ex.ingress.as_ref().unwrap().map_reason, "allow_node");
    let ex = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/web", "default/web", TCP, 1),
    )
    .unwrap();
    assert!(ex.allowed && ex.notes[0].contains("itself"));
}

#[test]
fn unknown_pods_and_missing_addresses_are_errors() {
    let mut w = world();
    w.pod("default/pending", &[], &[]);
    let run = w.compile();
    let err = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/nope", "default/web", TCP, 1),
    )
    .unwrap_err();
    assert_eq!(err, ExplainError::UnknownPod(obj("default/nope")));
    let err = policy::explain(
        &run.state,
        &run.compiled,
        &q("default/pending", "default/web", TCP, 1),
    )
    .unwrap_err();
    assert_eq!(err, ExplainError::NoAddress(obj("default/pending")));
    let err = policy::explain(
        &run.state,
        &run.compiled,
        &q("fd00::9", "default/web", TCP, 1),
    )
    .unwrap_err();
    assert!(matches!(err, ExplainError::FamilyMismatch { .. }));
}

#[test]
fn identity_addresses_cover_pods_classes_and_world() {
    let mut w = world();
    w.policy("metadata: {name: blocks}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  ingress:\n  - from: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/16]}}]");
    let run = w.compile();
    let sets = identity_addresses(&run.compiled.maps);
    let web = run.identity_of("default/web");
    assert_eq!(sets[&web].include, vec!["10.0.0.10/32".parse().unwrap()]);
    let class8 = run.model().ipcache_lookup(ip("10.9.9.9")).cidr_identity;
    assert_eq!(sets[&class8].include, vec!["10.0.0.0/8".parse().unwrap()]);
    assert_eq!(sets[&class8].exclude, vec!["10.0.0.0/16".parse().unwrap()]);
    assert_eq!(sets[&WORLD].exclude, vec!["10.0.0.0/8".parse().unwrap()]);
}

/// A Service with two backends, one of which the client's egress allows:
/// explained per backend, on each backend's own target port.
#[test]
fn a_service_flow_is_explained_per_backend_after_dnat() {
    use policy_agent::cluster::{Endpoint, EndpointSliceInfo, ServiceInfo, ServicePort, SlicePort};
    let mut w = World::new();
    w.pod("default/client", &[("app", "client")], &["10.0.0.11"]);
    w.pod(
        "default/db-a",
        &[("app", "db"), ("tier", "a")],
        &["10.0.0.20"],
    );
    w.pod(
        "default/db-b",
        &[("app", "db"), ("tier", "b")],
        &["10.0.0.21"],
    );
    w.policy("metadata: {name: client-out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{podSelector: {matchLabels: {tier: a}}}]\n    ports: [{port: 5432}]");
    let svc = obj("default/db");
    w.state.services.insert(
        svc.clone(),
        ServiceInfo {
            cluster_ips: vec![ip("10.96.0.50")],
            ports: vec![ServicePort {
                name: "pg".into(),
                protocol: TCP,
                port: 80,
                node_port: None,
            }],
            ..ServiceInfo::default()
        },
    );
    let endpoint = |addr: &str, pod: &str| Endpoint {
        address: ip(addr),
        ready: true,
        serving: true,
        terminating: false,
        node: Some(NODE.into()),
        pod: Some(obj(pod)),
    };
    w.state.endpoint_slices.insert(
        obj("default/db-1"),
        EndpointSliceInfo {
            service: Some(svc.clone()),
            ports: vec![SlicePort {
                name: "pg".into(),
                protocol: TCP,
                port: 5432,
            }],
            endpoints: vec![
                endpoint("10.0.0.20", "default/db-a"),
                endpoint("10.0.0.21", "default/db-b"),
            ],
            unreadable: Vec::new(),
        },
    );
    let run = w.compile_all_local();
    let q = policy::ServiceQuery {
        src: FlowEnd::Pod(obj("default/client")),
        service: svc.clone(),
        protocol: TCP,
        port: 80,
    };
    let e = policy::explain_service(&run.state, &run.compiled, &q).unwrap();
    let verdicts: Vec<(String, u16, bool)> = e
        .backends
        .iter()
        .map(|b| (b.address.to_string(), b.port, b.explanation.allowed))
        .collect();
    assert_eq!(
        verdicts,
        [
            ("10.0.0.20".to_owned(), 5432, true),
            ("10.0.0.21".to_owned(), 5432, false)
        ],
        "judged on each backend at the target port, not on the ClusterIP at the Service port"
    );
    assert!(e.allowed_any && !e.allowed_all);
    let text = e.to_string();
    assert!(text.contains("ALLOWED on some backends only"), "{text}");
    let wrong_port = policy::ServiceQuery { port: 81, ..q };
    assert!(matches!(
        policy::explain_service(&run.state, &run.compiled, &wrong_port),
        Err(policy::ServiceExplainError::NoSuchPort { .. })
    ));
}
