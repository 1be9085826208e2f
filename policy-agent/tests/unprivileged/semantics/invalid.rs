//! Invalid policies fail closed: they report the object and field, keep
//! isolating what they select, allow nothing, and leave others alone.
use crate::support::world::*;
use policy_common::direction::{EGRESS, INGRESS};

fn world() -> World {
    let mut w = World::new();
    w.pod("default/web", &[("app", "web")], &["10.0.0.10"]);
    w.pod("default/db", &[("app", "db")], &["10.0.0.20"]);
    w.pod("default/client", &[("app", "client")], &["10.0.0.30"]);
    // A valid policy that must keep working next to the broken ones.
    w.policy("metadata: {name: db}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: client}}}]\n    ports: [{port: 5432}]");
    w
}

const WEB: &str = "default/web";
const DB: &str = "default/db";
const CLIENT: &str = "default/client";

/// (test name, ingress rule YAML of a policy selecting web, field, message part)
const BAD_INGRESS_RULES: &[(&str, &str, &str, &str)] = &[
    (
        "bad cidr",
        "from: [{ipBlock: {cidr: 10.0.0.0/33}}]",
        "spec.ingress[0].from[0].ipBlock.cidr",
        "not a valid CIDR",
    ),
    (
        "cidr is not a cidr",
        "from: [{ipBlock: {cidr: banana}}]",
        "spec.ingress[0].from[0].ipBlock.cidr",
        "not a valid CIDR",
    ),
    (
        "cidr without length",
        "from: [{ipBlock: {cidr: 10.0.0.1}}]",
        "spec.ingress[0].from[0].ipBlock.cidr",
        "not a valid CIDR",
    ),
    (
        "bad except",
        "from: [{ipBlock: {cidr: 10.0.0.0/8, except: [nope]}}]",
        "spec.ingress[0].from[0].ipBlock.except[0]",
        "not a valid CIDR",
    ),
    (
        "except outside cidr",
        "from: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/16, 11.0.0.0/16]}}]",
        "spec.ingress[0].from[0].ipBlock.except[1]",
        "not a strict subset",
    ),
    (
        "except equal to cidr",
        "from: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/8]}}]",
        "spec.ingress[0].from[0].ipBlock.except[0]",
        "not a strict subset",
    ),
    (
        "except of the other family",
        "from: [{ipBlock: {cidr: 10.0.0.0/8, except: ['fd00::/64']}}]",
        "spec.ingress[0].from[0].ipBlock.except[0]",
        "not a strict subset",
    ),
    (
        "ipBlock with podSelector",
        "from: [{ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}]",
        "spec.ingress[0].from[0]",
        "cannot be combined",
    ),
    (
        "ipBlock with namespaceSelector",
        "from: [{podSelector: {}}, {ipBlock: {cidr: 10.0.0.0/8}, namespaceSelector: {}}]",
        "spec.ingress[0].from[1]",
        "cannot be combined",
    ),
    (
        "empty peer",
        "from: [{}]",
        "spec.ingress[0].from[0]",
        "must set",
    ),
    (
        "unknown protocol",
        "ports: [{port: 80, protocol: ICMP}]",
        "spec.ingress[0].ports[0].protocol",
        "not TCP, UDP or SCTP",
    ),
    (
        "protocol in lower case",
        "ports: [{port: 80, protocol: tcp}]",
        "spec.ingress[0].ports[0].protocol",
        "not TCP, UDP or SCTP",
    ),
    (
        "port zero",
        "ports: [{port: 0}]",
        "spec.ingress[0].ports[0].port",
        "outside 1-65535",
    ),
    (
        "port too large",
        "ports: [{port: 80}, {port: 70000}]",
        "spec.ingress[0].ports[1].port",
        "outside 1-65535",
    ),
    (
        "negative port",
        "ports: [{port: -1}]",
        "spec.ingress[0].ports[0].port",
        "outside 1-65535",
    ),
    (
        "endPort without port",
        "ports: [{endPort: 90}]",
        "spec.ingress[0].ports[0].endPort",
        "requires a numeric port",
    ),
    (
        "endPort with named port",
        "ports: [{port: http, endPort: 90}]",
        "spec.ingress[0].ports[0].endPort",
        "requires a numeric port",
    ),
    (
        "endPort below port",
        "ports: [{port: 443}, {port: 80, endPort: 79}]",
        "spec.ingress[0].ports[1].endPort",
        "79 is below port 80",
    ),
    (
        "endPort too large",
        "ports: [{port: 80, endPort: 65536}]",
        "spec.ingress[0].ports[0].endPort",
        "outside 1-65535",
    ),
    (
        "bad port name",
        "ports: [{port: HTTP}]",
        "spec.ingress[0].ports[0].port",
        "IANA_SVC_NAME",
    ),
    (
        "numeric string port",
        "ports: [{port: '80'}]",
        "spec.ingress[0].ports[0].port",
        "IANA_SVC_NAME",
    ),
    (
        "In without values",
        "from: [{podSelector: {matchExpressions: [{key: a, operator: In}]}}]",
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
        "needs at least one value",
    ),
    (
        "Exists with values",
        "from: [{namespaceSelector: {matchExpressions: [{key: a, operator: Exists, values: [x]}]}}]",
        "spec.ingress[0].from[0].namespaceSelector.matchExpressions[0].values",
        "takes no values",
    ),
    (
        "unknown operator",
        "from: [{podSelector: {matchExpressions: [{key: a, operator: Gt, values: ['1']}]}}]",
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].operator",
        "is not In, NotIn, Exists or DoesNotExist",
    ),
];

