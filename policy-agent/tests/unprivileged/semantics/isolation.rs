//! Isolation, the recipes of the NetworkPolicy documentation, empty vs
//! absent lists, policyTypes defaulting and the union of policies.
use crate::support::world::*;
use policy_common::direction::{EGRESS, INGRESS};

/// Two pods in "default" and one in "other", all local; an outside address.
fn world() -> World {
    let mut w = World::new();
    w.ns("other", &[("team", "b")]);
    w.pod("default/a", &[("app", "a")], &["10.0.0.1", "fd10::1"]);
    w.pod("default/b", &[("app", "b")], &["10.0.0.2", "fd10::2"]);
    w.pod("other/c", &[("app", "c")], &["10.0.1.3"]);
    w
}

const OUTSIDE: &str = "203.0.113.9";

#[test]
fn no_policy_allows_everything() {
    let run = world().compile();
    run.check(&[
        ("pod to pod", "default/a", "default/b", TCP, 80, ALLOW),
        ("across namespaces", "other/c", "default/a", UDP, 53, ALLOW),
        ("to outside", "default/a", OUTSIDE, TCP, 443, ALLOW),
        ("icmp", OUTSIDE, "default/b", ICMP, 0, ALLOW),
    ]);
    assert!(!run.isolated("default/a", INGRESS) && !run.isolated("default/a", EGRESS));
}

#[test]
fn default_deny_ingress() {
    let mut w = world();
    w.policy("metadata: {name: default-deny-ingress}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]");
    let run = w.compile();
    run.check(&[
        (
            "same namespace denied",
            "default/a",
            "default/b",
            TCP,
            80,
            DENY,
        ),
        (
            "other namespace denied",
            "other/c",
            "default/a",
            TCP,
            80,
            DENY,
        ),
        ("outside denied", OUTSIDE, "default/a", ICMP, 0, DENY),
        ("egress untouched", "default/a", OUTSIDE, TCP, 443, ALLOW),
        (
            "other namespace not isolated",
            "default/a",
            "other/c",
            TCP,
            80,
            ALLOW,
        ),
    ]);
    assert!(run.isolated("default/a", INGRESS) && !run.isolated("default/a", EGRESS));
}

#[test]
fn default_deny_egress() {
    let mut w = world();
    w.policy(
        "metadata: {name: default-deny-egress}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]",
    );
    let run = w.compile();
    run.check(&[
        (
            "pod to pod denied at the sender",
            "default/a",
            "default/b",
            TCP,
            80,
            DENY,
        ),
        ("to outside denied", "default/a", OUTSIDE, UDP, 53, DENY),
        ("ingress untouched", OUTSIDE, "default/a", TCP, 80, ALLOW),
        (
            "other namespace may send in",
            "other/c",
            "default/b",
            TCP,
            80,
            ALLOW,
        ),
    ]);
    assert!(!run.isolated("default/a", INGRESS) && run.isolated("default/a", EGRESS));
}

#[test]
fn default_deny_all() {
    let mut w = world();
    w.policy(
        "metadata: {name: deny-all}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]",
    );
    let run = w.compile();
    run.check(&[
        ("in denied", "other/c", "default/a", TCP, 80, DENY),
        ("out denied", "default/a", "other/c", TCP, 80, DENY),
        ("outside in denied", OUTSIDE, "default/b", TCP, 80, DENY),
    ]);
}

#[test]
fn allow_all_ingress_with_empty_rule() {
    let mut w = world();
    w.policy("metadata: {name: deny}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]");
    w.policy("metadata: {name: allow-all-ingress}\nspec:\n  podSelector: {}\n  ingress:\n  - {}\n  policyTypes: [Ingress]");
    let run = w.compile();
    run.check(&[
        ("any pod", "other/c", "default/a", TCP, 80, ALLOW),
        (
            "outside, any protocol",
            OUTSIDE,
            "default/a",
            ICMP,
            0,
            ALLOW,
        ),
        ("sctp", OUTSIDE, "default/b", SCTP, 9, ALLOW),
    ]);
    assert!(
        run.isolated("default/a", INGRESS),
        "allow-all still isolates (it just allows everything)"
    );
}

#[test]
fn allow_all_egress_with_empty_rule() {
    let mut w = world();
    w.policy("metadata: {name: deny}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]");
    w.policy("metadata: {name: allow-all-egress}\nspec:\n  podSelector: {}\n  egress:\n  - {}\n  policyTypes: [Egress]");
    let run = w.compile();
    run.check(&[
        ("to pod", "default/a", "other/c", TCP, 80, ALLOW),
        ("to outside, udp", "default/a", OUTSIDE, UDP, 53, ALLOW),
        ("to outside, icmp", "default/b", OUTSIDE, ICMP, 0, ALLOW),
    ]);
}

