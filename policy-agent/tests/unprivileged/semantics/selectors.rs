//! Pod and namespace selectors, AND vs OR peers, label changes.
use crate::support::world::*;

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

fn protect_web(from: &str) -> String {
    format!(
        "metadata: {{name: web}}\nspec:\n  podSelector: {{matchLabels: {{app: web}}}}\n  ingress:\n  - from:\n{from}"
    )
}

#[test]
fn peer_with_both_selectors_is_an_and() {
    let mut w = world();
    w.policy(&protect_web(
        "    - namespaceSelector: {matchLabels: {user: alice}}\n      podSelector: {matchLabels: {role: client}}",
    ));
    w.compile().check(&[
        (
            "client in alice",
            "alice/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "other pod in alice",
            "alice/other",
            "default/web",
            TCP,
            80,
            DENY,
        ),
        (
            "client in own namespace",
            "default/client",
            "default/web",
            TCP,
            80,
            DENY,
        ),
        ("client in bob", "bob/client", "default/web", TCP, 80, DENY),
    ]);
}

#[test]
fn two_peers_are_an_or() {
    let mut w = world();
    w.policy(&protect_web(
        "    - namespaceSelector: {matchLabels: {user: alice}}\n    - podSelector: {matchLabels: {role: client}}",
    ));
    w.compile().check(&[
        (
            "any pod in alice",
            "alice/other",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "client in alice",
            "alice/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "client in own namespace",
            "default/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "other in own namespace",
            "default/other",
            "default/web",
            TCP,
            80,
            DENY,
        ),
        (
            "client in bob (podSelector alone is own namespace)",
            "bob/client",
            "default/web",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn pod_selector_alone_means_the_policy_namespace() {
    let mut w = world();
    w.policy(&protect_web("    - podSelector: {}"));
    w.compile().check(&[
        (
            "own namespace",
            "default/other",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "other namespace",
            "alice/client",
            "default/web",
            TCP,
            80,
            DENY,
        ),
        ("outside", "203.0.113.1", "default/web", TCP, 80, DENY),
    ]);
}

#[test]
fn namespace_selector_alone_means_every_pod_of_matching_namespaces() {
    let mut w = world();
    w.policy(&protect_web(
        "    - namespaceSelector: {matchLabels: {env: dev}}",
    ));
    w.compile().check(&[
        ("bob is dev", "bob/client", "default/web", TCP, 80, ALLOW),
        (
            "alice is prod",
            "alice/client",
            "default/web",
            TCP,
            80,
            DENY,
        ),
        (
            "own namespace not dev",
            "default/client",
            "default/web",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn empty_namespace_selector_means_every_namespace() {
    let mut w = world();
    w.policy(&protect_web(
        "    - namespaceSelector: {}\n      podSelector: {matchLabels: {role: client}}",
    ));
    w.compile().check(&[
        (
            "alice client",
            "alice/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        ("bob client", "bob/client", "default/web", TCP, 80, ALLOW),
        (
            "own client",
            "default/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        ("not a client", "alice/other", "default/web", TCP, 80, DENY),
        ("not a pod", "203.0.113.1", "default/web", TCP, 80, DENY),
    ]);
}

#[test]
fn empty_pod_selector_selects_every_pod_of_the_namespace() {
    let mut w = world();
    w.policy("metadata: {name: deny}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]");
    let run = w.compile();
    for pod in ["default/web", "default/client", "default/other"] {
        assert!(
            run.isolated(pod, policy_common::direction::INGRESS),
            "{pod}"
        );
    }
    assert!(!run.isolated("alice/client", policy_common::direction::INGRESS));
}

#[test]
fn match_expressions_operators() {
    // (name, requirement, [(source, verdict)])
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, bool)]);
    let cases: &[Case] = &[
        (
            "in",
            "{key: user, operator: In, values: [alice, carol]}",
            &[
                ("alice/client", ALLOW),
                ("bob/client", DENY),
                ("default/client", DENY),
            ],
        ),
        (
            "notin, missing key counts as not in",
            "{key: user, operator: NotIn, values: [alice]}",
            &[
                ("alice/client", DENY),
                ("bob/client", ALLOW),
                ("default/client", ALLOW),
            ],
        ),
        (
            "exists",
            "{key: env, operator: Exists}",
            &[
                ("alice/client", ALLOW),
                ("bob/client", ALLOW),
                ("default/client", DENY),
            ],
        ),
        (
            "doesnotexist",
            "{key: env, operator: DoesNotExist}",
            &[
                ("alice/client", DENY),
                ("bob/client", DENY),
                ("default/client", ALLOW),
            ],
        ),
    ];
    for (name, expr, expect) in cases {
        let mut w = world();
        w.policy(&protect_web(&format!(
            "    - namespaceSelector: {{matchExpressions: [{expr}]}}\n      podSelector: {{matchLabels: {{role: client}}}}"
        )));
        let run = w.compile();
        for (src, want) in *expect {
            assert_eq!(
                run.allows(src, "default/web", TCP, 80),
                *want,
                "{name}: {src}"
            );
        }
    }
}

#[test]
fn match_labels_and_match_expressions_are_anded() {
    let mut w = world();
    w.policy(&protect_web(
        "    - namespaceSelector: {}\n      podSelector:\n        matchLabels: {role: client}\n        matchExpressions: [{key: tier, operator: In, values: [fe]}]",
    ));
    w.compile().check(&[
        (
            "client with tier=fe",
            "bob/client",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "client without tier",
            "alice/client",
            "default/web",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn pod_selector_of_the_policy_with_expressions() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchExpressions: [{key: role, operator: NotIn, values: [client]}]}\n  policyTypes: [Ingress]");
    let run = w.compile();
    use policy_common::direction::INGRESS;
    assert!(
        run.isolated("default/web", INGRESS),
        "no role label: NotIn holds"
    );
    assert!(run.isolated("default/other", INGRESS));
    assert!(!run.isolated("default/client", INGRESS));
}

#[test]
fn pod_label_change_moves_the_pod_in_and_out_of_peers() {
    let mut w = world();
    w.policy(&protect_web(
        "    - podSelector: {matchLabels: {role: client}}",
    ));
    w.compile().check(&[(
        "other is not a client",
        "default/other",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
    w.pod_mut("default/other")
        .labels
        .insert("role".into(), "client".into());
    w.compile()
        .check(&[("now it is", "default/other", "default/web", TCP, 80, ALLOW)]);
    w.pod_mut("default/client").labels.clear();
    w.compile().check(&[(
        "lost its label",
        "default/client",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
}

#[test]
fn pod_label_change_moves_the_pod_in_and_out_of_selection() {
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {locked: 'yes'}}\n  policyTypes: [Ingress]");
    w.compile()
        .check(&[("web open", "default/client", "default/web", TCP, 80, ALLOW)]);
    w.pod_mut("default/web")
        .labels
        .insert("locked".into(), "yes".into());
    w.compile()
        .check(&[("web locked", "default/client", "default/web", TCP, 80, DENY)]);
    w.pod_mut("default/web").labels.remove("locked");
    w.compile().check(&[(
        "web open again",
        "default/client",
        "default/web",
        TCP,
        80,
        ALLOW,
    )]);
}

#[test]
fn namespace_label_change_moves_its_pods_in_and_out_of_peers() {
    let mut w = world();
    w.policy(&protect_web(
        "    - namespaceSelector: {matchLabels: {trusted: 'true'}}",
    ));
    w.compile()
        .check(&[("bob untrusted", "bob/client", "default/web", TCP, 80, DENY)]);
    w.ns("bob", &[("user", "bob"), ("trusted", "true")]);
    w.compile()
        .check(&[("bob trusted", "bob/client", "default/web", TCP, 80, ALLOW)]);
    w.ns("bob", &[("user", "bob")]);
    w.compile().check(&[(
        "bob untrusted again",
        "bob/client",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
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
    assert_ne!(
        run.identity_of("alice/client"),
        run.identity_of("default/client")
    );
}
