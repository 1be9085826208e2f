//! Upstream conformance scenarios (kubernetes-sigs/network-policy-api,
//! conformance/tests), judged by the reference evaluator: each connection
//! the upstream test pokes, with the verdict it expects. The same
//! scenarios with real traffic on the simulated node follow once the
//! compiler writes tier entries.
use policy_agent::policy::cluster_policy::{ClusterNetworkPolicy, Decision, ParsedClusterPolicy};
use policy_common::proto::TCP;

use super::{cnp, house, passes, pod_to_pod};

pub const INGRESS_TCP: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata:
  name: ingress-tcp
spec:
  tier: Admin
  priority: 3
  subject:
    namespaces:
      matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-gryffindor
  ingress:
  - name: "allow-from-ravenclaw-everything"
    action: "Accept"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-ravenclaw
  - name: "deny-from-ravenclaw-everything"
    action: "Deny"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-ravenclaw
  - name: "pass-from-ravenclaw-everything"
    action: "Pass"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-ravenclaw
  - name: "deny-from-slytherin-at-port-80"
    action: "Deny"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-slytherin
    protocols:
      - tcp:
          destinationPort:
            number: 80
  - name: "pass-from-slytherin-at-port-80"
    action: "Pass"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-slytherin
    protocols:
      - tcp:
          destinationPort:
            number: 80
  - name: "allow-from-hufflepuff-at-port-80"
    action: "Accept"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-hufflepuff
    protocols:
      - tcp:
          destinationPort:
            number: 80
  - name: "deny-from-hufflepuff-everything-else"
    action: "Deny"
    from:
    - namespaces:
        matchLabels:
          kubernetes.io/metadata.name: network-policy-conformance-hufflepuff
"#;

/// The policy with ingress rules `a` and `b` swapped, as the upstream
/// subtests patch it.
fn swapped(yaml: &str, a: usize, b: usize) -> ParsedClusterPolicy {
    let mut wire: ClusterNetworkPolicy = serde_yaml::from_str(yaml).unwrap();
    wire.spec.ingress.as_mut().unwrap().swap(a, b);
    ParsedClusterPolicy::parse(&wire)
}

/// CNPAdminTierIngressTCP, its six subtests.
#[test]
fn cnp_admin_tier_ingress_tcp() {
    let (gryffindor, ravenclaw, hufflepuff, slytherin) = (
        house("gryffindor"),
        house("ravenclaw"),
        house("hufflepuff"),
        house("slytherin"),
    );
    let poke = |policy: &ParsedClusterPolicy, client, port| {
        passes(pod_to_pod(
            std::slice::from_ref(policy),
            client,
            &gryffindor,
            TCP,
            port,
            None,
            None,
        ))
    };
    let p = cnp(INGRESS_TCP);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    // "allow-ingress ... ensure rule ordering is respected": index 0
    // (Accept) before index 1 (Deny).
    assert!(poke(&p, &ravenclaw, 80));
    assert!(poke(&p, &ravenclaw, 8080));
    // "allow-ingress ... at the specified port": index 5, then index 6.
    assert!(poke(&p, &hufflepuff, 80));
    assert!(!poke(&p, &hufflepuff, 8080));
    // "deny-ingress ... rule ordering": rules 0 and 1 swapped.
    let p01 = swapped(INGRESS_TCP, 0, 1);
    assert!(!poke(&p01, &ravenclaw, 80));
    assert!(!poke(&p01, &ravenclaw, 8080));
    // "deny-ingress ... at the specified port": index 3; other ports
    // match no rule.
    assert!(!poke(&p, &slytherin, 80));
    assert!(poke(&p, &slytherin, 8080));
    // "pass-ingress ... rule ordering": rules 0 and 2 swapped; Pass goes
    // to the (empty) NetworkPolicy and Baseline tiers: allowed.
    let p02 = swapped(INGRESS_TCP, 0, 2);
    assert!(poke(&p02, &ravenclaw, 80));
    assert!(poke(&p02, &ravenclaw, 8080));
    // "pass-ingress ... at the specified port": rules 3 and 4 swapped.
    let p34 = swapped(INGRESS_TCP, 3, 4);
    assert!(poke(&p34, &slytherin, 80));
    assert!(poke(&p34, &slytherin, 8080));
}

