//! One incremental compiler per enforcer. Input is either a whole cluster
//! state (turned into the changes since the last one) or the changes
//! themselves (a watch or a changed manifest file); only those are
//! compiled. The full compile runs once, at the first input.
use std::collections::BTreeMap;

use crate::{
    cluster::{ClusterState, PodRef},
    identity::IdentityAllocator,
    mapstate::MapOp,
    policy::{Change, CompileOptions, Compiler},
};

/// What a sync starts from.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// The whole state (first sync, `apply`, a re-list).
    State(&'a ClusterState),
    /// What changed since the previous input.
    Changes(&'a [Change]),
}

pub struct Incremental {
    pub ids: IdentityAllocator,
    compiler: Option<Compiler>,
    /// The state compiled so far (kept in step with the compiler).
    state: ClusterState,
}

impl Incremental {
    pub fn new(ids: IdentityAllocator) -> Self {
        Self {
            ids,
            compiler: None,
            state: ClusterState::default(),
        }
    }

    /// The cluster state compiled so far.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The compiler (call [`Incremental::update`] first).
    pub fn compiler(&self) -> &Compiler {
        match &self.compiler {
            Some(c) => c,
            None => unreachable!("update() runs before compiler()"),
        }
    }

    /// Brings the compiler up to `input`. Returns, when it compiled
    /// incrementally, the map writes that changed (None after the first,
    /// full compile: the caller diffs the whole state).
    pub fn update(&mut self, input: Input<'_>) -> Option<Vec<MapOp<PodRef>>> {
        // Before the first compile nothing is compiled to change from.
        let compiled = self.compiler.is_some();
        let changes = match input {
            Input::State(state) => {
                let changes = if compiled {
                    changes(&self.state, state)
                } else {
                    Vec::new()
                };
                self.state = state.clone();
                changes
            }
            Input::Changes(changes) => {
                for change in changes {
                    apply_to_state(&mut self.state, change);
                }
                if compiled {
                    changes.to_vec()
                } else {
                    Vec::new()
                }
            }
        };
        let Some(compiler) = self.compiler.as_mut() else {
            // `build` ends its own identity generation.
            self.compiler = Some(Compiler::build(
                &self.state,
                &mut self.ids,
                CompileOptions::default(),
            ));
            return None;
        };
        Some(if changes.is_empty() {
            Vec::new()
        } else {
            compiler.apply(changes, &mut self.ids)
        })
    }
}

/// Applies one change to a cluster state.
pub fn apply_to_state(state: &mut ClusterState, change: &Change) {
    match change {
        Change::UpsertPod(k, v) => {
            state.pods.insert(k.clone(), v.clone());
        }
        Change::DeletePod(k) => {
            state.pods.remove(k);
        }
        Change::UpsertNamespace(k, v) => {
            state.namespaces.insert(k.clone(), v.clone());
        }
        Change::DeleteNamespace(k) => {
            state.namespaces.remove(k);
        }
        Change::UpsertPolicy(k, v) => {
            state.policies.insert(k.clone(), (**v).clone());
        }
        Change::DeletePolicy(k) => {
            state.policies.remove(k);
        }
        Change::Node { name, ips } => {
            state.node_name = name.clone();
            state.node_ips = ips.clone();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ObjectRef, PodInfo};

    #[test]
    fn changes_replayed_on_the_old_state_give_the_new_state() {
        let mut old = ClusterState {
            node_name: "n".into(),
            ..Default::default()
        };
        old.pods
            .insert(ObjectRef::new("a", "p1"), PodInfo::default());
        old.pods
            .insert(ObjectRef::new("a", "p2"), PodInfo::default());
        let mut new = old.clone();
        new.pods.remove(&ObjectRef::new("a", "p1"));
        new.pods
            .get_mut(&ObjectRef::new("a", "p2"))
            .unwrap()
            .labels
            .insert("x".into(), "y".into());
        new.node_ips = vec!["10.0.0.1".parse().unwrap()];
        let mut replay = old.clone();
        for c in changes(&old, &new) {
            apply_to_state(&mut replay, &c);
        }
        assert_eq!(replay.pods, new.pods);
        assert_eq!(replay.node_ips, new.node_ips);
    }
}
