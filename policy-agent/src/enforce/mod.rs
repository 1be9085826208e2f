//! From cluster state to an enforcing datapath: compile, find the pods'
//! interfaces, write the minimal ordered diff, attach and detach.
mod bpf;
mod incremental;
mod interfaces;
mod iptables;
mod report;

use tracing::warn;

pub use self::{
    bpf::BpfEnforcer,
    incremental::{Incremental, Input, apply_to_state, changes},
    interfaces::{Interface, InterfaceCache, resolve_interfaces},
    iptables::IptablesEnforcer,
    report::{Problem, SyncReport, unready_local_pods},
};
use crate::datapath::{
    bpf::{self as bpfdp, LoadOptions, PinLayout},
    iptables::{self as ipt, Backend},
};

/// Errors of either datapath.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Bpf(#[from] bpfdp::Error),
    #[error(transparent)]
    Iptables(#[from] ipt::Error),
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Bpf(e) => e.metric_label(),
            Error::Iptables(e) => e.metric_label(),
        }
    }
}

/// Which datapath to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Choice {
    /// eBPF; iptables if BPF cannot be used here.
    #[default]
    Auto,
    Bpf,
    Iptables,
}

/// A datapath that can be kept equal to a cluster state.
pub trait Enforcer {
    fn name(&self) -> &'static str;
    fn sync(&mut self, input: Input<'_>) -> Result<SyncReport, Error>;
    /// The next sync reads the installed state back instead of trusting
    /// what this process last wrote.
    fn forget_cache(&mut self) {}
    /// Interfaces appeared or vanished: look them up again.
    fn links_changed(&mut self) {}
}

impl Enforcer for BpfEnforcer {
    fn name(&self) -> &'static str {
        "bpf"
    }
    fn sync(&mut self, input: Input<'_>) -> Result<SyncReport, Error> {
        BpfEnforcer::sync(self, input).map_err(Error::from)
    }
    fn forget_cache(&mut self) {
        BpfEnforcer::forget_cache(self);
    }
    fn links_changed(&mut self) {
        BpfEnforcer::links_changed(self);
    }
}

impl Enforcer for IptablesEnforcer {
    fn name(&self) -> &'static str {
        "iptables"
    }
    fn sync(&mut self, input: Input<'_>) -> Result<SyncReport, Error> {
        IptablesEnforcer::sync(self, input).map_err(Error::from)
    }
    fn forget_cache(&mut self) {
        self.interfaces.clear();
    }
    fn links_changed(&mut self) {
        self.interfaces.clear();
    }
}

/// Opens the chosen datapath. With [`Choice::Auto`], a BPF failure (old
/// kernel, no CAP_BPF, a program the verifier rejects) is logged once and
/// the iptables fallback is used.
pub fn open(
    choice: Choice,
    layout: &PinLayout,
    load: &LoadOptions,
    backend: Backend,
) -> Result<Box<dyn Enforcer + Send>, Error> {
    match choice {
        Choice::Bpf => Ok(Box::new(BpfEnforcer::open(layout, load)?)),
        Choice::Iptables => Ok(Box::new(IptablesEnforcer::open(backend)?)),
        Choice::Auto => match BpfEnforcer::open(layout, load) {
            Ok(e) => Ok(Box::new(e)),
            Err(e) => {
                warn!(reason = %e, "BPF datapath unavailable; falling back to iptables");
                Ok(Box::new(IptablesEnforcer::open(backend)?))
            }
        },
    }
}
