use super::*;
use policy_agent::cluster::{ObjectRef, backends};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn web() -> Manifests {
    let pod = |name: &str, node: &str, v4: &str, v6: &str, http: u16| {
        PodManifest::new("default", name, node, &[ip(v4), ip(v6)])
            .label("app", "web")
            .port("http", proto::TCP, http)
            .port("", proto::UDP, 5353)
    };
    Manifests {
        pods: vec![
            pod("web-a", "node-1", "10.244.1.10", "fd00:244:1::a", 8080),
            pod("web-b", "node-2", "10.244.2.10", "fd00:244:2::a", 8080),
            pod("web-c", "node-2", "10.244.2.11", "fd00:244:2::b", 8081),
            PodManifest::new("default", "other", "node-1", &[ip("10.244.1.20")]),
        ],
        services: vec![
            ServiceManifest::new("default", "web", &[ip("10.96.0.50"), ip("fd00:96::50")])
                .select("app", "web")
                .port("http", proto::TCP, 80, TargetPort::Name("http".into()))
                .port("dns", proto::UDP, 53, TargetPort::Number(5353))
                .node_port("http", 30080),
        ],
    }
}

#[test]
fn named_target_ports_resolve_per_pod_and_split_slices() {
    let m = web();
    let slices = m.slices();
    // Per family: pods with http=8080 in one slice, http=8081 in another.
    assert_eq!(slices.len(), 4, "{slices:#?}");
    assert!(
        slices
            .iter()
            .all(|s| { s.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL] == "web" })
    );
    let state = m.cluster_state("node-1", &[ip("192.168.200.1")]).unwrap();
    let svc = &state.services[&ObjectRef::new("default", "web")];
    assert_eq!(svc.cluster_ips.len(), 2);
    assert_eq!(svc.ports[0].node_port, Some(30080));
    let key = ObjectRef::new("default", "web");
    let got: Vec<String> = backends(&svc.ports[0], state.slices_of(&key), None)
        .iter()
        .map(|b| format!("{}:{} {}", b.address, b.port, b.pod.as_ref().unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            "10.244.1.10:8080 default/web-a",
            "10.244.2.10:8080 default/web-b",
            "10.244.2.11:8081 default/web-c",
            "fd00:244:1::a:8080 default/web-a",
            "fd00:244:2::a:8080 default/web-b",
            "fd00:244:2::b:8081 default/web-c",
        ]
    );
    assert_eq!(state.pods.len(), 4);
}

#[test]
fn conditions_follow_readiness_and_deletion_and_empty_services_get_a_placeholder() {
    let mut m = web();
    m.pod_mut("default/web-a").unwrap().ready = false;
    m.pod_mut("default/web-b").unwrap().terminating = true;
    let state = m.cluster_state("node-1", &[]).unwrap();
    let eps: Vec<_> = state
        .endpoint_slices
        .values()
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.address.is_ipv4())
        .map(|e| (e.address.to_string(), e.ready, e.serving, e.terminating))
        .collect();
    assert!(eps.contains(&("10.244.1.10".into(), false, false, false)));
    assert!(eps.contains(&("10.244.2.10".into(), false, true, true)));
    assert!(eps.contains(&("10.244.2.11".into(), true, true, false)));

    let mut none = web();
    none.pods.clear();
    let slices = none.slices();
    assert_eq!(slices.len(), 2);
    assert!(slices.iter().all(|s| s.endpoints.is_empty()));
    let yaml = none.to_yaml().unwrap();
    assert!(yaml.contains("apiVersion: discovery.k8s.io/v1"));
    assert!(yaml.contains("kind: EndpointSlice"));
    assert!(yaml.contains("addressType: IPv6"));
}