#[test]
fn each_invalid_rule_is_reported_and_fails_closed() {
    for (name, rule, field, message) in BAD_INGRESS_RULES {
        let mut w = world();
        // The bad rule sits next to a rule that would otherwise allow the
        // client: the whole policy allows nothing.
        w.policy(&format!(
            "metadata: {{name: web}}\nspec:\n  podSelector: {{matchLabels: {{app: web}}}}\n  ingress:\n  - {rule}\n  - from: [{{podSelector: {{matchLabels: {{app: client}}}}}}]"
        ));
        let run = w.compile();
        let errors = run.error_strings();
        assert_eq!(errors.len(), 1, "{name}: {errors:?}");
        let e = &errors[0];
        assert!(e.starts_with("networkpolicy default/web: "), "{name}: {e}");
        assert!(
            e.contains(&format!(" {field}: ")),
            "{name}: want field {field} in {e}"
        );
        assert!(e.contains(message), "{name}: want {message:?} in {e}");
        assert_eq!(run.compiled.errors[0].field(), *field, "{name}");
        assert!(run.isolated(WEB, INGRESS), "{name}: still isolated");
        run.check(&[
            (
                "the broken policy allows nothing",
                CLIENT,
                WEB,
                TCP,
                80,
                DENY,
            ),
            ("not even from outside", "203.0.113.1", WEB, TCP, 80, DENY),
            ("the valid policy still works", CLIENT, DB, TCP, 5432, ALLOW),
            ("and still restricts", WEB, DB, TCP, 5432, DENY),
            ("unselected pods untouched", WEB, CLIENT, TCP, 1, ALLOW),
        ]);
    }
}

#[test]
fn the_example_error_message() {
    let mut w = world();
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - ports: [{port: 443}, {port: 80, endPort: 79}]");
    let run = w.compile();
    assert_eq!(
        run.error_strings(),
        vec![
            "networkpolicy default/web: spec.ingress[0].ports[1].endPort: 79 is below port 80"
                .to_owned()
        ]
    );
}

