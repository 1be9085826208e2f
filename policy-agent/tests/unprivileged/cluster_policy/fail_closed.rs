//! Malformed ClusterNetworkPolicies fail closed as the API says, and every
//! problem is reported with its field and what is enforced instead.
use policy_agent::policy::cluster_policy::{
    ClusterPolicyErrorKind as Kind, Decision, Effect, RuleMatch,
};
use policy_common::proto::{TCP, UDP};

use super::{cnp, house, pod_to_pod};

/// An Admin policy on gryffindor with one egress rule (indented as a list
/// item under `egress:`).
fn with_egress(rule: &str) -> String {
    format!(
        r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata:
  name: guard
spec:
  tier: Admin
  priority: 5
  subject:
    namespaces:
      matchLabels:
        conformance-house: gryffindor
  egress:
{rule}
"#
    )
}

/// What gryffindor -> ravenclaw TCP 8080 meets at gryffindor's egress.
fn egress_decision(yaml: &str) -> Decision {
    let p = cnp(yaml);
    pod_to_pod(
        std::slice::from_ref(&p),
        &house("gryffindor"),
        &house("ravenclaw"),
        TCP,
        8080,
        None,
        None,
    )
    .0
}

/// A rule (with ACTION for its action), what is wrong with it, and the
/// problem it must be reported with.
type Case = (&'static str, &'static str, fn(&Kind) -> bool);

#[test]
fn rules_with_fields_not_understood_fail_closed_by_action() {
    // (the rule, whether it is an Accept, the problem reported)
    let cases: &[Case] = &[
        // A peer with a field this version does not know (no known one).
        (
            "  - action: ACTION\n    to:\n    - ipAddresses: [\"10.0.0.0/8\"]\n",
            "unknown peer field",
            |k| matches!(k, Kind::UnknownField { name } if name == "ipAddresses"),
        ),
        // A peer with two fields.
        (
            "  - action: ACTION\n    to:\n    - networks: [\"10.0.0.0/8\"]\n      namespaces: {}\n",
            "two peer fields",
            |k| matches!(k, Kind::PeerNotOne),
        ),
        // An ingress-only list on an egress rule.
        (
            "  - action: ACTION\n    from:\n    - namespaces: {}\n",
            "from on an egress rule",
            |k| matches!(k, Kind::NoPeers | Kind::UnknownField { .. }),
        ),
        // No peers.
        ("  - action: ACTION\n    to: []\n", "empty to", |k| {
            matches!(k, Kind::NoPeers)
        }),
        // A CIDR that is not one.
        (
            "  - action: ACTION\n    to:\n    - networks: [\"10.0.0.300/8\"]\n",
            "bad CIDR",
            |k| matches!(k, Kind::BadCidr { .. }),
        ),
        // A protocol this version does not know.
        (
            "  - action: ACTION\n    to:\n    - namespaces: {}\n    protocols:\n    - icmp: {}\n",
            "unknown protocol",
            |k| {
                matches!(k, Kind::UnknownField { name } if name == "icmp")
                    || matches!(k, Kind::ProtocolNotOne)
            },
        ),
        // A range that does not increase, a port out of range.
        (
            "  - action: ACTION\n    to:\n    - namespaces: {}\n    protocols:\n    - tcp:\n        destinationPort:\n          range: {start: 90, end: 80}\n",
            "decreasing range",
            |k| matches!(k, Kind::RangeNotIncreasing { .. }),
        ),
        (
            "  - action: ACTION\n    to:\n    - namespaces: {}\n    protocols:\n    - udp:\n        destinationPort:\n          number: 70000\n",
            "port out of range",
            |k| matches!(k, Kind::PortOutOfRange { .. }),
        ),
        // A named port towards networks.
        (
            "  - action: ACTION\n    to:\n    - networks: [\"0.0.0.0/0\"]\n    protocols:\n    - destinationNamedPort: web\n",
            "named port to networks",
            |k| matches!(k, Kind::NamedPortWithoutPods),
        ),
    ];
    for (rule, what, problem) in cases {
        for action in ["Accept", "Deny", "Pass"] {
            let yaml = with_egress(&rule.replace("ACTION", action));
            let p = cnp(&yaml);
            assert!(
                p.errors.iter().any(|e| problem(&e.kind)),
                "{what} ({action}): {:?}",
                p.errors
            );
            let r = &p.egress[0];
            let got = egress_decision(&yaml);
            if action == "Accept" {
                // "treat the rule as matching no traffic"
                assert_eq!(r.matches, RuleMatch::Nothing, "{what} ({action})");
                assert_eq!(got, Decision::Default, "{what} ({action})");
                assert!(
                    p.errors
                        .iter()
                        .all(|e| e.effect == Effect::RuleMatchesNothing)
                );
            } else {
                // "treat the rule as a 'Deny all' rule"
                assert_eq!(r.matches, RuleMatch::Everything, "{what} ({action})");
                assert_eq!(got, Decision::AdminDeny, "{what} ({action})");
                assert!(p.errors.iter().all(|e| e.effect == Effect::RuleDeniesAll));
            }
        }
    }
}

