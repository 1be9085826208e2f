//! Ports: protocols, numbers, ranges (endPort) and named ports.
use crate::support::world::*;

fn world() -> World {
    let mut w = World::new();
    w.pod("default/server", &[("app", "server")], &["10.0.0.10"]);
    w.pod("default/client", &[("app", "client")], &["10.0.0.11"]);
    w
}

fn server_ports(ports: &str) -> String {
    format!(
        "metadata: {{name: p}}\nspec:\n  podSelector: {{matchLabels: {{app: server}}}}\n  ingress:\n  - ports: {ports}"
    )
}

#[test]
fn protocol_defaults_to_tcp() {
    let mut w = world();
    w.policy(&server_ports("[{port: 80}]"));
    w.compile().check(&[
        ("tcp", "default/client", "default/server", TCP, 80, ALLOW),
        (
            "udp same port",
            "default/client",
            "default/server",
            UDP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn a_tcp_rule_does_not_open_udp_sctp_or_icmp() {
    let mut w = world();
    w.policy(&server_ports("[{port: 53, protocol: TCP}]"));
    w.compile().check(&[
        ("tcp", "default/client", "default/server", TCP, 53, ALLOW),
        ("udp", "default/client", "default/server", UDP, 53, DENY),
        ("sctp", "default/client", "default/server", SCTP, 53, DENY),
        ("icmp", "default/client", "default/server", ICMP, 0, DENY),
    ]);
}

#[test]
fn udp_and_sctp_rules_open_only_their_protocol() {
    let mut w = world();
    w.policy(&server_ports(
        "[{port: 53, protocol: UDP}, {port: 9, protocol: SCTP}]",
    ));
    w.compile().check(&[
        ("udp", "default/client", "default/server", UDP, 53, ALLOW),
        (
            "tcp on the udp port",
            "default/client",
            "default/server",
            TCP,
            53,
            DENY,
        ),
        ("sctp", "default/client", "default/server", SCTP, 9, ALLOW),
        (
            "udp on the sctp port",
            "default/client",
            "default/server",
            UDP,
            9,
            DENY,
        ),
        ("icmp", "default/client", "default/server", ICMP, 0, DENY),
    ]);
}

#[test]
fn protocol_without_port_means_every_port_of_that_protocol() {
    let mut w = world();
    w.policy(&server_ports("[{protocol: UDP}]"));
    w.compile().check(&[
        ("udp low", "default/client", "default/server", UDP, 1, ALLOW),
        (
            "udp high",
            "default/client",
            "default/server",
            UDP,
            65535,
            ALLOW,
        ),
        ("tcp", "default/client", "default/server", TCP, 80, DENY),
        ("icmp", "default/client", "default/server", ICMP, 0, DENY),
    ]);
}

#[test]
fn end_port_range_inside_outside_and_boundaries() {
    let mut w = world();
    w.policy(&server_ports("[{port: 32000, endPort: 32768}]"));
    w.compile().check(&[
        (
            "first",
            "default/client",
            "default/server",
            TCP,
            32000,
            ALLOW,
        ),
        (
            "middle",
            "default/client",
            "default/server",
            TCP,
            32500,
            ALLOW,
        ),
        (
            "last",
            "default/client",
            "default/server",
            TCP,
            32768,
            ALLOW,
        ),
        (
            "below",
            "default/client",
            "default/server",
            TCP,
            31999,
            DENY,
        ),
        (
            "above",
            "default/client",
            "default/server",
            TCP,
            32769,
            DENY,
        ),
        (
            "udp in range",
            "default/client",
            "default/server",
            UDP,
            32500,
            DENY,
        ),
    ]);
}

#[test]
fn end_port_equal_to_port_is_one_port() {
    let mut w = world();
    w.policy(&server_ports("[{port: 8080, endPort: 8080}]"));
    w.compile().check(&[
        (
            "the port",
            "default/client",
            "default/server",
            TCP,
            8080,
            ALLOW,
        ),
        ("next", "default/client", "default/server", TCP, 8081, DENY),
        (
            "previous",
            "default/client",
            "default/server",
            TCP,
            8079,
            DENY,
        ),
    ]);
}

#[test]
fn end_port_aligned_range_is_one_prefix_entry() {
    let mut w = world();
    w.policy(&server_ports("[{port: 8000, endPort: 8007}]"));
    let run = w.compile();
    let keys: Vec<_> = run.compiled.maps.policy.keys().collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!((keys[0].port, keys[0].port_prefix_len), (8000, 13));
    run.check(&[
        ("8007", "default/client", "default/server", TCP, 8007, ALLOW),
        ("8008", "default/client", "default/server", TCP, 8008, DENY),
    ]);
}

#[test]
fn full_port_range() {
    let mut w = world();
    w.policy(&server_ports("[{port: 1, endPort: 65535, protocol: SCTP}]"));
    w.compile().check(&[
        ("1", "default/client", "default/server", SCTP, 1, ALLOW),
        (
            "65535",
            "default/client",
            "default/server",
            SCTP,
            65535,
            ALLOW,
        ),
        ("tcp", "default/client", "default/server", TCP, 1, DENY),
    ]);
}

#[test]
fn overlapping_ports_and_ranges_union() {
    let mut w = world();
    w.policy(&server_ports(
        "[{port: 100, endPort: 200}, {port: 150, endPort: 300}, {port: 1000}]",
    ));
    w.compile().check(&[
        ("99", "default/client", "default/server", TCP, 99, DENY),
        ("100", "default/client", "default/server", TCP, 100, ALLOW),
        ("250", "default/client", "default/server", TCP, 250, ALLOW),
        ("300", "default/client", "default/server", TCP, 300, ALLOW),
        ("301", "default/client", "default/server", TCP, 301, DENY),
        ("1000", "default/client", "default/server", TCP, 1000, ALLOW),
    ]);
}

/// Two servers with equal labels whose "http" ports differ.
fn named_world() -> World {
    let mut w = World::new();
    w.pod("default/s1", &[("app", "server")], &["10.0.0.1"])
        .ports = vec![named_port("http", TCP, 8080)];
    w.pod("default/s2", &[("app", "server")], &["10.0.0.2"])
        .ports = vec![named_port("http", TCP, 9090)];
    w.pod("default/s3", &[("app", "server")], &["10.0.0.3"])
        .ports = vec![named_port("dns", UDP, 53)];
    w.pod("default/client", &[("app", "client")], &["10.0.0.9"]);
    w
}

#[test]
fn named_port_ingress_resolves_on_each_selected_pod() {
    let mut w = named_world();
    w.policy(&server_ports("[{port: http}]"));
    let run = w.compile();
    run.check(&[
        (
            "s1 on its http",
            "default/client",
            "default/s1",
            TCP,
            8080,
            ALLOW,
        ),
        (
            "s1 on s2's http",
            "default/client",
            "default/s1",
            TCP,
            9090,
            DENY,
        ),
        (
            "s2 on its http",
            "default/client",
            "default/s2",
            TCP,
            9090,
            ALLOW,
        ),
        (
            "s2 on s1's http",
            "default/client",
            "default/s2",
            TCP,
            8080,
            DENY,
        ),
        (
            "s3 has no http: nothing",
            "default/client",
            "default/s3",
            TCP,
            8080,
            DENY,
        ),
        (
            "s3 other port",
            "default/client",
            "default/s3",
            UDP,
            53,
            DENY,
        ),
    ]);
    assert_ne!(
        run.identity_of("default/s1"),
        run.identity_of("default/s2"),
        "named ports split identities"
    );
    assert!(
        run.error_strings().is_empty(),
        "an unresolvable name is not an error"
    );
}

#[test]
fn named_port_protocol_must_match_the_container_port() {
    let mut w = named_world();
    w.policy(&server_ports("[{port: dns, protocol: TCP}]"));
    w.compile().check(&[
        (
            "dns is udp on s3",
            "default/client",
            "default/s3",
            TCP,
            53,
            DENY,
        ),
        (
            "and not udp either",
            "default/client",
            "default/s3",
            UDP,
            53,
            DENY,
        ),
    ]);
    let mut w = named_world();
    w.policy(&server_ports("[{port: dns, protocol: UDP}]"));
    w.compile()
        .check(&[("udp dns", "default/client", "default/s3", UDP, 53, ALLOW)]);
}

#[test]
fn named_port_egress_resolves_on_each_peer_pod() {
    let mut w = named_world();
    w.policy("metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{podSelector: {matchLabels: {app: server}}}]\n    ports: [{port: http}]");
    w.compile().check(&[
        (
            "to s1 on 8080",
            "default/client",
            "default/s1",
            TCP,
            8080,
            ALLOW,
        ),
        (
            "to s1 on 9090",
            "default/client",
            "default/s1",
            TCP,
            9090,
            DENY,
        ),
        (
            "to s2 on 9090",
            "default/client",
            "default/s2",
            TCP,
            9090,
            ALLOW,
        ),
        (
            "to s2 on 8080",
            "default/client",
            "default/s2",
            TCP,
            8080,
            DENY,
        ),
        (
            "to s3: no http",
            "default/client",
            "default/s3",
            TCP,
            8080,
            DENY,
        ),
        (
            "to outside",
            "default/client",
            "203.0.113.5",
            TCP,
            8080,
            DENY,
        ),
    ]);
}

#[test]
fn named_port_egress_with_to_absent_resolves_on_every_pod_and_no_other_address() {
    let mut w = named_world();
    w.policy("metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - ports: [{port: http}]");
    w.compile().check(&[
        ("s1", "default/client", "default/s1", TCP, 8080, ALLOW),
        ("s2", "default/client", "default/s2", TCP, 9090, ALLOW),
        (
            "s2 wrong number",
            "default/client",
            "default/s2",
            TCP,
            8080,
            DENY,
        ),
        (
            "outside has no ports to resolve",
            "default/client",
            "203.0.113.5",
            TCP,
            8080,
            DENY,
        ),
    ]);
}

#[test]
fn named_port_egress_to_ip_block_resolves_on_pods_wholly_inside() {
    let mut w = named_world();
    w.policy("metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/24}}]\n    ports: [{port: http}, {port: 7000}]");
    w.compile().check(&[
        (
            "pod in block, named",
            "default/client",
            "default/s1",
            TCP,
            8080,
            ALLOW,
        ),
        (
            "pod in block, its own number",
            "default/client",
            "default/s2",
            TCP,
            9090,
            ALLOW,
        ),
        (
            "pod in block, numeric port",
            "default/client",
            "default/s3",
            TCP,
            7000,
            ALLOW,
        ),
        (
            "non-pod in block: no named port",
            "default/client",
            "10.0.0.200",
            TCP,
            8080,
            DENY,
        ),
        (
            "non-pod in block, numeric",
            "default/client",
            "10.0.0.200",
            TCP,
            7000,
            ALLOW,
        ),
    ]);
}

#[test]
fn named_port_egress_to_ip_block_fails_closed_when_the_identity_spans_outside() {
    // s1 and s4 share an identity (same labels and named ports); s4's address
    // is outside the block. A key for that identity would open s4 too, so
    // the named port does not apply to s1 through the block (documented).
    let mut w = named_world();
    w.pod("default/s4", &[("app", "server")], &["10.9.0.4"])
        .ports = vec![named_port("http", TCP, 8080)];
    w.policy("metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/24}}]\n    ports: [{port: http}]");
    let run = w.compile();
    assert_eq!(run.identity_of("default/s1"), run.identity_of("default/s4"));
    run.check(&[
        (
            "s4 is outside the block",
            "default/client",
            "default/s4",
            TCP,
            8080,
            DENY,
        ),
        (
            "s1 inside, but fails closed",
            "default/client",
            "default/s1",
            TCP,
            8080,
            DENY,
        ),
        (
            "s2 alone in its identity",
            "default/client",
            "default/s2",
            TCP,
            9090,
            ALLOW,
        ),
    ]);
}

#[test]
fn icmp_needs_a_rule_without_ports() {
    let mut w = world();
    w.policy(&server_ports("[{port: 80}, {protocol: UDP}]"));
    w.compile()
        .check(&[("icmp", "default/client", "default/server", ICMP, 0, DENY)]);
    let mut w = world();
    w.policy("metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: server}}\n  ingress:\n  - from: [{podSelector: {}}]");
    w.compile()
        .check(&[("icmp", "default/client", "default/server", ICMP, 0, ALLOW)]);
}
