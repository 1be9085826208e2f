//! The iptables driver: the same compiled state, rendered as ipsets and
//! chains and applied (only what differs from what is installed).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::PathBuf,
};

use tracing::{info, warn};

use super::{
    Backend, DEFAULT_MARK, Error, Executor, FlowLogOptions, NAME_BITS, RenderInput, Ruleset,
    flow_log::{self, IptablesNames},
    pod_range_guard, render_with,
};
use crate::{
    cluster::{ObjectKind, PodRef, Problem},
    datapath::bpf::{
        flows::{FlowLog, pipeline::FlowObserver},
        pins::PinLayout,
    },
    datapath::{self, Datapath, Desired, InterfaceCache, SyncReport},
    mapstate::{MapOp, fnv1a64},
    metrics::MetricsSource,
};

pub struct IptablesDriver {
    pub exec: Executor,
    interfaces: InterfaceCache,
    pub mark: u32,
    /// The pods whose rules the last successful sync installed, and their
    /// interfaces.
    installed: BTreeMap<PodRef, u32>,
    /// The pod ranges: traffic from or to an address in them that no
    /// installed pod holds is dropped. Read from the installed rules at
    /// open, they stay until the node's are known.
    pub pod_ranges: Vec<ipnet::IpNet>,
    /// Flow records: each new flow's verdict logged to this NFLOG group,
    /// within this budget (None: off).
    pub flow_log: Option<FlowLogOptions>,
    /// Where every sync writes the names flow records need (the rules,
    /// identities and local pods; see `flow_log::names`). None: nowhere.
    pub names_file: Option<PathBuf>,
    /// The hash of what the names file last got (None: write it).
    names_written: Option<u64>,
    /// The names the last sync left in the file.
    names_last: Option<IptablesNames>,
    /// The daemon's flow thread on the NFLOG group, and the pin root its
    /// subscribers' socket is named after.
    flows: FlowObserver,
    pub flows_layout: Option<PinLayout>,
}

impl IptablesDriver {
    /// Checks that ipset and the iptables tools of `backend` are usable,
    /// and reads the pod ranges the installed guard holds.
    pub fn open(backend: Backend) -> Result<Self, Error> {
        let exec = Executor::new(backend);
        exec.check()?;
        let held = exec.installed_pod_ranges()?;
        if !held.is_empty() {
            info!(ranges = ?held, "pod ranges as installed, kept until this node's are known");
        }
        let mut this = Self::unchecked_with(exec);
        this.pod_ranges = held;
        Ok(this)
    }

    /// A driver that has not checked for the tools (for rendering).
    pub fn unchecked(backend: Backend) -> Self {
        Self::unchecked_with(Executor::new(backend))
    }

    fn unchecked_with(exec: Executor) -> Self {
        Self {
            exec,
            interfaces: InterfaceCache::default(),
            mark: DEFAULT_MARK,
            installed: BTreeMap::new(),
            pod_ranges: Vec::new(),
            flow_log: None,
            names_file: None,
            names_written: None,
            names_last: None,
            flows: FlowObserver::new(FlowLog::default()),
            flows_layout: None,
        }
    }

    /// Which records the daemon's flow thread logs.
    pub fn set_flow_log(&mut self, log: FlowLog) {
        self.flows = FlowObserver::new(log);
    }

    /// The ruleset for `desired`, with the interfaces found here: (ruleset,
    /// problems, endpoints rendered).
    pub fn ruleset(&mut self, desired: &Desired<'_>) -> (Ruleset, Vec<Problem>, usize) {
        let (ruleset, problems, interfaces) = self.ruleset_for(desired);
        (ruleset, problems, interfaces.len())
    }

