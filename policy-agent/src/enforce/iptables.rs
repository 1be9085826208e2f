//! The iptables enforcer: the same compiled state, rendered as ipsets and
//! chains.
use std::collections::BTreeMap;

use tracing::info;

use super::{Problem, SyncReport, bpf::drop_shared_interfaces, resolve_interfaces};
use crate::{
    cluster::{ClusterState, PodRef},
    datapath::iptables::{self, Backend, DEFAULT_MARK, Executor, RenderInput, Ruleset, render},
    identity::IdentityAllocator,
    policy::{self, Compiled},
};

pub struct IptablesEnforcer {
    pub exec: Executor,
    ids: IdentityAllocator,
    pub mark: u32,
}

impl IptablesEnforcer {
    /// Checks that ipset and the iptables tools of `backend` are usable.
    pub fn open(backend: Backend) -> Result<Self, iptables::Error> {
        let exec = Executor::new(backend);
        exec.check()?;
        Ok(Self {
            exec,
            ids: IdentityAllocator::new(),
            mark: DEFAULT_MARK,
        })
    }

    /// An enforcer that has not checked for the tools (for rendering).
    pub fn unchecked(backend: Backend) -> Self {
        Self {
            exec: Executor::new(backend),
            ids: IdentityAllocator::new(),
            mark: DEFAULT_MARK,
        }
    }

    /// The ruleset for `compiled`, with the interfaces found here.
    pub fn ruleset(&self, compiled: &Compiled) -> (Ruleset, Vec<Problem>, usize) {
        let (mut interfaces, mut problems) = resolve_interfaces(&compiled.local_pods);
        drop_shared_interfaces(&mut interfaces, &mut problems);
        let names: BTreeMap<PodRef, String> = interfaces
            .iter()
            .map(|(p, i)| (p.clone(), i.name.clone()))
            .collect();
        let ruleset = render(&RenderInput {
            maps: &compiled.maps,
            local_pods: &compiled.local_pods,
            interfaces: &names,
            rules: &compiled.rules,
            mark: self.mark,
        });
        (ruleset, problems, names.len())
    }

    pub fn compile(&mut self, state: &ClusterState) -> Compiled {
        let compiled = policy::compile(state, &mut self.ids);
        self.ids.end_generation();
        compiled
    }

    pub fn sync(&mut self, state: &ClusterState) -> Result<SyncReport, iptables::Error> {
        let compiled = self.compile(state);
        let mut report = SyncReport::default();
        report
            .problems
            .extend(compiled.errors.iter().map(Problem::from_policy_error));
        let (ruleset, problems, endpoints) = self.ruleset(&compiled);
        report.problems.extend(problems);
        let applied = self.exec.apply(&ruleset)?;
        if applied.wrote_anything() {
            info!(
                sets = applied.sets_written,
                chains = applied.chains_written,
                removed = applied.chains_removed,
                conntrack_flushed = applied.conntrack_flushed.len(),
                "iptables synced"
            );
        }
        report.writes = applied.sets_written + applied.chains_written + applied.chains_removed;
        report.endpoints = endpoints;
        Ok(report)
    }
}