#[test]
fn from_absent_allows_every_peer_but_ports_restrict() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - ports: [{port: 80}]");
    let run = w.compile();
    run.check(&[
        ("pod on the port", "other/c", "default/a", TCP, 80, ALLOW),
        ("outside on the port", OUTSIDE, "default/a", TCP, 80, ALLOW),
        (
            "v6 outside on the port",
            "2001:db8::1",
            "default/a",
            TCP,
            80,
            ALLOW,
        ),
        ("other port", "other/c", "default/a", TCP, 81, DENY),
        (
            "not selected pod unaffected",
            "other/c",
            "default/b",
            TCP,
            81,
            ALLOW,
        ),
    ]);
}

#[test]
fn from_empty_allows_every_source() {
    // "If this field is empty or missing, this rule matches all sources."
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: []\n    ports: [{port: 80}]");
    let run = w.compile();
    assert!(run.isolated("default/a", INGRESS));
    run.check(&[
        ("pod on the port", "other/c", "default/a", TCP, 80, ALLOW),
        ("outside on the port", OUTSIDE, "default/a", TCP, 80, ALLOW),
        ("other port", "other/c", "default/a", TCP, 81, DENY),
        ("outside icmp", OUTSIDE, "default/a", ICMP, 0, DENY),
    ]);
}

#[test]
fn to_empty_allows_every_destination() {
    let mut w = world();
    w.policy(
        "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress:\n  - to: []",
    );
    let run = w.compile();
    assert!(
        run.isolated("default/a", EGRESS),
        "a non-empty egress list makes it an egress policy"
    );
    run.check(&[
        ("pod allowed", "default/a", "default/b", TCP, 80, ALLOW),
        ("outside allowed", "default/a", OUTSIDE, TCP, 80, ALLOW),
        ("outside icmp allowed", "default/a", OUTSIDE, ICMP, 0, ALLOW),
    ]);
}

#[test]
fn to_absent_allows_every_destination() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress:\n  - ports: [{port: 53, protocol: UDP}]");
    let run = w.compile();
    run.check(&[
        (
            "any pod on the port",
            "default/a",
            "other/c",
            UDP,
            53,
            ALLOW,
        ),
        ("outside on the port", "default/a", OUTSIDE, UDP, 53, ALLOW),
        ("other protocol", "default/a", OUTSIDE, TCP, 53, DENY),
    ]);
}

#[test]
fn ports_absent_and_ports_empty_both_mean_every_port_and_protocol() {
    for ports in ["", "\n    ports: []"] {
        let mut w = world();
        w.policy(&format!(
            "metadata: {{name: p}}\nspec:\n  podSelector: {{matchLabels: {{app: a}}}}\n  ingress:\n  - from: [{{podSelector: {{matchLabels: {{app: b}}}}}}]{ports}"
        ));
        let run = w.compile();
        run.check(&[
            ("tcp any port", "default/b", "default/a", TCP, 1234, ALLOW),
            ("udp", "default/b", "default/a", UDP, 53, ALLOW),
            ("sctp", "default/b", "default/a", SCTP, 7, ALLOW),
            ("icmp", "default/b", "default/a", ICMP, 0, ALLOW),
            (
                "peer still restricted",
                "other/c",
                "default/a",
                TCP,
                1234,
                DENY,
            ),
        ]);
    }
}

#[test]
fn ingress_list_empty_or_absent_means_no_allow_rules() {
    for ingress in ["", "\n  ingress: []"] {
        let mut w = world();
        w.policy(&format!(
            "metadata: {{name: p}}\nspec:\n  podSelector: {{}}{ingress}"
        ));
        let run = w.compile();
        run.check(&[("denied", "default/b", "default/a", TCP, 80, DENY)]);
        assert!(!run.isolated("default/a", EGRESS));
    }
}

#[test]
fn policy_types_absent_means_ingress_only_without_egress_rules() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}");
    let run = w.compile();
    assert!(run.isolated("default/a", INGRESS));
    assert!(!run.isolated("default/a", EGRESS));
}

#[test]
fn policy_types_absent_with_empty_egress_list_is_not_egress() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress: []");
    let run = w.compile();
    assert!(run.isolated("default/a", INGRESS));
    assert!(
        !run.isolated("default/a", EGRESS),
        "egress: [] adds no Egress type"
    );
    run.check(&[("egress open", "default/a", OUTSIDE, TCP, 80, ALLOW)]);
}

