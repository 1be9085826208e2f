//! Datapaths: where compiled policy is enforced.
//!
//! One seam, [`Datapath`], with two drivers (the shape of netavark's
//! firewall drivers): [`bpf::driver::BpfDriver`] (pinned maps, tc classifiers) and
//! [`iptables::IptablesDriver`] (ipsets and chains rendered from the same
//! maps). The worker owns the one compiler and hands a driver the compiled
//! content ([`Desired`]) with the compiler's own ordered writes since the
//! last sync; whatever is backend-specific (identity adoption, drop
//! observers, kernel metrics) is a method of the trait.
//!
//! Datapaths read the map vocabulary ([`crate::mapstate`]) and the cluster
//! model's names; they never reach into the compiler.
pub mod bpf;
pub mod interfaces;
pub mod iptables;

use std::{collections::BTreeMap, net::IpAddr};

use tracing::warn;

pub use self::interfaces::{Interface, InterfaceCache, resolve_interfaces};
use crate::{
    cluster::{PodRef, Problem},
    identity::IdentityAllocator,
    mapstate::{MapOp, MapState, RuleOrigin},
    metrics::MetricsSource,
};

/// What the compiler wants enforced.
#[derive(Clone, Copy, Debug)]
pub struct Desired<'a> {
    /// The map content, endpoints keyed by local pod.
    pub maps: &'a MapState<PodRef>,
    /// The addresses of each local endpoint pod (its interface is found
    /// by the route to them).
    pub local_pods: &'a BTreeMap<PodRef, Vec<IpAddr>>,
    /// The rule behind each `rule_ref` (renderers name chains by policy).
    pub rules: &'a BTreeMap<u32, RuleOrigin>,
    /// The node's pod ranges (the pod-range guard). None: not known yet:
    /// the datapath keeps the guard it holds (what the pins or the
    /// installed rules say); an empty list turns it off.
    pub pod_ranges: Option<&'a [ipnet::IpNet]>,
    /// The staged view, while some policy is staged: the flow records'
    /// new flows are judged against it (see `cluster::staged`).
    pub staged: Option<&'a std::sync::Arc<crate::mapstate::StagedView>>,
}

/// The outcome of one sync.
#[derive(Clone, Debug, Default)]
pub struct SyncReport {
    /// Map writes (or sets and chains) applied.
    pub writes: usize,
    /// Local endpoints enforced.
    pub endpoints: usize,
    /// Interfaces newly attached / detached.
    pub attached: Vec<String>,
    pub detached: Vec<String>,
    /// What could not be enforced as written (e.g. an interface not found).
    pub problems: Vec<Problem>,
    /// Writes that did not land (a full map, a failed write): the state
    /// is safe (closed where short) but not the one asked for; the worker
    /// tries again soon, over the installed state read back.
    pub incomplete: bool,
    /// Entries not written, by map.
    pub map_failures: BTreeMap<&'static str, usize>,
    /// Something the sync could not finish although what it wrote is in
    /// place (iptables: a conntrack deletion failed): sync again soon.
    pub retry: bool,
}

/// Errors of either datapath.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Bpf(#[from] bpf::error::Error),
    #[error(transparent)]
    Iptables(#[from] iptables::Error),
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Bpf(e) => e.metric_label(),
            Error::Iptables(e) => e.metric_label(),
        }
    }
}

/// A datapath that can be kept equal to the compiled state.
pub trait Datapath: Send {
    /// "bpf" or "iptables", for logs and `apply`'s summary.
    fn name(&self) -> &'static str;

    /// The identity numbers the installed state already uses, so unchanged
    /// input compiles to unchanged content after a restart.
    fn adopt_identities(&mut self) -> Result<IdentityAllocator, Error> {
        Ok(IdentityAllocator::new())
    }

    /// Makes the datapath enforce `desired`. `ops` are the compiler's
    /// ordered writes since the previous call: a driver may apply just
    /// those, or compare `desired` with what is installed.
    fn sync(&mut self, desired: &Desired<'_>, ops: &[MapOp<PodRef>]) -> Result<SyncReport, Error>;

    /// The next sync reads the installed state back instead of trusting
    /// what this process last wrote (periodic resync, after a failure).
    fn forget_cache(&mut self);

    /// Interfaces appeared or vanished: look them up again.
    fn links_changed(&mut self);

    /// Whether what runs before this datapath's programs on its
    /// interfaces changed since the last look or verifying full pass (a
    /// foreign program attached to a running pod's interface): the caller
    /// then runs a full pass, which puts the classifiers first again where
    /// it can and reports the rest. Datapaths without programs: never.
    fn order_changed(&mut self) -> bool {
        false
    }

    /// A veth appeared (`ifindex`, `name`): prepare what a pod on it will
    /// need, before its hand-off asks (nothing by default).
    fn new_veth(&mut self, _ifindex: u32, _name: &str) {}

    /// Starts what observes this datapath at run time (drop events, the
    /// kernel debug log); called after successful syncs until it returns
    /// true.
    fn start_observers(&mut self) -> bool {
        true
    }

    /// Kernel-side metrics (verdict counters, map fill), if any.
    fn metrics(&self) -> Option<MetricsSource> {
        None
    }

    /// The interface (ifindex) on which `pod` is enforced now: its entry
    /// written and its programs attached (BPF, read back from the kernel),
    /// or its rules installed by the last sync (iptables). None: not (yet).
    fn enforced(&self, pod: &PodRef) -> Option<u32>;
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

/// How to open a datapath.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    pub choice: Choice,
    pub layout: bpf::pins::PinLayout,
    pub load: bpf::loader::LoadOptions,
    pub iptables: iptables::Backend,
    /// The iptables fallback's flow records (None: off).
    pub iptables_records: Option<iptables::FlowLogOptions>,
}

/// Opens the chosen datapath. With [`Choice::Auto`], a BPF failure (old
/// kernel, no CAP_BPF, a program the verifier rejects) is logged once and
/// the iptables fallback is used.
pub fn open(opts: &OpenOptions) -> Result<Box<dyn Datapath>, Error> {
    let iptables = || -> Result<Box<dyn Datapath>, Error> {
        let mut driver = iptables::IptablesDriver::open(opts.iptables)?;
        if let Some(records) = opts.iptables_records {
            driver.flow_log = Some(records);
            driver.names_file = Some(iptables::flow_log::names_path(opts.layout.root()));
            driver.flows_layout = Some(opts.layout.clone());
            driver.set_flow_log(opts.load.flows.log);
        }
        Ok(Box::new(driver))
    };
    match opts.choice {
        Choice::Bpf => Ok(Box::new(bpf::BpfDriver::open(&opts.layout, &opts.load)?)),
        Choice::Iptables => iptables(),
        Choice::Auto => match bpf::BpfDriver::open(&opts.layout, &opts.load) {
            Ok(d) => Ok(Box::new(d)),
            Err(e) => {
                warn!(reason = %e, "BPF datapath unavailable; falling back to iptables");
                iptables()
            }
        },
    }
}
