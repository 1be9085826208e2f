//! Keeps one incremental compiler per enforcer: a new cluster snapshot is
//! turned into the changes since the last one, and only those are
//! compiled (the full compile runs once, at the first snapshot).
use std::collections::BTreeMap;

use crate::{
    cluster::ClusterState,
    identity::IdentityAllocator,
    policy::{Change, CompileOptions, Compiler},
};

pub struct Incremental {
    pub ids: IdentityAllocator,
    compiler: Option<Compiler>,
    last: Option<ClusterState>,
}

impl Incremental {
    pub fn new(ids: IdentityAllocator) -> Self {
        Self {
            ids,
            compiler: None,
            last: None,
        }
    }

    /// Brings the compiler up to `state` and returns it.
    pub fn update(&mut self, state: &ClusterState) -> &Compiler {
        match (self.compiler.as_mut(), self.last.as_ref()) {
            (Some(compiler), Some(last)) => {
                let changes = changes(last, state);
                if !changes.is_empty() {
                    compiler.apply(changes, &mut self.ids);
                }
            }
            _ => {
                // `build` ends its own identity generation.
                self.compiler = Some(Compiler::build(state, &mut self.ids, CompileOptions::default()));
            }
        }
        self.last = Some(state.clone());
        match &self.compiler {
            Some(c) => c,
            None => unreachable!("set above"),
        }
    }
}

fn keyed_changes<K: Ord + Clone, V: PartialEq + Clone>(
    old: &BTreeMap<K, V>,
    new: &BTreeMap<K, V>,
    upsert: impl Fn(K, V) -> Change,
    delete: impl Fn(K) -> Change,
    out: &mut Vec<Change>,
) {
    for (k, v) in new {
        if old.get(k) != Some(v) {
            out.push(upsert(k.clone(), v.clone()));
        }
    }
    for k in old.keys().filter(|k| !new.contains_key(*k)) {
        out.push(delete(k.clone()));
    }
}

/// What changed from `old` to `new`, namespaces before pods before policies.
pub fn changes(old: &ClusterState, new: &ClusterState) -> Vec<Change> {
    let mut out = Vec::new();
    if old.node_name != new.node_name || old.node_ips != new.node_ips {
        out.push(Change::Node {
            name: new.node_name.clone(),
            ips: new.node_ips.clone(),
        });
    }
    keyed_changes(
        &old.namespaces,
        &new.namespaces,
        Change::UpsertNamespace,
        Change::DeleteNamespace,
        &mut out,
    );
    keyed_changes(
        &old.pods,
        &new.pods,
        Change::UpsertPod,
        Change::DeletePod,
        &mut out,
    );
    keyed_changes(
        &old.policies,
        &new.policies,
        |k, v| Change::UpsertPolicy(k, Box::new(v)),
        Change::DeletePolicy,
        &mut out,
    );
    out
}