    fn ruleset_for(
        &mut self,
        desired: &Desired<'_>,
    ) -> (Ruleset, Vec<Problem>, BTreeMap<PodRef, u32>) {
        let (interfaces, problems) = self.interfaces.resolve(desired.local_pods);
        let names: BTreeMap<PodRef, String> = interfaces
            .iter()
            .map(|(p, i)| (p.clone(), i.name.clone()))
            .collect();
        let mut ruleset = render_with(
            &RenderInput {
                maps: desired.maps,
                local_pods: desired.local_pods,
                interfaces: &names,
                rules: desired.rules,
                mark: self.mark,
                name_bits: NAME_BITS,
            },
            self.flow_log.as_ref(),
        );
        let indexes: BTreeMap<PodRef, u32> = interfaces
            .iter()
            .map(|(p, i)| (p.clone(), i.ifindex))
            .collect();
        let enforced = enforced_addresses(desired, &indexes, |_, _| true);
        pod_range_guard::add(&mut ruleset, &self.pod_ranges, &enforced);
        (ruleset, problems, indexes)
    }

    /// The names the rules of `desired` can record (None: no names file).
    fn names_for(
        &self,
        desired: &Desired<'_>,
        interfaces: &BTreeMap<PodRef, u32>,
    ) -> Option<IptablesNames> {
        self.names_file.as_ref()?;
        Some(IptablesNames {
            group: self.flow_log.map(|o| o.group),
            rules: desired.maps.rule_names.clone(),
            identities: desired.maps.identities.clone(),
            pods: interfaces
                .iter()
                .map(|(pod, ifindex)| (*ifindex, pod.to_string()))
                .collect(),
            pod_addresses: interfaces
                .iter()
                .map(|(pod, ifindex)| {
                    let ips = desired.local_pods.get(pod).cloned().unwrap_or_default();
                    (*ifindex, ips)
                })
                .collect(),
        })
    }

    /// Writes the names file when it is asked for and its content changed
    /// (a failure is a problem of the node, not of enforcement).
    fn write_names(&mut self, names: &IptablesNames) -> Option<Problem> {
        let path = self.names_file.as_ref()?;
        let hash = fnv1a64(names.to_json().as_bytes());
        if self.names_written == Some(hash) {
            return None;
        }
        match flow_log::write_names(path, names) {
            Ok(()) => {
                self.names_written = Some(hash);
                None
            }
            Err(e) => {
                warn!(error = %e, "cannot write the names of flow records");
                Some(Problem::node(format!(
                    "iptables: {e}; flow records are not named until it is written"
                )))
            }
        }
    }
}

/// The enforced local addresses: the node's own, and those of the pods in
/// `interfaces` (with an endpoint entry) that `keep` accepts.
fn enforced_addresses(
    desired: &Desired<'_>,
    interfaces: &BTreeMap<PodRef, u32>,
    keep: impl Fn(&PodRef, u32) -> bool,
) -> BTreeSet<IpAddr> {
    let node = desired.maps.ipcache.iter().filter(|(net, e)| {
        e.identity == policy_common::identity::NODE && net.prefix_len() == net.max_prefix_len()
    });
    let mut out: BTreeSet<IpAddr> = node.map(|(net, _)| net.addr()).collect();
    for (pod, ifindex) in interfaces {
        if desired.maps.endpoints.contains_key(pod) && keep(pod, *ifindex) {
            out.extend(desired.local_pods.get(pod).into_iter().flatten().copied());
        }
    }
    out
}

