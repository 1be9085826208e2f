//! The iptables enforcer: the same compiled state, rendered as ipsets and
//! chains.
use std::{collections::BTreeMap, net::IpAddr};

use tracing::info;

use super::{
    InterfaceCache, Problem, SyncReport,
    incremental::{Incremental, Input},
    unready_local_pods,
};
use crate::{
    cluster::PodRef,
    datapath::iptables::{self, Backend, DEFAULT_MARK, Executor, RenderInput, Ruleset, render},
    identity::IdentityAllocator,
    mapstate::MapState,
    policy::RuleOrigin,
};

pub struct IptablesEnforcer {
    pub exec: Executor,
    inc: Incremental,
    pub(super) interfaces: InterfaceCache,
    pub mark: u32,
}

impl IptablesEnforcer {
    /// Checks that ipset and the iptables tools of `backend` are usable.
    pub fn open(backend: Backend) -> Result<Self, iptables::Error> {
        let exec = Executor::new(backend);
        exec.check()?;
        Ok(Self::unchecked_with(exec))
    }

    /// An enforcer that has not checked for the tools (for rendering).
    pub fn unchecked(backend: Backend) -> Self {
        Self::unchecked_with(Executor::new(backend))
    }

    fn unchecked_with(exec: Executor) -> Self {
        Self {
            exec,
            inc: Incremental::new(IdentityAllocator::new()),
            interfaces: InterfaceCache::default(),
            mark: DEFAULT_MARK,
        }
    }

    /// The ruleset for `input`, with the interfaces found here: (ruleset,
    /// problems, endpoints rendered).
    pub fn ruleset(&mut self, input: Input<'_>) -> (Ruleset, Vec<Problem>, usize) {
        self.inc.update(input);
        let compiler = self.inc.compiler();
        let mut problems: Vec<Problem> = compiler
            .errors()
            .iter()
            .map(Problem::from_policy_error)
            .collect();
        problems.extend(unready_local_pods(self.inc.state()));
        let rules = compiler.rules();
        let (ruleset, more, n) = render_parts(
            &mut self.interfaces,
            compiler.maps(),
            compiler.local_pods(),
            &rules,
            self.mark,
        );
        problems.extend(more);
        (ruleset, problems, n)
    }

    pub fn sync(&mut self, input: Input<'_>) -> Result<SyncReport, iptables::Error> {
        let (ruleset, problems, endpoints) = self.ruleset(input);
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
        Ok(SyncReport {
            writes: applied.sets_written + applied.chains_written + applied.chains_removed,
            endpoints,
            problems,
            ..Default::default()
        })
    }
}

fn render_parts(
    cache: &mut InterfaceCache,
    maps: &MapState<PodRef>,
    local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
    rules: &BTreeMap<u32, RuleOrigin>,
    mark: u32,
) -> (Ruleset, Vec<Problem>, usize) {
    let (interfaces, problems) = cache.resolve(local_pods);
    let names: BTreeMap<PodRef, String> = interfaces
        .iter()
        .map(|(p, i)| (p.clone(), i.name.clone()))
        .collect();
    let ruleset = render(&RenderInput {
        maps,
        local_pods,
        interfaces: &names,
        rules,
        mark,
    });
    (ruleset, problems, names.len())
}
