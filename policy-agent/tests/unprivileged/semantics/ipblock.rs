//! ipBlock peers: cidr and except, pod addresses, IPv4 and IPv6.
use crate::support::world::*;
use policy_common::identity::{ANY, FIRST_CIDR, NODE, WORLD};

fn world() -> World {
    let mut w = World::new();
    w.ns("other", &[]);
    w.pod("default/web", &[("app", "web")], &["10.0.0.10", "fd10::10"]);
    w.pod(
        "default/client",
        &[("role", "client")],
        &["10.0.0.11", "fd10::11"],
    );
    w.pod(
        "other/peer",
        &[("role", "peer")],
        &["10.1.2.3", "fd10:1::3"],
    );
    w
}

const WEB: &str = "default/web";
const CLIENT: &str = "default/client";
const PEER: &str = "other/peer";

#[test]
fn cidrs_and_excepts() {
    check_cases(
        world,
        &[
            Case {
                name: "ip_block_with_except",
                policies: &[&web_from(
                    "    - ipBlock: {cidr: 172.17.0.0/16, except: [172.17.1.0/24]}",
                )],
                flows: &[
                    ("inside", "172.17.0.5", WEB, TCP, 80, ALLOW),
                    ("inside, high", "172.17.255.254", WEB, TCP, 80, ALLOW),
                    ("excepted", "172.17.1.5", WEB, TCP, 80, DENY),
                    ("outside", "172.18.0.1", WEB, TCP, 80, DENY),
                    ("v6 outside", "2001:db8::1", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            // "ip block override deny": another peer of the same rule still
            // allows the excepted range.
            Case {
                name: "ip_block_except_narrows_only_its_own_peer",
                policies: &[&web_from(
                    "    - ipBlock: {cidr: 172.17.0.0/16, except: [172.17.1.0/24]}\n    - ipBlock: {cidr: 172.17.1.0/28}",
                )],
                flows: &[
                    (
                        "excepted by the first, allowed by the second",
                        "172.17.1.5",
                        WEB,
                        TCP,
                        80,
                        ALLOW,
                    ),
                    (
                        "excepted, outside the second",
                        "172.17.1.100",
                        WEB,
                        TCP,
                        80,
                        DENY,
                    ),
                ],
                ..Case::default()
            },
            Case {
                name: "ip_block_except_is_not_a_deny_for_other_policies",
                policies: &[
                    &web_from("    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}"),
                    "metadata: {name: also}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{namespaceSelector: {}}]",
                ],
                flows: &[
                    (
                        "excepted address that is a selected pod",
                        PEER,
                        WEB,
                        TCP,
                        80,
                        ALLOW,
                    ),
                    ("excepted outside address", "10.1.9.9", WEB, TCP, 80, DENY),
                    ("inside", "10.200.0.1", WEB, TCP, 80, ALLOW),
                ],
                ..Case::default()
            },
            Case {
                name: "ip_block_ipv6_with_except",
                policies: &[&web_from(
                    "    - ipBlock: {cidr: '2001:db8::/32', except: ['2001:db8:1::/48']}",
                )],
                flows: &[
                    ("inside", "2001:db8:2::1", WEB, TCP, 80, ALLOW),
                    ("excepted", "2001:db8:1::1", WEB, TCP, 80, DENY),
                    ("outside", "2001:db9::1", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "ipv4_catch_all_does_not_admit_ipv6",
                policies: &[&web_from("    - ipBlock: {cidr: 0.0.0.0/0}")],
                flows: &[
                    ("any v4", "198.51.100.7", WEB, TCP, 80, ALLOW),
                    ("v4 pod", PEER, WEB, TCP, 80, ALLOW),
                    ("v6 world", "2001:db8::7", WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "catch_all_with_except_in_egress",
                policies: &[
                    "metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Egress]\n  egress:\n  - to:\n    - ipBlock: {cidr: 0.0.0.0/0, except: [10.0.0.0/8]}\n    - ipBlock: {cidr: '::/0'}",
                ],
                flows: &[
                    ("internet", WEB, "93.184.216.34", TCP, 443, ALLOW),
                    ("private excepted", WEB, "10.9.9.9", TCP, 443, DENY),
                    ("pod excepted", WEB, CLIENT, TCP, 443, DENY),
                    ("v6 anywhere", WEB, "2001:db8::1", TCP, 443, ALLOW),
                ],
                ..Case::default()
            },
            Case {
                name: "nested_blocks_from_several_policies",
                policies: &[
                    &web_from("    - ipBlock: {cidr: 10.0.0.0/8, except: [10.5.0.0/16]}"),
                    "metadata: {name: inner}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{ipBlock: {cidr: 10.5.5.0/24}}]\n    ports: [{port: 22}]",
                ],
                flows: &[
                    ("outer", "10.9.0.1", WEB, TCP, 80, ALLOW),
                    ("excepted by outer", "10.5.1.1", WEB, TCP, 80, DENY),
                    ("inner range on inner port", "10.5.5.5", WEB, TCP, 22, ALLOW),
                    (
                        "inner range on outer's port: outer excepts it",
                        "10.5.5.5",
                        WEB,
                        TCP,
                        80,
                        DENY,
                    ),
                    (
                        "inner range is still inside outer's except",
                        "10.5.5.5",
                        WEB,
                        TCP,
                        23,
                        DENY,
                    ),
                ],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn ip_blocks_match_pod_addresses() {
    check_cases(
        world,
        &[
            Case {
                name: "ip_block_matches_pod_addresses_with_a_host_prefix",
                policies: &[&web_from("    - ipBlock: {cidr: 10.0.0.11/32}")],
                flows: &[
                    ("the pod with that address", CLIENT, WEB, TCP, 80, ALLOW),
                    ("another pod", PEER, WEB, TCP, 80, DENY),
                ],
                ..Case::default()
            },
            Case {
                name: "ip_block_matches_pod_addresses_with_a_wider_prefix",
                policies: &[&web_from("    - ipBlock: {cidr: 10.1.0.0/16}")],
                flows: &[
                    ("pod inside", PEER, WEB, TCP, 80, ALLOW),
                    ("pod outside", CLIENT, WEB, TCP, 80, DENY),
                    ("non-pod inside", "10.1.200.1", WEB, TCP, 80, ALLOW),
                ],
                ..Case::default()
            },
            Case {
                name: "ip_block_except_excludes_pod_addresses",
                policies: &[&web_from(
                    "    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.2.3/32]}",
                )],
                flows: &[
                    ("excepted pod", PEER, WEB, TCP, 80, DENY),
                    ("other pod in range", CLIENT, WEB, TCP, 80, ALLOW),
                ],
                ..Case::default()
            },
        ],
    );
}

#[test]
fn ip_block_ipv6_matches_pod_addresses() {
    let mut w = world();
    w.policy(&web_from("    - ipBlock: {cidr: 'fd10:1::/64'}"));
    let run = w.compile();
    let (web, peer, client) = (ip("fd10::10"), ip("fd10:1::3"), ip("fd10::11"));
    assert!(
        run.allows_ips(PEER, peer, WEB, web, TCP, 80),
        "v6 pod inside"
    );
    assert!(
        !run.allows_ips(CLIENT, client, WEB, web, TCP, 80),
        "v6 pod outside"
    );
    // The same pods over IPv4: the v6 block does not cover them.
    assert!(!run.allows_ips(PEER, ip("10.1.2.3"), WEB, ip("10.0.0.10"), TCP, 80));
    run.check(&[(
        "v6 outside address inside",
        "fd10:1::99",
        WEB,
        TCP,
        80,
        ALLOW,
    )]);
}

#[test]
fn host_bits_in_a_cidr_are_ignored() {
    let mut w = world();
    w.policy(&web_from("    - ipBlock: {cidr: 172.17.3.4/16}"));
    let run = w.compile();
    assert!(run.error_strings().is_empty(), "{:?}", run.error_strings());
    run.check(&[
        (
            "inside the normalized block",
            "172.17.200.1",
            WEB,
            TCP,
            80,
            ALLOW,
        ),
        ("outside", "172.16.0.1", WEB, TCP, 80, DENY),
    ]);
}

#[test]
fn ipcache_has_classes_pods_and_node() {
    let mut w = world();
    w.policy(&web_from(
        "    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}",
    ));
    let run = w.compile();
    let m = run.model();
    let pod = m.ipcache_lookup(ip("10.1.2.3"));
    assert!(pod.identity >= policy_common::identity::FIRST_LABEL && pod.identity < FIRST_CIDR);
    let except_class = m.ipcache_lookup(ip("10.1.9.9"));
    assert_eq!(except_class.identity, ANY);
    assert_eq!(
        pod.cidr_identity, except_class.cidr_identity,
        "the pod address is in the except class"
    );
    let outer = m.ipcache_lookup(ip("10.7.0.1"));
    assert!(outer.cidr_identity >= FIRST_CIDR && outer.cidr_identity != except_class.cidr_identity);
    assert_eq!(m.ipcache_lookup(ip("8.8.8.8")).cidr_identity, WORLD);
    assert_eq!(m.ipcache_lookup(ip(NODE_V4)).identity, NODE);
}