#[test]
fn policy_types_absent_with_egress_rules_is_ingress_and_egress() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress:\n  - to: [{podSelector: {matchLabels: {app: b}}}]");
    let run = w.compile();
    assert!(run.isolated("default/a", INGRESS) && run.isolated("default/a", EGRESS));
    run.check(&[
        ("allowed egress", "default/a", "default/b", TCP, 80, ALLOW),
        ("other egress", "default/a", OUTSIDE, TCP, 80, DENY),
        (
            "ingress isolated with no rule",
            "default/b",
            "default/a",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn policy_types_egress_only_ignores_ingress_rules() {
    let mut w = world();
    w.policy(
        "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Egress]\n  ingress:\n  - from: [{podSelector: {}}]\n  egress:\n  - to: [{podSelector: {}}]",
    );
    let run = w.compile();
    assert!(!run.isolated("default/a", INGRESS));
    run.check(&[
        ("ingress not isolated", OUTSIDE, "default/a", TCP, 80, ALLOW),
        (
            "egress to own namespace",
            "default/a",
            "default/b",
            TCP,
            80,
            ALLOW,
        ),
        ("egress elsewhere", "default/a", OUTSIDE, TCP, 80, DENY),
    ]);
}

#[test]
fn policies_are_unioned_per_direction() {
    let mut w = world();
    w.policy("metadata: {name: p1}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: b}}}]\n    ports: [{port: 80}]");
    w.policy("metadata: {name: p2}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {team: b}}}]\n    ports: [{port: 443}]");
    let run = w.compile();
    run.check(&[
        ("p1", "default/b", "default/a", TCP, 80, ALLOW),
        ("p2", "other/c", "default/a", TCP, 443, ALLOW),
        (
            "p1 peer on p2 port",
            "default/b",
            "default/a",
            TCP,
            443,
            DENY,
        ),
        ("p2 peer on p1 port", "other/c", "default/a", TCP, 80, DENY),
    ]);
}

#[test]
fn isolation_is_per_direction_and_per_pod() {
    let mut w = world();
    w.policy("metadata: {name: in-a}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Ingress]");
    w.policy("metadata: {name: out-b}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  policyTypes: [Egress]");
    let run = w.compile();
    run.check(&[
        ("a may send", "default/a", OUTSIDE, TCP, 80, ALLOW),
        ("nobody reaches a", OUTSIDE, "default/a", TCP, 80, DENY),
        ("b may receive", OUTSIDE, "default/b", TCP, 80, ALLOW),
        ("b may not send", "default/b", OUTSIDE, TCP, 80, DENY),
        (
            "b to a: both closed",
            "default/b",
            "default/a",
            TCP,
            80,
            DENY,
        ),
        (
            "a to b: both open",
            "default/a",
            "default/b",
            TCP,
            80,
            ALLOW,
        ),
    ]);
}

#[test]
fn pod_to_pod_needs_egress_of_sender_and_ingress_of_receiver() {
    let mut w = world();
    w.policy(
        "metadata: {name: deny-all}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]",
    );
    w.policy("metadata: {name: a-out}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{podSelector: {matchLabels: {app: b}}}]");
    let run = w.compile();
    run.check(&[(
        "egress alone is not enough",
        "default/a",
        "default/b",
        TCP,
        80,
        DENY,
    )]);
    w.policy("metadata: {name: b-in}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: a}}}]");
    let run = w.compile();
    run.check(&[
        ("both sides allow", "default/a", "default/b", TCP, 80, ALLOW),
        (
            "reverse is not allowed",
            "default/b",
            "default/a",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn node_addresses_are_always_allowed() {
    let mut w = world();
    w.policy(
        "metadata: {name: deny-all}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]",
    );
    let run = w.compile();
    run.check(&[
        ("kubelet probe", NODE_V4, "default/a", TCP, 8080, ALLOW),
        ("v6 node", NODE_V6, "default/a", TCP, 8080, ALLOW),
        ("pod to node", "default/a", NODE_V4, UDP, 53, ALLOW),
    ]);
    assert_eq!(
        run.reason("default/a", INGRESS, NODE_V4, TCP, 8080),
        policy_common::verdict::Reason::AllowNode
    );
}

#[test]
fn a_pod_may_always_talk_to_itself() {
    let mut w = world();
    w.policy(
        "metadata: {name: deny-all}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]",
    );
    let run = w.compile();
    run.check(&[
        ("self", "default/a", "default/a", TCP, 80, ALLOW),
        ("self, UDP", "default/a", "default/a", UDP, 53, ALLOW),
        ("self, ping", "default/a", "default/a", ICMP, 0, ALLOW),
        // The same pod is isolated both ways for anyone else.
        ("others in", "default/b", "default/a", TCP, 80, DENY),
        ("others out", "default/a", "default/b", TCP, 80, DENY),
    ]);
    // Passed by the datapath's own rule at the pod's egress hook, not by
    // a policy entry; arriving at its ingress hook, a source equal to the
    // destination proves nothing (anyone can forge it) and is judged.
    let a = ip("10.0.0.1");
    assert_eq!(
        run.classify("default/a", policy_common::direction::EGRESS, a, a, TCP, 80),
        policy_common::verdict::Reason::AllowSelf
    );
    assert!(run.classify("default/a", INGRESS, a, a, TCP, 80).is_drop());
}

#[test]
fn policies_only_select_pods_of_their_namespace() {
    let mut w = world();
    w.policy("metadata: {name: deny, namespace: other}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]");
    let run = w.compile();
    assert!(run.isolated("other/c", INGRESS));
    assert!(!run.isolated("default/a", INGRESS));
}

#[test]
fn egress_policy_on_the_receiver_does_not_restrict_what_it_receives() {
    let mut w = world();
    w.policy("metadata: {name: deny-out}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  policyTypes: [Egress]");
    let run = w.compile();
    run.check(&[("a to b", "default/a", "default/b", TCP, 80, ALLOW)]);
}