#[test]
fn an_invalid_policy_isolates_what_it_selects_and_allows_nothing() {
    check_cases(
        world,
        &[
            Case {
                name: "invalid_egress_rule_keeps_egress_isolation",
                policies: &[
                    "metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}}]",
                ],
                first_error: Some("spec.egress[0].to[0].ipBlock.except[0]"),
                isolated: &[(WEB, EGRESS, true), (WEB, INGRESS, false)],
                flows: &[
                    ("egress closed", WEB, "10.1.1.1", TCP, 80, DENY),
                    ("ingress open", CLIENT, WEB, TCP, 80, ALLOW),
                ],
            },
            Case {
                name: "invalid_rule_in_a_direction_not_isolated_still_invalidates_the_policy",
                policies: &[
                    "metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Ingress]\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: client}}}]\n  egress:\n  - ports: [{port: 0}]",
                ],
                first_error: Some("spec.egress[0].ports[0].port"),
                isolated: &[(WEB, EGRESS, false)],
                flows: &[(
                    "ingress rule dropped with the policy",
                    CLIENT,
                    WEB,
                    TCP,
                    80,
                    DENY,
                )],
            },
            Case {
                name: "unknown_policy_type_isolates_both_directions",
                policies: &[
                    "metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Ingress, Sideways]\n  ingress: [{}]",
                ],
                first_error: Some("spec.policyTypes[1]"),
                isolated: &[(WEB, INGRESS, true), (WEB, EGRESS, true)],
                flows: &[
                    (
                        "the allow-all ingress is dropped",
                        CLIENT,
                        WEB,
                        TCP,
                        80,
                        DENY,
                    ),
                    ("egress closed", WEB, CLIENT, TCP, 80, DENY),
                ],
            },
        ],
    );
}

#[test]
fn invalid_pod_selector_isolates_the_whole_namespace() {
    let mut w = world();
    w.ns("other", &[]);
    w.pod("other/x", &[("app", "x")], &["10.0.1.1"]);
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchExpressions: [{key: app, operator: In, values: []}]}\n  policyTypes: [Ingress, Egress]\n  ingress: [{}]");
    let run = w.compile();
    assert_eq!(
        run.compiled.errors[0].field(),
        "spec.podSelector.matchExpressions[0].values"
    );
    for pod in [WEB, DB, CLIENT] {
        assert!(
            run.isolated(pod, INGRESS) && run.isolated(pod, EGRESS),
            "{pod}"
        );
    }
    assert!(
        !run.isolated("other/x", INGRESS),
        "other namespaces untouched"
    );
    run.check(&[
        ("nothing in", "other/x", WEB, TCP, 80, DENY),
        ("nothing out", CLIENT, "other/x", TCP, 80, DENY),
    ]);
}

#[test]
fn several_errors_in_one_policy_are_all_reported() {
    let mut w = world();
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{ipBlock: {cidr: x}}]\n    ports: [{port: 0}, {protocol: FOO}]");
    let fields: Vec<String> = w
        .compile()
        .compiled
        .errors
        .iter()
        .map(|e| e.field().to_owned())
        .collect();
    assert_eq!(
        fields,
        vec![
            "spec.ingress[0].from[0].ipBlock.cidr",
            "spec.ingress[0].ports[0].port",
            "spec.ingress[0].ports[1].protocol"
        ]
    );
}

#[test]
fn fixing_an_invalid_policy_restores_its_rules() {
    let mut w = world();
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: client}}}]\n    ports: [{port: 80, endPort: 79}]");
    w.compile().check(&[("broken", CLIENT, WEB, TCP, 80, DENY)]);
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: client}}}]\n    ports: [{port: 80, endPort: 81}]");
    let run = w.compile();
    assert!(run.error_strings().is_empty());
    run.check(&[("fixed", CLIENT, WEB, TCP, 81, ALLOW)]);
}

#[test]
fn invalid_policy_carves_no_address_classes() {
    let mut w = world();
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{ipBlock: {cidr: 10.0.0.0/8}}]\n    ports: [{port: 0}]");
    let run = w.compile();
    assert!(
        run.compiled
            .maps
            .ipcache
            .keys()
            .all(|n| n.prefix_len() == n.max_prefix_len())
    );
}
