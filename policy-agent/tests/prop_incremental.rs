//! The incremental compiler equals a full compile after every change, its
//! ops are exactly `mapstate::diff`, and applying a diff to the old state
//! gives the new one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod prop_oracle;

use std::net::IpAddr;

use policy_agent::{
    cluster::{Change, ClusterState, PodRef},
    identity::IdentityAllocator,
    mapstate::{MapOp, MapState, diff},
    policy::{self, CompileOptions, Compiler},
};
use prop_oracle::{NAMESPACES, cluster};
use proptest::prelude::*;

/// Applies `ops` to `state` as a datapath would.
fn apply_ops(state: &mut MapState<PodRef>, ops: &[MapOp<PodRef>]) {
    for op in ops {
        state.apply_op(op);
    }
}

/// Turns a step (kind, index) into a change that moves `state` towards
/// `target`, and applies it to `state`.
fn step(state: &mut ClusterState, target: &ClusterState, kind: u8, i: usize) -> Change {
    let pick = |n: usize| i % n.max(1);
    match kind % 9 {
        // A pod of the target (new, or replacing one: relabel, new IPs...).
        0 | 1 if !target.pods.is_empty() => {
            let (name, info) = target.pods.iter().nth(pick(target.pods.len())).unwrap();
            state.pods.insert(name.clone(), info.clone());
            Change::UpsertPod(name.clone(), info.clone())
        }
        // Relabel an existing pod with the labels of a target pod.
        2 if !state.pods.is_empty() && !target.pods.is_empty() => {
            let name = state
                .pods
                .keys()
                .nth(pick(state.pods.len()))
                .unwrap()
                .clone();
            let labels = target
                .pods
                .values()
                .nth(pick(target.pods.len()))
                .unwrap()
                .labels
                .clone();
            let info = state.pods.get_mut(&name).unwrap();
            info.labels = labels;
            Change::UpsertPod(name, info.clone())
        }
        // Move an existing pod to other addresses (reuse, conflicts).
        3 if !state.pods.is_empty() && !target.pods.is_empty() => {
            let name = state
                .pods
                .keys()
                .nth(pick(state.pods.len()))
                .unwrap()
                .clone();
            let ips: Vec<IpAddr> = target
                .pods
                .values()
                .nth(pick(target.pods.len()))
                .unwrap()
                .ips
                .clone();
            let info = state.pods.get_mut(&name).unwrap();
            info.ips = ips;
            Change::UpsertPod(name, info.clone())
        }
        4 if !state.pods.is_empty() => {
            let name = state
                .pods
                .keys()
                .nth(pick(state.pods.len()))
                .unwrap()
                .clone();
            state.pods.remove(&name);
            Change::DeletePod(name)
        }
        5 => {
            let ns = NAMESPACES[pick(NAMESPACES.len())];
            let info = target.namespaces[ns].clone();
            state.namespaces.insert(ns.into(), info.clone());
            Change::UpsertNamespace(ns.into(), info)
        }
        6 if !target.policies.is_empty() => {
            let (name, np) = target
                .policies
                .iter()
                .nth(pick(target.policies.len()))
                .unwrap();
            // Under a name that may already exist: an update.
            let mut name = name.clone();
            name.name = format!("policy{}", i % 3);
            state.policies.insert(name.clone(), np.clone());
            Change::UpsertPolicy(name, Box::new(np.clone()))
        }
        7 if !state.policies.is_empty() => {
            let name = state
                .policies
                .keys()
                .nth(pick(state.policies.len()))
                .unwrap()
                .clone();
            state.policies.remove(&name);
            Change::DeletePolicy(name)
        }
        8 if i.is_multiple_of(4) => {
            state.node_ips = target
                .pods
                .values()
                .flat_map(|p| p.ips.iter().copied())
                .take(1)
                .collect();
            Change::Node {
                name: state.node_name.clone(),
                ips: state.node_ips.clone(),
            }
        }
        _ => {
            state.namespaces.remove("ns2");
            Change::DeleteNamespace("ns2".into())
        }
    }
}

fn run_steps(
    initial: ClusterState,
    target: ClusterState,
    steps: Vec<(u8, usize)>,
    options: CompileOptions,
) -> Result<(), TestCaseError> {
    let mut state = initial;
    let mut ids = IdentityAllocator::new();
    let mut inc = Compiler::build(&state, &mut ids, options);
    for (kind, i) in steps {
        let before = inc.maps().clone();
        let change = step(&mut state, &target, kind, i);
        let label = format!("{change:?}");
        let mut full_ids = ids.clone();
        let ops = inc.apply([change], &mut ids);
        let full = policy::compile_with(&state, &mut full_ids, options);
        prop_assert_eq!(inc.maps(), &full.maps, "after {}", label);
        prop_assert_eq!(inc.local_pods(), &full.local_pods, "after {}", label);
        prop_assert_eq!(inc.errors(), full.errors.clone(), "after {}", label);
        prop_assert_eq!(inc.rules(), full.rules.clone(), "after {}", label);
        let want = diff(&before, &full.maps);
        prop_assert_eq!(&ops, &want, "ops after {}", label);
        let mut replay = before;
        apply_ops(&mut replay, &ops);
        prop_assert_eq!(&replay, &full.maps);
        let mut finalized = full.maps.clone();
        finalized.finalize();
        prop_assert_eq!(&finalized, inc.maps(), "lookup bits kept exact");
    }
    Ok(())
}

fn steps() -> impl Strategy<Value = Vec<(u8, usize)>> {
    proptest::collection::vec((0u8..9, 0usize..64), 1..=6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn incremental_equals_full_compile(initial in cluster(), target in cluster(), steps in steps()) {
        run_steps(initial, target, steps, CompileOptions::default())?;
    }

    #[test]
    fn incremental_equals_full_compile_with_every_pod_local(initial in cluster(), target in cluster(), steps in steps()) {
        run_steps(initial, target, steps, CompileOptions { all_pods_local: true })?;
    }

    #[test]
    fn a_diff_applied_to_the_old_state_gives_the_new(a in cluster(), b in cluster()) {
        let mut ids = IdentityAllocator::new();
        let old = policy::compile(&a, &mut ids).maps;
        let new = policy::compile(&b, &mut ids).maps;
        let ops = diff(&old, &new);
        let mut replay = old.clone();
        apply_ops(&mut replay, &ops);
        prop_assert_eq!(replay, new);
    }

    #[test]
    fn numbers_in_one_generation_are_not_reused_by_another_key_in_the_next(a in cluster(), b in cluster()) {
        let mut ids = IdentityAllocator::new();
        let old = policy::compile(&a, &mut ids).maps;
        let new = policy::compile(&b, &mut ids).maps;
        for (id, name) in &new.identities {
            if let Some(prev) = old.identities.get(id) {
                prop_assert_eq!(prev, name, "identity {} changed meaning", id);
            }
        }
    }
}
