//! Pod and namespace selectors, AND vs OR peers, label changes.
use crate::support::world::*;
use policy_common::direction::INGRESS;

/// web (protected) in "default"; clients in three namespaces:
/// - default: client (role=client), other (role=other)
/// - alice (user=alice): client (role=client), other (role=other)
/// - bob (user=bob): client (role=client)
fn world() -> World {
    let mut w = World::new();
    w.ns("alice", &[("user", "alice"), ("env", "prod")]);
    w.ns("bob", &[("user", "bob"), ("env", "dev")]);
    w.pod("default/web", &[("app", "web")], &["10.0.0.10"]);
    w.pod("default/client", &[("role", "client")], &["10.0.0.11"]);
    w.pod("default/other", &[("role", "other")], &["10.0.0.12"]);
    w.pod("alice/client", &[("role", "client")], &["10.0.1.11"]);
    w.pod("alice/other", &[("role", "other")], &["10.0.1.12"]);
    w.pod(
        "bob/client",
        &[("role", "client"), ("tier", "fe")],
        &["10.0.2.11"],
    );
    w
}

const WEB: &str = "default/web";
const CLIENT: &str = "default/client";
const OTHER: &str = "default/other";

#[test]
fn peer_selectors() {
    check_cases(
        world,
        &[
            Case {
                name: "peer_with_both_selectors_is_an_and",
                policies: &[&web_from(
                    "    - namespaceSelector: {matchLabels: {user: alice}}\n      podSelector: {matchLabels: {role: client}}",
                )],
                flows: &[
                    ("client in alice", "alice/client", WEB, TCP, 80, ALLOW),
                    ("other pod in alice", "alice/other", WEB, TCP, 80, DENY),
                    ("client in own namespace", CLIENT, WEB, TCP, 80, DENY),
                    ("client in bob", "bob/client", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "two_peers_are_an_or",
                policies: &[&web_from(
                    "    - namespaceSelector: {matchLabels: {user: alice}}\n    - podSelector: {matchLabels: {role: client}}",
                )],
                flows: &[
                    ("any pod in alice", "alice/other", WEB, TCP, 80, ALLOW),
                    ("client in alice", "alice/client", WEB, TCP, 80, ALLOW),
                    ("client in own namespace", CLIENT, WEB, TCP, 80, ALLOW),
                    ("other in own namespace", OTHER, WEB, TCP, 80, DENY),
                    (
                        "client in bob (podSelector alone is own namespace)",
                        "bob/client",
                        WEB,
                        TCP,
                        80,
                        DENY,
                    ),
                ],
                ..Case::default()
            },
            Case {
                name: "pod_selector_alone_means_the_policy_namespace",
                policies: &[&web_from("    - podSelector: {}")],
                flows: &[
                    ("own namespace", OTHER, WEB, TCP, 80, ALLOW),
                    ("other namespace", "alice/client", WEB, TCP, 80, DENY),
                    ("outside", "203.0.113.1", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "namespace_selector_alone_means_every_pod_of_matching_namespaces",
                policies: &[&web_from(
                    "    - namespaceSelector: {matchLabels: {env: dev}}",
                )],
                flows: &[
                    ("bob is dev", "bob/client", WEB, TCP, 80, ALLOW),
                    ("alice is prod", "alice/client", WEB, TCP, 80, DENY),
                    ("own namespace not dev", CLIENT, WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "empty_namespace_selector_means_every_namespace",
                policies: &[&web_from(
                    "    - namespaceSelector: {}\n      podSelector: {matchLabels: {role: client}}",
                )],
                flows: &[
                    ("alice client", "alice/client", WEB, TCP, 80, ALLOW),
                    ("bob client", "bob/client", WEB, TCP, 80, ALLOW),
                    ("own client", CLIENT, WEB, TCP, 80, ALLOW),
                    ("not a client", "alice/other", WEB, TCP, 80, DENY),
                    ("not a pod", "203.0.113.1", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "match_labels_and_match_expressions_are_anded",
                policies: &[&web_from(
                    "    - namespaceSelector: {}\n      podSelector:\n        matchLabels: {role: client}\n        matchExpressions: [{key: tier, operator: In, values: [fe]}]",
                )],
                flows: &[
                    ("client with tier=fe", "bob/client", WEB, TCP, 80, ALLOW),
                    ("client without tier", "alice/client", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
        ],
    );
}

/// A peer of the clients (role=client) in the namespaces `requirement`
/// (a matchExpressions entry) selects.
fn clients_where(requirement: &str) -> String {
    web_from(&format!(
        "    - namespaceSelector: {{matchExpressions: [{requirement}]}}\n      podSelector: {{matchLabels: {{role: client}}}}"
    ))
}

#[test]
fn match_expressions_operators() {
    check_cases(
        world,
        &[
            Case {
                name: "in",
                policies: &[&clients_where(
                    "{key: user, operator: In, values: [alice, carol]}",
                )],
                flows: &[
                    ("alice/client", "alice/client", WEB, TCP, 80, ALLOW),
                    ("bob/client", "bob/client", WEB, TCP, 80, DENY),
                    ("default/client", CLIENT, WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "notin, missing key counts as not in",
                policies: &[&clients_where(
                    "{key: user, operator: NotIn, values: [alice]}",
                )],
                flows: &[
                    ("alice/client", "alice/client", WEB, TCP, 80, DENY),
                    ("bob/client", "bob/client", WEB, TCP, 80, ALLOW),
                    ("default/client", CLIENT, WEB, TCP, 80, ALLOW),
                ],
                ..Case::default()
            },
            Case {
                name: "exists",
                policies: &[&clients_where("{key: env, operator: Exists}")],
                flows: &[
                    ("alice/client", "alice/client", WEB, TCP, 80, ALLOW),
                    ("bob/client", "bob/client", WEB, TCP, 80, ALLOW),
                    ("default/client", CLIENT, WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "doesnotexist",
                policies: &[&clients_where("{key: env, operator: DoesNotExist}")],
                flows: &[
                    ("alice/client", "alice/client", WEB, TCP, 80, DENY),
                    ("bob/client", "bob/client", WEB, TCP, 80, DENY),
                    ("default/client", CLIENT, WEB, TCP, 80, ALLOW),
                ],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn which_pods_a_policy_selects() {
    check_cases(
        world,
        &[
            Case {
                name: "empty_pod_selector_selects_every_pod_of_the_namespace",
                policies: &[
                    "metadata: {name: deny}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]",
                ],
                isolated: &[
                    (WEB, INGRESS, true),
                    (CLIENT, INGRESS, true),
                    (OTHER, INGRESS, true),
                    ("alice/client", INGRESS, false),
                ],
                ..Case::default()
            },
            Case {
                name: "pod_selector_of_the_policy_with_expressions",
                policies: &[
                    "metadata: {name: p}\nspec:\n  podSelector: {matchExpressions: [{key: role, operator: NotIn, values: [client]}]}\n  policyTypes: [Ingress]",
                ],
                // web has no role label: NotIn holds.
                isolated: &[
                    (WEB, INGRESS, true),
                    (OTHER, INGRESS, true),
                    (CLIENT, INGRESS, false),
                ],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn pod_label_change_moves_the_pod_in_and_out_of_peers() {
    let mut w = world();
    w.policy(&web_from(
        "    - podSelector: {matchLabels: {role: client}}",
    ));
    w.compile()
        .check(&[("other is not a client", OTHER, WEB, TCP, 80, DENY)]);
    w.pod_mut(OTHER)
        .labels_mut()
        .insert("role".into(), "client".into());
    w.compile()
        .check(&[("now it is", OTHER, WEB, TCP, 80, ALLOW)]);
    w.pod_mut(CLIENT).labels_mut().clear();
    w.compile()
        .check(&[("lost its label", CLIENT, WEB, TCP, 80, DENY)]);
}

#[test]
fn pod_label_change_moves_the_pod_in_and_out_of_selection() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {locked: 'yes'}}\n  policyTypes: [Ingress]");
    w.compile()
        .check(&[("web open", CLIENT, WEB, TCP, 80, ALLOW)]);
    w.pod_mut(WEB)
        .labels_mut()
        .insert("locked".into(), "yes".into());
    w.compile()
        .check(&[("web locked", CLIENT, WEB, TCP, 80, DENY)]);
    w.pod_mut(WEB).labels_mut().remove("locked");
    w.compile()
        .check(&[("web open again", CLIENT, WEB, TCP, 80, ALLOW)]);
}

#[test]
fn namespace_label_change_moves_its_pods_in_and_out_of_peers() {
    let mut w = world();
    w.policy(&web_from(
        "    - namespaceSelector: {matchLabels: {trusted: 'true'}}",
    ));
    w.compile()
        .check(&[("bob untrusted", "bob/client", WEB, TCP, 80, DENY)]);
    w.ns("bob", &[("user", "bob"), ("trusted", "true")]);
    w.compile()
        .check(&[("bob trusted", "bob/client", WEB, TCP, 80, ALLOW)]);
    w.ns("bob", &[("user", "bob")]);
    w.compile()
        .check(&[("bob untrusted again", "bob/client", WEB, TCP, 80, DENY)]);
}

#[test]
fn namespaces_with_equal_labels_are_still_different_namespaces() {
    let mut w = World::new();
    w.ns("x", &[("same", "labels")]);
    w.ns("y", &[("same", "labels")]);
    w.pod("x/web", &[("app", "web")], &["10.0.0.1"]);
    w.pod("x/client", &[("role", "client")], &["10.0.0.2"]);
    w.pod("y/client", &[("role", "client")], &["10.0.0.3"]);
    w.policy("metadata: {name: p, namespace: x}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {role: client}}}]");
    let run = w.compile();
    run.check(&[
        ("same namespace", "x/client", "x/web", TCP, 80, ALLOW),
        ("twin namespace", "y/client", "x/web", TCP, 80, DENY),
    ]);
    assert_ne!(run.identity_of("x/client"), run.identity_of("y/client"));
}

#[test]
fn pods_with_equal_labels_share_an_identity() {
    let mut w = world();
    w.pod("alice/client-2", &[("role", "client")], &["10.0.1.20"]);
    let run = w.compile();
    assert_eq!(
        run.identity_of("alice/client"),
        run.identity_of("alice/client-2")
    );
    assert_ne!(run.identity_of("alice/client"), run.identity_of(CLIENT));
}
