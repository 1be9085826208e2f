use super::*;

#[test]
fn services_and_their_slices_are_read_and_a_bad_address_is_reported_on_its_field() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: http}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-x1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.0.0.5], conditions: {ready: true}}]
---
apiVersion: v1
kind: Service
metadata: {name: broken, namespace: shop}
spec: {clusterIP: not-an-ip, ports: [{port: 80}]}
"#;
    let mut out = LoadedManifests::default();
    load_text(Path::new("s.yaml"), text, &mut out);
    let state = out.cluster_state("n1", vec![]);
    let web = ObjectRef::new("shop", "web");
    assert_eq!(
        state.services[&web].cluster_ips,
        vec!["10.96.0.10".parse::<std::net::IpAddr>().unwrap()]
    );
    assert_eq!(state.slices_of(&web).count(), 1);
    // Kept, with what reads (its port), proxied at an address nobody
    // knows; the address is the problem, not the document.
    let broken_ref = ObjectRef::new("shop", "broken");
    let broken = &state.services[&broken_ref];
    assert!(broken.cluster_ips.is_empty() && broken.proxied());
    assert_eq!(broken.ports.len(), 1);
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let msgs: Vec<String> = broken
        .problems(&broken_ref)
        .map(|p| p.to_string())
        .collect();
    assert!(
        msgs.len() == 1
            && msgs[0].starts_with("service shop/broken: spec.clusterIP: \"not-an-ip\""),
        "{msgs:?}"
    );
}

#[test]
fn multi_document_files_unknown_kinds_and_bad_objects_are_reported_by_name() {
    let text = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: x, ports: [{name: http, containerPort: 80}]}]}
status: {podIP: 10.0.0.5}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
---
apiVersion: v1
kind: Pod
metadata: {name: bad, namespace: shop}
spec: {containers: "not a list"}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny, namespace: other}
spec: {podSelector: {}}
"#;
    let mut out = LoadedManifests::default();
    load_text(Path::new("a.yaml"), text, &mut out);
    assert_eq!(out.namespaces.len(), 1);
    assert_eq!(out.pods.len(), 1);
    assert_eq!(out.policies.len(), 1);
    assert_eq!(out.errors.len(), 2, "{:?}", out.errors);
    let msgs: Vec<String> = out.errors.iter().map(ToString::to_string).collect();
    assert!(
        msgs[0].contains("a.yaml (document 3)") && msgs[0].contains("Deployment"),
        "{}",
        msgs[0]
    );
    assert!(
        msgs[1].contains("a.yaml (document 4)") && msgs[1].contains("Pod shop/bad"),
        "{}",
        msgs[1]
    );
    let state = out.cluster_state("n1", vec![]);
    assert_eq!(state.pods.len(), 1);
    let pod = &state.pods[&ObjectRef::new("shop", "web")];
    assert_eq!(
        pod.ips[..],
        ["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]
    );
    assert_eq!(pod.ports[0].name.as_deref(), Some("http"));
    // "other" is implied by the policy and gets its name label.
    assert_eq!(
        state.namespaces["other"].labels["kubernetes.io/metadata.name"],
        "other"
    );
    assert_eq!(
        state.namespaces["shop"].labels["kubernetes.io/metadata.name"],
        "shop"
    );
}

#[test]
fn broken_yaml_names_the_file() {
    let mut out = LoadedManifests::default();
    load_text(Path::new("b.yml"), "kind: [unclosed\n", &mut out);
    assert!(
        matches!(&out.errors[0], ManifestError::Yaml { origin, .. } if origin.file == Path::new("b.yml"))
    );
}

#[test]
fn duplicates_keep_the_first_and_are_reported() {
    let pod =
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: d}\nspec: {containers: []}\n";
    let mut out = LoadedManifests::default();
    load_text(Path::new("1.yaml"), pod, &mut out);
    load_text(Path::new("2.yaml"), pod, &mut out);
    let state = out.cluster_state("n", vec![]);
    assert_eq!(state.pods.len(), 1);
    assert!(
        out.errors
            .iter()
            .any(|e| matches!(e, ManifestError::Duplicate { .. }))
    );
}