#[test]
fn an_unknown_action_denies_all() {
    let yaml = with_egress("  - action: Allow\n    to:\n    - networks: [\"192.0.2.0/24\"]\n");
    let p = cnp(&yaml);
    assert!(matches!(&p.errors[0].kind, Kind::UnknownAction { value } if value == "Allow"));
    assert_eq!(egress_decision(&yaml), Decision::AdminDeny);
}

#[test]
fn domain_names_are_reported_and_match_nothing() {
    let yaml = with_egress(
        "  - action: Accept\n    to:\n    - domainNames: [\"example.com\"]\n    - networks: [\"0.0.0.0/0\"]\n",
    );
    let p = cnp(&yaml);
    assert!(
        p.errors
            .iter()
            .any(|e| matches!(e.kind, Kind::DomainNamesNotSupported))
    );
    assert_eq!(p.egress[0].matches, RuleMatch::Nothing);
    // On a Deny rule the API does not allow them: deny all.
    let yaml = with_egress("  - action: Deny\n    to:\n    - domainNames: [\"example.com\"]\n");
    assert_eq!(egress_decision(&yaml), Decision::AdminDeny);
}

/// A policy-level problem: Accept rules match nothing, Pass rules deny,
/// Deny rules stay; an unreadable subject is every pod.
#[test]
fn policy_level_problems_fail_closed() {
    let base = |tier: &str, priority: &str, subject: &str| {
        format!(
            r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata:
  name: broken
spec:
  tier: {tier}
  priority: {priority}
  subject: {subject}
  egress:
  - name: accept-dns
    action: Accept
    to:
    - namespaces: {{}}
    protocols:
    - udp:
        destinationPort:
          number: 53
  - name: pass-ravenclaw
    action: Pass
    to:
    - namespaces:
        matchLabels:
          conformance-house: ravenclaw
"#
        )
    };
    let good_subject = "{namespaces: {matchLabels: {conformance-house: gryffindor}}}";
    for (yaml, what) in [
        (base("Admin", "5", good_subject), "valid"),
        (base("Platform", "5", good_subject), "unknown tier"),
        (base("Admin", "1001", good_subject), "priority out of range"),
        (base("Admin", "5", "{}"), "no subject field"),
        (
            base("Admin", "5", "{namespaces: {}, pods: {podSelector: {}}}"),
            "two subject fields",
        ),
    ] {
        let p = cnp(&yaml);
        let valid = what == "valid";
        assert_eq!(p.errors.is_empty(), valid, "{what}: {:?}", p.errors);
        let dns = pod_to_pod(
            std::slice::from_ref(&p),
            &house("gryffindor"),
            &house("ravenclaw"),
            UDP,
            53,
            Some(false),
            None,
        )
        .0;
        let web = pod_to_pod(
            std::slice::from_ref(&p),
            &house("gryffindor"),
            &house("ravenclaw"),
            TCP,
            80,
            Some(true),
            None,
        )
        .0;
        if valid {
            assert_eq!(dns, Decision::AdminAccept, "{what}");
            assert_eq!(web, Decision::NetworkPolicy(true), "{what}");
        } else {
            assert!(
                p.errors
                    .iter()
                    .any(|e| e.effect == Effect::PolicyFailsClosed),
                "{what}"
            );
            // The Accept is gone: the NetworkPolicy tier's deny stands.
            assert_eq!(
                dns,
                Decision::AdminDeny,
                "{what}: the Pass turned Deny comes second"
            );
            assert_eq!(web, Decision::AdminDeny, "{what}");
        }
    }
    // An unreadable subject applies to every pod: hufflepuff too.
    let p = cnp(&base("Admin", "5", "{}"));
    let d = pod_to_pod(
        std::slice::from_ref(&p),
        &house("hufflepuff"),
        &house("ravenclaw"),
        TCP,
        80,
        None,
        None,
    )
    .0;
    assert_eq!(d, Decision::AdminDeny);
}

#[test]
fn more_rules_than_the_api_allows_fail_the_policy_closed() {
    let rule = "  - action: Accept\n    to:\n    - namespaces: {}\n";
    let yaml = with_egress(&rule.repeat(26));
    let p = cnp(&yaml);
    assert!(
        p.errors
            .iter()
            .any(|e| matches!(e.kind, Kind::TooMany { count: 26, max: 25 }))
    );
    assert!(p.egress.iter().all(|r| r.matches == RuleMatch::Nothing));
}