pub const PASS_EXAMPLE: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata:
  name: pass-example
spec:
  tier: Admin
  priority: 10
  subject:
    namespaces:
      matchLabels:
          conformance-house: gryffindor
  ingress:
  - name: "deny-all-ingress-from-slytherin"
    action: "Deny"
    from:
    - namespaces:
        matchLabels:
          conformance-house: slytherin
  egress:
  - name: "deny-all-egress-to-slytherin"
    action: "Deny"
    to:
    - namespaces:
        matchLabels:
          conformance-house: slytherin
"#;

pub const BASELINE_DEFAULT: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata:
  name: default
spec:
  tier: Baseline
  priority: 10
  subject:
    namespaces:
      matchLabels:
          conformance-house: gryffindor
  ingress:
  - name: "deny-all-ingress-from-slytherin"
    action: "Deny"
    from:
    - namespaces:
        matchLabels:
          conformance-house: slytherin
  egress:
  - name: "deny-all-egress-to-slytherin"
    action: "Deny"
    to:
    - namespaces:
        matchLabels:
          conformance-house: slytherin
"#;

/// CNPAdminTierIntegration: Admin Deny, then Pass to the NetworkPolicy
/// `allow-gress-from-to-slytherin-to-gryffindor` (isolates gryffindor both
/// ways, allows slytherin), then with that NetworkPolicy deleted, Pass to
/// the Baseline Deny.
#[test]
fn cnp_admin_tier_integration() {
    let (gryffindor, slytherin) = (house("gryffindor"), house("slytherin"));
    let mut wire: ClusterNetworkPolicy = serde_yaml::from_str(PASS_EXAMPLE).unwrap();
    let policies = vec![ParsedClusterPolicy::parse(&wire), cnp(BASELINE_DEFAULT)];
    // The NetworkPolicy allows slytherin at gryffindor's ingress and egress.
    let np = Some(true);
    // "Should Deny traffic from slytherin to gryffindor respecting admin CNP"
    let d = pod_to_pod(&policies, &slytherin, &gryffindor, TCP, 80, None, np);
    assert_eq!(d.1, Decision::AdminDeny);
    // "Should Deny traffic to slytherin from gryffindor respecting admin CNP"
    let d = pod_to_pod(&policies, &gryffindor, &slytherin, TCP, 80, np, None);
    assert_eq!(d.0, Decision::AdminDeny);
    // "pass-ingress ... respect the match for network policy"
    wire.spec.ingress.as_mut().unwrap()[0].action = Some("Pass".into());
    wire.spec.egress.as_mut().unwrap()[0].action = Some("Pass".into());
    let policies = vec![ParsedClusterPolicy::parse(&wire), cnp(BASELINE_DEFAULT)];
    let d = pod_to_pod(&policies, &slytherin, &gryffindor, TCP, 80, None, np);
    assert_eq!(d.1, Decision::NetworkPolicy(true));
    assert!(passes(d));
    // "pass-egress ... respect the match for network policy"
    let d = pod_to_pod(&policies, &gryffindor, &slytherin, TCP, 80, np, None);
    assert_eq!(d.0, Decision::NetworkPolicy(true));
    assert!(passes(d));
    // The NetworkPolicy deleted: "respect the match for baseline cluster
    // network policy".
    let d = pod_to_pod(&policies, &slytherin, &gryffindor, TCP, 80, None, None);
    assert_eq!(d.1, Decision::BaselineDeny);
    let d = pod_to_pod(&policies, &gryffindor, &slytherin, TCP, 80, None, None);
    assert_eq!(d.0, Decision::BaselineDeny);
}