impl Datapath for IptablesDriver {
    fn name(&self) -> &'static str {
        "iptables"
    }

    /// Renders the whole ruleset (the compiler's ops are not needed: what
    /// is installed is read back and only what differs is written).
    fn sync(
        &mut self,
        desired: &Desired<'_>,
        _ops: &[MapOp<PodRef>],
    ) -> Result<SyncReport, datapath::Error> {
        if let Some(ranges) = desired.pod_ranges
            && ranges != self.pod_ranges.as_slice()
        {
            info!(?ranges, "pod ranges");
            self.pod_ranges = ranges.to_vec();
        }
        let (ruleset, mut problems, interfaces) = self.ruleset_for(desired);
        let endpoints = interfaces.len();
        problems.extend(ruleset.problems.iter().cloned());
        // With pod ranges, a new pod's address joins the enforced set only
        // once its chains are in (a second apply), and a gone pod's leaves
        // it before its chains go (the first: sets are written first).
        let installed = std::mem::take(&mut self.installed);
        let before = enforced_addresses(desired, &interfaces, |pod, ifindex| {
            installed.get(pod) == Some(&ifindex)
        });
        let mut first = None;
        if !self.pod_ranges.is_empty() {
            let mut r = ruleset.clone();
            pod_range_guard::set_enforced(&mut r, &before);
            if r != ruleset {
                first = Some(r);
            }
        }
        // Names go in before the rules that can record them (with those of
        // the rules still in place), and what only the old rules named
        // goes after them: a record is never made with a number the file
        // does not name yet.
        let names = self.names_for(desired, &interfaces);
        if let Some(new) = &names {
            let both = match &self.names_last {
                Some(last) => last.union(new),
                None => new.clone(),
            };
            problems.extend(self.write_names(&both));
        }
        if let Some(r) = &first {
            self.exec.apply(r)?;
        }
        let applied = self.exec.apply(&ruleset)?;
        if let Some(new) = names {
            problems.extend(self.write_names(&new));
            self.names_last = Some(new);
        }
        self.installed = interfaces;
        if applied.wrote_anything() {
            info!(
                sets = applied.sets_written,
                chains = applied.chains_written,
                removed = applied.chains_removed,
                conntrack_flushed = applied.conntrack_flushed.len(),
                "iptables synced"
            );
        }
        // The rules are in place, but flows they now deny may still pass:
        // report each, and have the worker come back soon to retry.
        for (pod, ip, error) in &applied.conntrack_failed {
            problems.push(Problem::object(
                ObjectKind::Pod,
                pod.clone(),
                format!(
                    "iptables: cannot revoke the conntrack entries of {ip} ({error}); its established flows keep their old verdict until a retry succeeds"
                ),
            ));
        }
        // After the rules: records of flows judged before stay judged
        // against the view before.
        self.flows.set_staged(desired.staged);
        Ok(SyncReport {
            writes: applied.sets_written + applied.chains_written + applied.chains_removed,
            endpoints,
            problems,
            retry: !applied.conntrack_failed.is_empty(),
            ..Default::default()
        })
    }

    fn forget_cache(&mut self) {
        self.interfaces.clear();
        // A periodic resync also puts back a names file someone removed.
        self.names_written = None;
    }

    /// The flow thread on the NFLOG group (records on), named from the
    /// names file the syncs write.
    fn start_observers(&mut self) -> bool {
        let (Some(opts), Some(path), Some(layout)) = (
            self.flow_log,
            self.names_file.clone(),
            self.flows_layout.clone(),
        ) else {
            return true;
        };
        self.flows.start(&layout, || {
            let reader =
                flow_log::IptablesFlowReader::open(opts.group).map_err(|e| e.to_string())?;
            Ok((reader, flow_log::FileNames::new(&path)))
        })
    }

    /// The flows' figures: per-policy counters and lost records.
    fn metrics(&self) -> Option<MetricsSource> {
        self.flow_log?;
        let stats = self.flows.stats();
        let backend = self.exec.backend;
        Some(std::sync::Arc::new(move |out: &mut String| {
            let limited = flow_log::limited_records(backend).unwrap_or(0);
            let lost = stats.source_lost.load(std::sync::atomic::Ordering::Relaxed);
            stats.render(out, limited, lost);
        }))
    }

    fn enforced(&self, pod: &PodRef) -> Option<u32> {
        self.installed.get(pod).copied()
    }

    fn links_changed(&mut self) {
        self.interfaces.clear();
    }
}
