//! Pods coming and going, address reuse, policy deletion, identities.
use crate::support::world::*;
use policy_agent::{
    cluster::Change,
    identity::IdentityAllocator,
    mapstate::diff,
    policy::{self, CompileOptions, Compiler},
};
use policy_common::direction::INGRESS;

fn world() -> World {
    let mut w = World::new();
    w.pod("default/web", &[("app", "web")], &["10.0.0.10"]);
    w.pod("default/friend", &[("role", "friend")], &["10.0.0.20"]);
    w.pod("default/stranger", &[("role", "stranger")], &["10.0.0.30"]);
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {role: friend}}}]");
    w
}

#[test]
fn policy_deletion_reopens_the_pod() {
    let mut w = world();
    w.compile().check(&[(
        "stranger denied",
        "default/stranger",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
    w.remove_policy("default/web");
    let run = w.compile();
    run.check(&[(
        "stranger allowed",
        "default/stranger",
        "default/web",
        TCP,
        80,
        ALLOW,
    )]);
    assert!(!run.isolated("default/web", INGRESS));
    assert!(run.compiled.maps.policy.is_empty());
}

#[test]
fn policy_update_replaces_its_rules() {
    let mut w = world();
    w.policy("metadata: {name: web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {role: stranger}}}]");
    w.compile().check(&[
        ("old peer", "default/friend", "default/web", TCP, 80, DENY),
        (
            "new peer",
            "default/stranger",
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
    ]);
}

#[test]
fn reused_address_follows_the_pod_that_holds_it_now() {
    let mut w = world();
    // The friend goes away and a stranger gets its address.
    w.state.pods.remove(&obj("default/friend"));
    w.pod("default/newcomer", &[("role", "stranger")], &["10.0.0.20"]);
    let run = w.compile();
    run.check(&[(
        "same address, new pod",
        "10.0.0.20",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
    assert_eq!(
        run.identity_of("default/newcomer"),
        run.identity_of("default/stranger")
    );
}

#[test]
fn of_two_live_pods_claiming_an_address_the_newer_holds_it() {
    let mut w = world();
    // The old holder is still listed (its deletion not seen yet).
    w.pod("default/newcomer", &[("role", "stranger")], &["10.0.0.20"]);
    w.compile().check(&[(
        "newer pod holds it",
        "10.0.0.20",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
    // The newer one is deleted: the address goes back to the friend.
    w.state.pods.remove(&obj("default/newcomer"));
    w.compile()
        .check(&[("friend again", "10.0.0.20", "default/web", TCP, 80, ALLOW)]);
}

#[test]
fn terminal_pods_release_their_addresses() {
    let mut w = world();
    w.pod_mut("default/friend").terminal = true;
    w.pod("default/newcomer", &[("role", "stranger")], &["10.0.0.20"])
        .created = -5;
    let run = w.compile();
    run.check(&[(
        "terminal friend holds nothing",
        "10.0.0.20",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
    assert!(!run.is_endpoint("default/friend"));
}

#[test]
fn terminal_pod_alone_leaves_its_address_unknown() {
    let mut w = world();
    w.pod_mut("default/friend").terminal = true;
    let run = w.compile();
    run.check(&[("nobody holds it", "10.0.0.20", "default/web", TCP, 80, DENY)]);
    assert_eq!(
        run.model().ipcache_lookup(ip("10.0.0.20")),
        policy_common::ipcache::IpcacheEntry::UNKNOWN
    );
}

#[test]
fn pod_address_change_moves_its_identity() {
    let mut w = world();
    w.pod_mut("default/friend").ips = vec![ip("10.0.0.21")].into();
    w.compile().check(&[
        ("new address", "10.0.0.21", "default/web", TCP, 80, ALLOW),
        (
            "old address is nobody",
            "10.0.0.20",
            "default/web",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn pods_on_other_nodes_are_peers_but_not_endpoints() {
    let mut w = world();
    w.pod_mut("default/friend").node_name = Some("node-b".into());
    let run = w.compile();
    assert!(!run.is_endpoint("default/friend"));
    assert!(run.is_endpoint("default/web"));
    run.check(&[(
        "remote friend",
        "default/friend",
        "default/web",
        TCP,
        80,
        ALLOW,
    )]);
}

#[test]
fn remote_pods_are_judged_on_their_own_node() {
    let mut w = world();
    w.pod_mut("default/web").node_name = Some("node-b".into());
    let run = w.compile();
    assert!(!run.is_endpoint("default/web"));
    run.check(&[(
        "not judged here",
        "default/stranger",
        "default/web",
        TCP,
        80,
        ALLOW,
    )]);
    let all = w.compile_all_local();
    all.check(&[(
        "judged when every pod is local",
        "default/stranger",
        "default/web",
        TCP,
        80,
        DENY,
    )]);
}

#[test]
fn host_network_pods_are_neither_endpoints_nor_peers() {
    let mut w = world();
    let p = w.pod("default/host-friend", &[("role", "friend")], &[NODE_V4]);
    p.host_network = true;
    let p = w.pod(
        "default/remote-host-friend",
        &[("role", "friend")],
        &["192.168.0.2"],
    );
    p.host_network = true;
    p.node_name = Some("node-b".into());
    let run = w.compile();
    assert!(!run.is_endpoint("default/host-friend"));
    run.check(&[
        (
            "its address is the node's: always allowed",
            NODE_V4,
            "default/web",
            TCP,
            80,
            ALLOW,
        ),
        (
            "another node's address is not selected by labels",
            "192.168.0.2",
            "default/web",
            TCP,
            80,
            DENY,
        ),
    ]);
}

#[test]
fn pods_without_addresses_are_not_endpoints() {
    let mut w = world();
    w.pod("default/pending", &[("app", "web")], &[]);
    let run = w.compile();
    assert!(!run.is_endpoint("default/pending"));
    assert!(
        !run.compiled
            .local_pods
            .contains_key(&obj("default/pending"))
    );
    assert_eq!(
        run.compiled.local_pods[&obj("default/web")],
        vec![ip("10.0.0.10")]
    );
}

#[test]
fn same_input_gives_same_numbers_and_same_maps() {
    let a = world().compile();
    let b = world().compile();
    assert_eq!(a.compiled, b.compiled);
    let mut w = world();
    let first = w.compile();
    let second = w.compile();
    assert_eq!(
        first.compiled, second.compiled,
        "recompiling with the same allocator changes nothing"
    );
}

#[test]
fn identity_numbers_survive_unrelated_changes() {
    let mut w = world();
    let before = w.compile();
    w.pod(
        "default/extra",
        &[("role", "aaa-first-in-order")],
        &["10.0.0.99"],
    );
    w.policy("metadata: {name: other}\nspec:\n  podSelector: {matchLabels: {role: stranger}}\n  ingress: [{}]");
    let after = w.compile();
    for pod in ["default/web", "default/friend", "default/stranger"] {
        assert_eq!(before.identity_of(pod), after.identity_of(pod), "{pod}");
    }
    // And the entries of the untouched policy keep their rule_ref.
    let rr = policy::rule_ref(&obj("default/web"), INGRESS, 0);
    assert!(
        after
            .compiled
            .maps
            .policy
            .values()
            .any(|e| e.rule_ref == rr)
    );
    assert!(before.compiled.rules.contains_key(&rr));
}

#[test]
fn a_released_identity_number_is_not_reused_in_the_next_generation() {
    let mut w = world();
    let first = w.compile();
    let stranger_id = first.identity_of("default/stranger");
    w.state.pods.remove(&obj("default/stranger"));
    w.compile();
    w.pod(
        "default/someone",
        &[("role", "someone-new")],
        &["10.0.0.40"],
    );
    let third = w.compile();
    assert_ne!(third.identity_of("default/someone"), stranger_id);
}

#[test]
fn a_restart_never_reuses_a_number_whose_name_a_full_map_dropped() {
    let mut w = world();
    let first = w.compile();
    let friend = first.identity_of("default/friend");
    let web = first.identity_of("default/web");
    let stale = policy_common::policy::PolicyKey::new(
        web,
        INGRESS,
        friend,
        policy_common::proto::ANY,
        0,
        0,
    );
    assert!(first.compiled.maps.policy.contains_key(&stale));
    // The pins as a full map leaves them: friend's name went, its allow
    // row stays until the first sync of the restarted agent removes it.
    let mut maps = first.compiled.maps.clone();
    maps.identities.remove(&friend);
    w.ids = IdentityAllocator::adopt(&maps.identities, &maps.identities_in_use());
    // friend goes; stranger's new labels make a new key.
    w.state
        .pods
        .remove(&policy_agent::cluster::PodRef::new("default", "friend"));
    w.pod_mut("default/stranger")
        .labels_mut()
        .insert("role".into(), "newcomer".into());
    let second = w.compile();
    let newcomer = second.identity_of("default/stranger");
    // Its ipcache entry lands before the stale row goes (write order 5 and
    // 6): the same number would be allowed into web meanwhile.
    assert_ne!(newcomer, friend, "a number POLICY still keys");
    assert!(!maps.policy.keys().any(|k| k.peer_identity == newcomer));
}

#[test]
fn adopted_numbers_are_kept_across_restart() {
    let mut w = world();
    let first = w.compile();
    let maps = &first.compiled.maps;
    w.ids = IdentityAllocator::adopt(&maps.identities, &maps.identities_in_use());
    // A new pod sorts first, but must not take a number of the old run.
    w.pod("default/aaa", &[("aaa", "first")], &["10.0.0.50"]);
    let second = w.compile();
    for pod in ["default/web", "default/friend", "default/stranger"] {
        assert_eq!(first.identity_of(pod), second.identity_of(pod), "{pod}");
    }
    assert!(
        !first
            .compiled
            .maps
            .identities
            .contains_key(&second.identity_of("default/aaa"))
    );
}

#[test]
fn rule_refs_map_back_to_their_rules() {
    let run = world().compile();
    for entry in run.compiled.maps.policy.values() {
        let origin = &run.compiled.rules[&entry.rule_ref];
        assert_eq!(origin.policy, obj("default/web"));
        assert_eq!((origin.direction, origin.rule_index), (INGRESS, 0));
    }
}

/// The lookup bits an endpoint needs, worked out here from the policy
/// keys alone (not with the agent's `finalize`/`lookup_bits`): every port
/// prefix length in use, any-protocol, any-peer.
fn expected_bits(
    policy: &std::collections::BTreeMap<
        policy_common::policy::PolicyKey,
        policy_common::policy::PolicyEntry,
    >,
    identity: u32,
    dir: u8,
) -> u32 {
    use policy_common::endpoint::lookups;
    let mut bits = 0;
    for k in policy
        .keys()
        .filter(|k| k.endpoint_identity == identity && k.direction == dir)
    {
        bits |= if k.protocol == policy_common::proto::ANY {
            lookups::ANY_PROTOCOL
        } else {
            lookups::port_prefix(k.port_prefix_len)
        };
        let peer = k.peer_identity;
        if peer == policy_common::identity::ANY {
            bits |= lookups::ANY_PEER;
        } else if !(policy_common::identity::FIRST_LABEL..policy_common::identity::FIRST_CIDR)
            .contains(&peer)
        {
            bits |= lookups::CLASS_PEER;
        }
    }
    bits
}

fn assert_bits(maps: &policy_agent::mapstate::MapState<policy_agent::cluster::PodRef>, when: &str) {
    use policy_common::direction::EGRESS;
    for (pod, ep) in &maps.endpoints {
        assert_eq!(
            (ep.lookups(INGRESS), ep.lookups(EGRESS)),
            (
                expected_bits(&maps.policy, ep.identity, INGRESS),
                expected_bits(&maps.policy, ep.identity, EGRESS)
            ),
            "{when}: lookup bits of {pod}"
        );
    }
}

/// Shapes come and go (one port, a range, a protocol's every port, every
/// protocol, any peer); after each change the incremental compiler's
/// endpoints equal an independent full compile of the final state, and
/// both carry exactly the bits their keys need.
#[test]
fn endpoint_lookup_bits_follow_the_shapes_in_use() {
    let mut w = world();
    let mut ids = IdentityAllocator::new();
    let mut c = Compiler::build(&w.state, &mut ids, CompileOptions::default());
    assert_bits(c.maps(), "start");
    let web = obj("default/web");
    let shapes = [
        "  ingress:\n  - from: [{podSelector: {matchLabels: {role: friend}}}]\n    ports: [{port: 80}]",
        "  ingress:\n  - from: [{podSelector: {matchLabels: {role: friend}}}]\n    ports: [{port: 8000, endPort: 8100}, {protocol: UDP}]",
        "  ingress:\n  - from: [{podSelector: {matchLabels: {role: friend}}}]",
        "  ingress:\n  - ports: [{port: 80}]",
        "  ingress:\n  - {}",
        "  policyTypes: [Ingress, Egress]\n  egress:\n  - ports: [{protocol: SCTP, port: 9}]",
        "  ingress:\n  - from: [{ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.8/29]}}]\n    ports: [{port: 80}]",
        "  ingress:\n  - from: [{podSelector: {matchLabels: {role: friend}}}]\n    ports: [{port: 80}]",
    ];
    for (i, spec) in shapes.iter().enumerate() {
        w.policy(&format!(
            "metadata: {{name: web}}\nspec:\n  podSelector: {{matchLabels: {{app: web}}}}\n{spec}"
        ));
        let np = w.state.policies[&web].clone();
        let mut full_ids = ids.clone();
        c.apply([Change::UpsertPolicy(web.clone(), np)], &mut ids);
        let full = policy::compile(&w.state, &mut full_ids);
        assert_eq!(c.maps(), &full.maps, "step {i}: incremental vs full");
        assert_bits(&full.maps, &format!("step {i}, full compile"));
        assert!(
            full.maps.endpoints.values().all(|e| e.revision == 0),
            "revisions are the datapath's, not the compiler's"
        );
        // And a compile from scratch (a new allocator) agrees on the bits.
        let fresh = policy::compile(&w.state, &mut IdentityAllocator::new());
        let bits = |m: &policy_agent::mapstate::MapState<policy_agent::cluster::PodRef>| {
            m.endpoints
                .iter()
                .map(|(p, e)| (p.clone(), e.ingress_lookups, e.egress_lookups))
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&fresh.maps), bits(c.maps()), "step {i}: fresh compile");
    }
    assert!(c.maps().endpoints[&web].ingress_lookups != 0);
}

#[test]
fn incremental_relabel_matches_a_full_compile() {
    let mut w = world();
    let mut ids = IdentityAllocator::new();
    let mut c = Compiler::build(&w.state, &mut ids, CompileOptions::default());
    let before = c.maps().clone();
    let mut info = w.state.pods[&obj("default/stranger")].clone();
    info.labels_mut().insert("role".into(), "friend".into());
    w.state.pods.insert(obj("default/stranger"), info.clone());
    let mut full_ids = ids.clone();
    let ops = c.apply([Change::UpsertPod(obj("default/stranger"), info)], &mut ids);
    let full = policy::compile(&w.state, &mut full_ids);
    assert_eq!(c.maps(), &full.maps);
    assert_eq!(ops, diff(&before, &full.maps));
    assert!(!ops.is_empty());
}

#[test]
fn incremental_address_moves_recheck_named_ports_through_ip_blocks() {
    // s1 and s4 share an identity; the client may reach "http" on pods
    // wholly inside 10.0.0.0/24. When s4 moves out, s1 fails closed; when
    // it moves back, s1 is reachable again. Incremental == full each time.
    let mut w = World::new();
    w.pod("default/client", &[("app", "client")], &["10.0.0.9"]);
    w.pod("default/s1", &[("app", "server")], &["10.0.0.1"])
        .ports = vec![named_port("http", TCP, 8080)].into();
    w.pod("default/s4", &[("app", "server")], &["10.0.0.4"])
        .ports = vec![named_port("http", TCP, 8080)].into();
    w.policy("metadata: {name: out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/24}}]\n    ports: [{port: http}]");
    let mut ids = IdentityAllocator::new();
    let mut c = Compiler::build(&w.state, &mut ids, CompileOptions::default());
    let client = obj("default/client");
    let reach_s1 = |c: &Compiler| {
        let m = c.maps().to_model(|_| 0);
        let e = c.maps().endpoints[&client];
        !m.judge(
            &e,
            policy_common::direction::EGRESS,
            ip("10.0.0.1"),
            TCP,
            8080,
        )
        .reason
        .is_drop()
    };
    assert!(reach_s1(&c));
    for (addr, reachable) in [
        ("10.9.0.4", false),
        ("10.0.0.4", true),
        ("10.0.0.200", true),
    ] {
        let mut info = w.state.pods[&obj("default/s4")].clone();
        info.ips = vec![ip(addr)].into();
        w.state.pods.insert(obj("default/s4"), info.clone());
        let mut full_ids = ids.clone();
        c.apply([Change::UpsertPod(obj("default/s4"), info)], &mut ids);
        assert_eq!(
            c.maps(),
            &policy::compile(&w.state, &mut full_ids).maps,
            "s4 at {addr}"
        );
        assert_eq!(reach_s1(&c), reachable, "s4 at {addr}");
    }
}
