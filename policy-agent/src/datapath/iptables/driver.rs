//! The iptables driver: the same compiled state, rendered as ipsets and
//! chains and applied (only what differs from what is installed).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use tracing::info;

use super::{
    Backend, DEFAULT_MARK, Error, Executor, NAME_BITS, RenderInput, Ruleset, pod_range_guard,
    render,
};
use crate::{
    cluster::{ObjectKind, PodRef, Problem},
    datapath::{self, Datapath, Desired, InterfaceCache, SyncReport},
    mapstate::MapOp,
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
        }
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
        let mut ruleset = render(&RenderInput {
            maps: desired.maps,
            local_pods: desired.local_pods,
            interfaces: &names,
            rules: desired.rules,
            mark: self.mark,
            name_bits: NAME_BITS,
        });
        let indexes: BTreeMap<PodRef, u32> = interfaces
            .iter()
            .map(|(p, i)| (p.clone(), i.ifindex))
            .collect();
        let enforced = enforced_addresses(desired, &indexes, |_, _| true);
        pod_range_guard::add(&mut ruleset, &self.pod_ranges, &enforced);
        (ruleset, problems, indexes)
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
        if let Some(r) = &first {
            self.exec.apply(r)?;
        }
        let applied = self.exec.apply(&ruleset)?;
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
    }

    fn enforced(&self, pod: &PodRef) -> Option<u32> {
        self.installed.get(pod).copied()
    }

    fn links_changed(&mut self) {
        self.interfaces.clear();
    }
}
