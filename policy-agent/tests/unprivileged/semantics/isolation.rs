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

const A: &str = "default/a";
const B: &str = "default/b";
const C: &str = "other/c";
const OUTSIDE: &str = "203.0.113.9";

#[test]
fn default_deny_and_allow_all_recipes() {
    check_cases(
        world,
        &[
            Case {
                name: "no_policy_allows_everything",
                flows: &[
                    ("pod to pod", A, B, TCP, 80, ALLOW),
                    ("across namespaces", C, A, UDP, 53, ALLOW),
                    ("to outside", A, OUTSIDE, TCP, 443, ALLOW),
                    ("icmp", OUTSIDE, B, ICMP, 0, ALLOW),
                ],
                isolated: &[(A, INGRESS, false), (A, EGRESS, false)],
                ..Case::default()
            },
            Case {
                name: "default_deny_ingress",
                policies: &[
                    "metadata: {name: default-deny-ingress}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]",
                ],
                flows: &[
                    ("same namespace denied", A, B, TCP, 80, DENY),
                    ("other namespace denied", C, A, TCP, 80, DENY),
                    ("outside denied", OUTSIDE, A, ICMP, 0, DENY),
                    ("egress untouched", A, OUTSIDE, TCP, 443, ALLOW),
                    ("other namespace not isolated", A, C, TCP, 80, ALLOW),
                ],
                isolated: &[(A, INGRESS, true), (A, EGRESS, false)],
                ..Case::default()
            },
            Case {
                name: "default_deny_egress",
                policies: &[
                    "metadata: {name: default-deny-egress}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]",
                ],
                flows: &[
                    ("pod to pod denied at the sender", A, B, TCP, 80, DENY),
                    ("to outside denied", A, OUTSIDE, UDP, 53, DENY),
                    ("ingress untouched", OUTSIDE, A, TCP, 80, ALLOW),
                    ("other namespace may send in", C, B, TCP, 80, ALLOW),
                ],
                isolated: &[(A, INGRESS, false), (A, EGRESS, true)],
                ..Case::default()
            },
            Case {
                name: "default_deny_all",
                policies: &[
                    "metadata: {name: deny-all}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]",
                ],
                flows: &[
                    ("in denied", C, A, TCP, 80, DENY),
                    ("out denied", A, C, TCP, 80, DENY),
                    ("outside in denied", OUTSIDE, B, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "allow_all_ingress_with_empty_rule",
                policies: &[
                    "metadata: {name: deny}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]",
                    "metadata: {name: allow-all-ingress}\nspec:\n  podSelector: {}\n  ingress:\n  - {}\n  policyTypes: [Ingress]",
                ],
                flows: &[
                    ("any pod", C, A, TCP, 80, ALLOW),
                    ("outside, any protocol", OUTSIDE, A, ICMP, 0, ALLOW),
                    ("sctp", OUTSIDE, B, SCTP, 9, ALLOW),
                ],
                // Allow-all still isolates (it just allows everything).
                isolated: &[(A, INGRESS, true)],
                ..Case::default()
            },
            Case {
                name: "allow_all_egress_with_empty_rule",
                policies: &[
                    "metadata: {name: deny}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]",
                    "metadata: {name: allow-all-egress}\nspec:\n  podSelector: {}\n  egress:\n  - {}\n  policyTypes: [Egress]",
                ],
                flows: &[
                    ("to pod", A, C, TCP, 80, ALLOW),
                    ("to outside, udp", A, OUTSIDE, UDP, 53, ALLOW),
                    ("to outside, icmp", B, OUTSIDE, ICMP, 0, ALLOW),
                ],
                ..Case::default()
            },
        ],
    );
}

/// What `from: [{podSelector: {matchLabels: {app: b}}}]` on pod a allows
/// with its ports absent or empty: every port and protocol.
const EVERY_PORT_FROM_B: &[Flow] = &[
    ("tcp any port", B, A, TCP, 1234, ALLOW),
    ("udp", B, A, UDP, 53, ALLOW),
    ("sctp", B, A, SCTP, 7, ALLOW),
    ("icmp", B, A, ICMP, 0, ALLOW),
    ("peer still restricted", C, A, TCP, 1234, DENY),
];

#[test]
fn empty_and_absent_lists() {
    check_cases(
        world,
        &[
            Case {
                name: "from_absent_allows_every_peer_but_ports_restrict",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - ports: [{port: 80}]",
                ],
                flows: &[
                    ("pod on the port", C, A, TCP, 80, ALLOW),
                    ("outside on the port", OUTSIDE, A, TCP, 80, ALLOW),
                    ("v6 outside on the port", "2001:db8::1", A, TCP, 80, ALLOW),
                    ("other port", C, A, TCP, 81, DENY),
                    ("not selected pod unaffected", C, B, TCP, 81, ALLOW),
                ],
                ..Case::default()
            },
            // "If this field is empty or missing, this rule matches all sources."
            Case {
                name: "from_empty_allows_every_source",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: []\n    ports: [{port: 80}]",
                ],
                flows: &[
                    ("pod on the port", C, A, TCP, 80, ALLOW),
                    ("outside on the port", OUTSIDE, A, TCP, 80, ALLOW),
                    ("other port", C, A, TCP, 81, DENY),
                    ("outside icmp", OUTSIDE, A, ICMP, 0, DENY),
                ],
                isolated: &[(A, INGRESS, true)],
                ..Case::default()
            },
            Case {
                name: "to_empty_allows_every_destination",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress:\n  - to: []",
                ],
                flows: &[
                    ("pod allowed", A, B, TCP, 80, ALLOW),
                    ("outside allowed", A, OUTSIDE, TCP, 80, ALLOW),
                    ("outside icmp allowed", A, OUTSIDE, ICMP, 0, ALLOW),
                ],
                // A non-empty egress list makes it an egress policy.
                isolated: &[(A, EGRESS, true)],
                ..Case::default()
            },
            Case {
                name: "to_absent_allows_every_destination",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress:\n  - ports: [{port: 53, protocol: UDP}]",
                ],
                flows: &[
                    ("any pod on the port", A, C, UDP, 53, ALLOW),
                    ("outside on the port", A, OUTSIDE, UDP, 53, ALLOW),
                    ("other protocol", A, OUTSIDE, TCP, 53, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "ports_absent_and_ports_empty_both_mean_every_port_and_protocol: absent",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: b}}}]",
                ],
                flows: EVERY_PORT_FROM_B,
                ..Case::default()
            },
            Case {
                name: "ports_absent_and_ports_empty_both_mean_every_port_and_protocol: empty",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: b}}}]\n    ports: []",
                ],
                flows: EVERY_PORT_FROM_B,
                ..Case::default()
            },
            Case {
                name: "ingress_list_empty_or_absent_means_no_allow_rules: absent",
                policies: &["metadata: {name: p}\nspec:\n  podSelector: {}"],
                flows: &[("denied", B, A, TCP, 80, DENY)],
                isolated: &[(A, EGRESS, false)],
                ..Case::default()
            },
            Case {
                name: "ingress_list_empty_or_absent_means_no_allow_rules: empty",
                policies: &["metadata: {name: p}\nspec:\n  podSelector: {}\n  ingress: []"],
                flows: &[("denied", B, A, TCP, 80, DENY)],
                isolated: &[(A, EGRESS, false)],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn policy_types_defaulting() {
    check_cases(
        world,
        &[
            Case {
                name: "policy_types_absent_means_ingress_only_without_egress_rules",
                policies: &["metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}"],
                isolated: &[(A, INGRESS, true), (A, EGRESS, false)],
                ..Case::default()
            },
            Case {
                name: "policy_types_absent_with_empty_egress_list_is_not_egress",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress: []",
                ],
                flows: &[("egress open", A, OUTSIDE, TCP, 80, ALLOW)],
                // `egress: []` adds no Egress type.
                isolated: &[(A, INGRESS, true), (A, EGRESS, false)],
                ..Case::default()
            },
            Case {
                name: "policy_types_absent_with_egress_rules_is_ingress_and_egress",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  egress:\n  - to: [{podSelector: {matchLabels: {app: b}}}]",
                ],
                flows: &[
                    ("allowed egress", A, B, TCP, 80, ALLOW),
                    ("other egress", A, OUTSIDE, TCP, 80, DENY),
                    ("ingress isolated with no rule", B, A, TCP, 80, DENY),
                ],
                isolated: &[(A, INGRESS, true), (A, EGRESS, true)],
                ..Case::default()
            },
            Case {
                name: "policy_types_egress_only_ignores_ingress_rules",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Egress]\n  ingress:\n  - from: [{podSelector: {}}]\n  egress:\n  - to: [{podSelector: {}}]",
                ],
                flows: &[
                    ("ingress not isolated", OUTSIDE, A, TCP, 80, ALLOW),
                    ("egress to own namespace", A, B, TCP, 80, ALLOW),
                    ("egress elsewhere", A, OUTSIDE, TCP, 80, DENY),
                ],
                isolated: &[(A, INGRESS, false)],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn policies_apply_per_pod_and_direction_and_add_up() {
    check_cases(
        world,
        &[
            Case {
                name: "policies_are_unioned_per_direction",
                policies: &[
                    "metadata: {name: p1}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: b}}}]\n    ports: [{port: 80}]",
                    "metadata: {name: p2}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {team: b}}}]\n    ports: [{port: 443}]",
                ],
                flows: &[
                    ("p1", B, A, TCP, 80, ALLOW),
                    ("p2", C, A, TCP, 443, ALLOW),
                    ("p1 peer on p2 port", B, A, TCP, 443, DENY),
                    ("p2 peer on p1 port", C, A, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "isolation_is_per_direction_and_per_pod",
                policies: &[
                    "metadata: {name: in-a}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Ingress]",
                    "metadata: {name: out-b}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  policyTypes: [Egress]",
                ],
                flows: &[
                    ("a may send", A, OUTSIDE, TCP, 80, ALLOW),
                    ("nobody reaches a", OUTSIDE, A, TCP, 80, DENY),
                    ("b may receive", OUTSIDE, B, TCP, 80, ALLOW),
                    ("b may not send", B, OUTSIDE, TCP, 80, DENY),
                    ("b to a: both closed", B, A, TCP, 80, DENY),
                    ("a to b: both open", A, B, TCP, 80, ALLOW),
                ],
                ..Case::default()
            },
            Case {
                name: "policies_only_select_pods_of_their_namespace",
                policies: &[
                    "metadata: {name: deny, namespace: other}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]",
                ],
                isolated: &[(C, INGRESS, true), (A, INGRESS, false)],
                ..Case::default()
            },
            Case {
                name: "egress_policy_on_the_receiver_does_not_restrict_what_it_receives",
                policies: &[
                    "metadata: {name: deny-out}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  policyTypes: [Egress]",
                ],
                flows: &[("a to b", A, B, TCP, 80, ALLOW)],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn pod_to_pod_needs_egress_of_sender_and_ingress_of_receiver() {
    let mut w = world();
    w.policy(
        "metadata: {name: deny-all}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]",
    );
    w.policy("metadata: {name: a-out}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{podSelector: {matchLabels: {app: b}}}]");
    let run = w.compile();
    run.check(&[("egress alone is not enough", A, B, TCP, 80, DENY)]);
    w.policy("metadata: {name: b-in}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: a}}}]");
    let run = w.compile();
    run.check(&[
        ("both sides allow", A, B, TCP, 80, ALLOW),
        ("reverse is not allowed", B, A, TCP, 80, DENY),
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
        ("kubelet probe", NODE_V4, A, TCP, 8080, ALLOW),
        ("v6 node", NODE_V6, A, TCP, 8080, ALLOW),
        ("pod to node", A, NODE_V4, UDP, 53, ALLOW),
    ]);
    assert_eq!(
        run.reason(A, INGRESS, NODE_V4, TCP, 8080),
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
        ("self", A, A, TCP, 80, ALLOW),
        ("self, UDP", A, A, UDP, 53, ALLOW),
        ("self, ping", A, A, ICMP, 0, ALLOW),
        // The same pod is isolated both ways for anyone else.
        ("others in", B, A, TCP, 80, DENY),
        ("others out", A, B, TCP, 80, DENY),
    ]);
    // Passed by the datapath's own rule at the pod's egress hook, not by
    // a policy entry; arriving at its ingress hook, a source equal to the
    // destination proves nothing (anyone can forge it) and is judged.
    let a = ip("10.0.0.1");
    assert_eq!(
        run.classify(A, policy_common::direction::EGRESS, a, a, TCP, 80),
        policy_common::verdict::Reason::AllowSelf
    );
    assert!(run.classify(A, INGRESS, a, a, TCP, 80).is_drop());
}
