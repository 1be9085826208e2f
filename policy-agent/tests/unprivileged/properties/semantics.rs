//! Random clusters and policies: the compiled maps, judged as the kernel
//! does (`policy_common::model::Maps::judge`), agree with an independent
//! evaluator of the spec (`support::oracle`) on every flow.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::support::{
    cnp_oracle::cluster_with_tiers,
    oracle::{PORTS, World, addresses, cluster, policy_valid},
};
use policy_agent::{
    cluster::{ClusterState, ObjectRef},
    identity::IdentityAllocator,
    policy::{self, CompileOptions, Compiled, ExplainQuery, FlowEnd},
};
use policy_common::{direction, model::has_ports, proto};
use proptest::{prelude::*, test_runner::FileFailurePersistence};

/// (protocol, port) pairs probed for every address pair.
fn flows() -> Vec<(u8, u16)> {
    let mut v: Vec<(u8, u16)> = PORTS.iter().map(|p| (proto::TCP, *p)).collect();
    v.extend([
        (proto::UDP, 53),
        (proto::UDP, 8080),
        (proto::SCTP, 80),
        (proto::ICMP, 0),
        (proto::TCP, 1),
    ]);
    v
}

/// The compiled verdict, judged like the datapath: egress at the source's
/// endpoint, ingress at the destination's.
fn map_allows(
    c: &Compiled,
    model: &policy_common::model::Maps,
    owner: &BTreeMap<IpAddr, ObjectRef>,
    s: IpAddr,
    d: IpAddr,
    p: u8,
    port: u16,
) -> bool {
    if s == d {
        return true;
    }
    let port = if has_ports(p) { port } else { 0 };
    let mut ok = true;
    if let Some(ep) = owner.get(&s).and_then(|o| c.maps.endpoints.get(o)) {
        ok &= !model
            .judge(ep, direction::EGRESS, d, p, port)
            .reason
            .is_drop();
    }
    if let Some(ep) = owner.get(&d).and_then(|o| c.maps.endpoints.get(o)) {
        ok &= !model
            .judge(ep, direction::INGRESS, s, p, port)
            .reason
            .is_drop();
    }
    ok
}

fn check(state: &ClusterState, all_local: bool) -> Result<(), TestCaseError> {
    let mut ids = IdentityAllocator::new();
    let c = policy::compile_with(
        state,
        &mut ids,
        CompileOptions {
            all_pods_local: all_local,
            ..CompileOptions::default()
        },
    );
    let model = c.maps.to_model(|_| 0);
    let world = World::new(state, all_local);
    let owner: BTreeMap<IpAddr, ObjectRef> = c
        .local_pods
        .iter()
        .flat_map(|(p, ips)| ips.iter().map(move |ip| (*ip, p.clone())))
        .collect();
    let addrs = addresses(state);
    for s in &addrs {
        for d in addrs.iter().filter(|d| d.is_ipv4() == s.is_ipv4()) {
            for (p, port) in flows() {
                let want = world.allows(*s, *d, p, port);
                let got = map_allows(&c, &model, &owner, *s, *d, p, port);
                prop_assert_eq!(
                    got,
                    want,
                    "{} -> {} proto {} port {}\nerrors: {:?}",
                    s,
                    d,
                    p,
                    port,
                    c.errors
                );
            }
        }
    }
    Ok(())
}

/// Policies the compiler reports errors for.
fn failing(c: &Compiled) -> BTreeSet<ObjectRef> {
    c.errors.iter().map(|e| e.policy().clone()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: super::cases(300),
        // Beside this file (a test binary's module has no src/ for the
        // default to find).
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn compiled_maps_agree_with_the_spec(state in cluster()) {
        check(&state, false)?;
    }

    #[test]
    fn compiled_maps_agree_with_the_spec_when_all_pods_are_local(state in cluster()) {
        check(&state, true)?;
    }

    /// ClusterNetworkPolicies of both tiers, priorities and Pass chains
    /// beside NetworkPolicies: the maps, judged as the kernel does, agree
    /// with the reference evaluator on every flow.
    #[test]
    fn compiled_tiers_agree_with_the_reference_evaluator(state in cluster_with_tiers()) {
        check(&state, true)?;
    }

    #[test]
    fn compiled_tiers_agree_with_the_reference_evaluator_on_this_node(state in cluster_with_tiers()) {
        check(&state, false)?;
    }

    #[test]
    fn errors_are_reported_exactly_for_invalid_policies(state in cluster()) {
        let c = policy::compile(&state, &mut IdentityAllocator::new());
        let invalid: BTreeSet<ObjectRef> =
            state.policies.iter().filter(|(_, np)| !policy_valid(np)).map(|(n, _)| n.clone()).collect();
        prop_assert_eq!(failing(&c), invalid);
        for e in &c.errors {
            let text = e.to_string();
            prop_assert!(text.starts_with("networkpolicy "), "{}", text);
            prop_assert!(e.field().starts_with("spec."), "{}", text);
        }
    }

    #[test]
    fn explain_agrees_with_the_maps(state in cluster(), pick in 0usize..1000, flow in 0usize..10) {
        let mut ids = IdentityAllocator::new();
        let c = policy::compile_with(&state, &mut ids, CompileOptions {
            all_pods_local: true,
            ..CompileOptions::default()
        });
        let addrs = addresses(&state);
        let s = addrs[pick % addrs.len()];
        let same: Vec<IpAddr> = addrs.iter().copied().filter(|d| d.is_ipv4() == s.is_ipv4()).collect();
        let d = same[(pick / 7) % same.len()];
        let (p, port) = flows()[flow % flows().len()];
        let q = ExplainQuery { src: FlowEnd::Ip(s), dst: FlowEnd::Ip(d), protocol: p, port };
        let ex = policy::explain(&state, &c, &q).unwrap();
        prop_assert!(ex.consistent(), "{}", ex);
        let want = World::new(&state, true).allows(s, d, p, port);
        prop_assert_eq!(ex.allowed, want, "{}", ex);
    }
}
