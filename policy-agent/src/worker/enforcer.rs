//! One datapath and the one compiler that feeds it: changes in, an
//! enforcing datapath out. `apply` uses it once; the worker keeps it.
use std::time::Instant;

use tracing::debug;

use super::staging::Staging;
use crate::{
    cluster::Change,
    datapath::{self, Datapath, Desired, OpenOptions, SyncReport},
    identity::IdentityAllocator,
    metrics::MetricsSource,
    policy::{CompileOptions, Compiler},
};

pub struct Enforcer {
    datapath: Box<dyn Datapath>,
    ids: IdentityAllocator,
    compiler: Compiler,
    /// The staged view, while some policy is staged.
    staging: Staging,
}

impl Enforcer {
    /// Opens the datapath and adopts the identity numbers it already uses,
    /// so unchanged input compiles to unchanged content.
    pub fn open(opts: &OpenOptions, compile: CompileOptions) -> Result<Self, datapath::Error> {
        let mut datapath = datapath::open(opts)?;
        let ids = datapath.adopt_identities()?;
        Ok(Self {
            datapath,
            ids,
            compiler: Compiler::new(compile),
            staging: Staging::default(),
        })
    }

    pub fn datapath(&mut self) -> &mut dyn Datapath {
        self.datapath.as_mut()
    }

    pub fn datapath_ref(&self) -> &dyn Datapath {
        self.datapath.as_ref()
    }

    /// What the datapath reports at scrape time.
    pub fn metrics(&self) -> Option<MetricsSource> {
        self.datapath.metrics()
    }

    pub fn compiler(&self) -> &Compiler {
        &self.compiler
    }

    /// Whether the node's pod ranges are known (the pod-range guard is
    /// what they say, not only what was held).
    pub fn pod_ranges_known(&self) -> bool {
        self.compiler.pod_ranges().is_some()
    }

    /// The next enforce compiles in full if a policy is refused for a
    /// budget (the periodic resync: refused policies come back by
    /// themselves once they fit).
    pub fn recompile_refused(&mut self) {
        self.compiler.recompile_if_refused();
    }

    /// Compiles `changes` (in full the first time) and makes the datapath
    /// enforce the result. The report's problems start with the
    /// compiler's (invalid policies, pods without an address).
    pub fn enforce(&mut self, changes: Vec<Change>) -> Result<SyncReport, datapath::Error> {
        let t = Instant::now();
        let (changes, staged_changes) = self.staging.split(changes);
        let mut ops = self.compiler.apply(changes, &mut self.ids);
        self.staging
            .follow(&self.compiler, &self.ids, staged_changes);
        // Only marks pods tracked: no verdict moves, in any order.
        ops.extend(
            self.compiler
                .track_staged(self.staging.tracked(&self.compiler)),
        );
        let compile_us = t.elapsed().as_micros() as u64;
        let rules = self.compiler.rules();
        let staged = self.staging.view();
        let desired = Desired {
            maps: self.compiler.maps(),
            local_pods: self.compiler.local_pods(),
            rules: &rules,
            pod_ranges: self.compiler.pod_ranges(),
            staged: staged.as_ref(),
        };
        let mut report = self.datapath.sync(&desired, &ops)?;
        let mut problems = self.compiler.problems();
        problems.extend(self.staging.problems());
        problems.append(&mut report.problems);
        report.problems = problems;
        debug!(
            compile_us,
            total_us = t.elapsed().as_micros() as u64,
            ops = ops.len(),
            "enforced"
        );
        Ok(report)
    }
}
