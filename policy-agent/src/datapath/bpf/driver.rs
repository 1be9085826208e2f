//! The BPF driver: pinned maps and programs, kept equal to the compiled
//! state of the cluster. Which path a sync takes is decided here; what
//! each path writes is `sync_pass.rs`.
use std::collections::BTreeSet;

use tracing::debug;

use policy_common::endpoint::ATTACH_POD;

use super::{
    error::Error,
    flows::pipeline::FlowObserver,
    foreign_programs::OrderWatch,
    loader::{LoadOptions, PinnedClassifier},
    observe,
    pins::PinLayout,
    pod_range_guard::Enforcement,
    standing_problems::StandingProblems,
    sync_pass::{Compiled, link_ops, sync_full, sync_ops},
    uplinks::sync_uplinks,
};
use crate::{
    cluster::PodRef,
    datapath::{self, Datapath, Desired, InterfaceCache, SyncReport},
    identity::IdentityAllocator,
    mapstate::{MapOp, MapState},
    metrics::MetricsSource,
};

pub struct BpfDriver {
    pub(super) dp: PinnedClassifier,
    /// What the maps hold after the last sync (this agent is their only
    /// writer), so a sync diffs in memory instead of reading every map.
    last: Option<MapState<u32>>,
    interfaces: InterfaceCache,
    /// The flow thread (the ring's one reader) and its figures.
    flows: FlowObserver,
    kernel_log: bool,
    /// `--conntrack-share`, and whether its counting thread runs.
    conntrack_share: (Option<u32>, bool),
    /// The pod ranges and the enforced local addresses.
    enforcement: Enforcement,
    /// What ran before the classifiers after the last full pass.
    order: OrderWatch,
    /// Problems found and not fixed since (see `standing.rs`).
    standing: StandingProblems,
    /// An earlier layout's pins are still there (see `earlier_layout`).
    earlier_pins: bool,
}

impl BpfDriver {
    /// Opens (or creates) the pinned datapath.
    pub fn open(layout: &PinLayout, opts: &LoadOptions) -> Result<Self, Error> {
        let mut dp = PinnedClassifier::open(layout, opts)?;
        let enforcement = Enforcement::open(&mut dp.maps)?;
        Ok(Self {
            dp,
            enforcement,
            last: None,
            // The first sync checks every attachment the pins record: while
            // no agent ran, an interface may have lost its programs or been
            // made again under the same index.
            interfaces: InterfaceCache::verifying(),
            flows: FlowObserver::new(opts.flows.log),
            kernel_log: false,
            conntrack_share: (opts.conntrack_share, false),
            order: OrderWatch::default(),
            standing: StandingProblems::default(),
            earlier_pins: !super::earlier_layout::earlier(layout).is_empty(),
        })
    }

    fn sync_bpf(
        &mut self,
        desired: &Desired<'_>,
        ops: &[MapOp<PodRef>],
    ) -> Result<SyncReport, Error> {
        let t = std::time::Instant::now();
        let mut report = SyncReport::default();
        let ranges_changed =
            self.enforcement
                .set_ranges(&mut self.dp.maps, desired.pod_ranges, &mut report);
        let links_changed = self.interfaces.take_links_changed();
        let incremental = self.last.is_some() && !self.interfaces.needs_full_pass();
        // Names this sync removes go to the flow thread first.
        let names_before = if incremental {
            None
        } else {
            self.last.as_ref().map(|s| s.rule_names.clone())
        };
        if let Some(last) = &self.last
            && incremental
        {
            let retiring = ops
                .iter()
                .filter_map(|op| match op {
                    MapOp::DeleteRuleName(k) => last.rule_names.get(k).map(|n| (*k, *n)),
                    _ => None,
                })
                .collect();
            self.flows.retire(retiring);
        }
        if incremental {
            let mut ops: Vec<MapOp<PodRef>> = ops.to_vec();
            // A full pass looks every interface up itself.
            if links_changed {
                ops.extend(link_ops(&self.interfaces, desired));
            }
            // The pods this sync looks at again: those it resolves (and
            // attaches) afresh, and those that go. A pod whose interface
            // it already holds is rewritten, not looked at: its problems
            // (an attach that failed, a program ahead) stand.
            let looked_at: BTreeSet<PodRef> =
                ops.iter()
                    .filter_map(|op| match op {
                        MapOp::UpsertEndpoint(pod, _) => {
                            let held = desired.local_pods.get(pod).is_some_and(|ips| {
                                self.interfaces.ips(pod) == Some(ips.as_slice())
                            });
                            (!held).then(|| pod.clone())
                        }
                        MapOp::DeleteEndpoint(pod) => Some(pod.clone()),
                        _ => None,
                    })
                    .collect();
            sync_ops(
                &mut self.dp,
                &mut self.last,
                &mut self.interfaces,
                &mut self.enforcement,
                desired,
                &ops,
                &mut report,
            )?;
            if (links_changed || ranges_changed)
                && let Some(state) = &self.last
            {
                // A new interface that is no pod's carries the uplink
                // classifiers from now on; one that became a pod's loses
                // them. The ingress one is there only with pod ranges.
                let pods: BTreeSet<u32> = state.endpoints.keys().copied().collect();
                let ingress = !self.enforcement.ranges().is_empty();
                sync_uplinks(&mut self.dp, &pods, ingress, false, &mut report);
            }
            report.problems =
                self.standing
                    .update(&report.problems, &looked_at, desired.local_pods);
        } else {
            let verifies = self.interfaces.needs_full_pass();
            sync_full(
                &mut self.dp,
                &mut self.last,
                &mut self.interfaces,
                &mut self.enforcement,
                Compiled {
                    maps: desired.maps,
                    local_pods: desired.local_pods,
                },
                &mut report,
            )?;
            if verifies {
                self.order.settle(&mut self.dp);
            }
            // A full pass removed what the compiled state no longer names
            // (after the fact: the names are kept for records still read).
            if let (Some(before), Some(now)) = (names_before, &self.last) {
                let gone = before
                    .into_iter()
                    .filter(|(k, _)| !now.rule_names.contains_key(k))
                    .collect();
                self.flows.retire(gone);
            }
            report.problems = self.standing.replace(&report.problems);
            self.retire_earlier_layouts(&report);
        }
        // A sync that returns has the programs in place: at a first start
        // they load in the background while the first compile runs and the
        // maps are written; readiness waits for them here.
        self.dp.wait_for_programs()?;
        debug!(
            total_us = t.elapsed().as_micros() as u64,
            incremental,
            writes = report.writes,
            "bpf sync"
        );
        Ok(report)
    }
}

impl BpfDriver {
    /// After a full pass without problems, this agent's programs are on
    /// every interface it enforces: an earlier layout's pins may go. With
    /// a problem (an interface it could not attach to, say) they stay,
    /// and that interface keeps the earlier programs rather than none.
    fn retire_earlier_layouts(&mut self, report: &SyncReport) {
        if !self.earlier_pins {
            return;
        }
        if !report.problems.is_empty() {
            debug!("the pins of an earlier layout stay until a full pass without problems");
            return;
        }
        self.earlier_pins = !super::earlier_layout::retire(&self.dp.layout);
    }
}

impl Datapath for BpfDriver {
    fn name(&self) -> &'static str {
        "bpf"
    }

    /// The numbers an earlier agent left in the maps
    /// ([`super::maps::adopt_from`]).
    /// The state read is kept as the first full pass's "before": the
    /// maps are read once at a start, not twice.
    fn adopt_identities(&mut self) -> Result<IdentityAllocator, datapath::Error> {
        let state = self.dp.maps.read_state()?;
        let ids = super::maps::adopt_from(&state);
        self.last = Some(state);
        Ok(ids)
    }

    fn sync(
        &mut self,
        desired: &Desired<'_>,
        ops: &[MapOp<PodRef>],
    ) -> Result<SyncReport, datapath::Error> {
        let report = self.sync_bpf(desired, ops)?;
        // After the writes: records of flows the kernel judged before
        // stay judged against the view before.
        self.flows.set_staged(desired.staged);
        Ok(report)
    }

    /// Makes the next sync read the maps back from the kernel and look the
    /// interfaces up again (periodic resync: heals drift).
    fn forget_cache(&mut self) {
        self.last = None;
        self.interfaces.clear();
        self.enforcement.forget();
    }

    fn links_changed(&mut self) {
        self.interfaces.links_changed();
    }

    fn order_changed(&mut self) -> bool {
        self.order.changed(&mut self.dp)
    }

    /// The pod classifiers go on a new veth at once (standby, see
    /// `ATTACH_STANDBY`), outside any sync: the CNI hand-off that follows
    /// within milliseconds then finds them attached. Only where the agent
    /// attached no pod classifiers yet and no endpoint is written. A sync
    /// that ran on its peer's event may have given it the uplink
    /// classifiers already: a standby interface carries those too.
    fn new_veth(&mut self, ifindex: u32, name: &str) {
        let untouched = self
            .dp
            .maps
            .meta(ifindex)
            .is_none_or(|m| m.attach & ATTACH_POD == 0)
            && self
                .last
                .as_ref()
                .is_some_and(|s| !s.endpoints.contains_key(&ifindex));
        if untouched {
            super::uplinks::standby(&mut self.dp, ifindex, name);
        }
    }

    /// The flow thread is retried until it runs; the kernel log follower
    /// is started once (it would run twice).
    fn start_observers(&mut self) -> bool {
        let flows = observe::start_flows(&mut self.flows, &self.dp.layout);
        if !self.kernel_log {
            self.kernel_log = true;
            observe::follow_kernel_log(self.dp.programs.id(super::pins::Hook::Ingress));
        }
        if !self.conntrack_share.1 {
            self.conntrack_share.1 =
                super::conntrack_share::spawn(&self.dp.layout, self.conntrack_share.0);
        }
        flows && self.conntrack_share.1
    }

    fn enforced(&self, pod: &PodRef) -> Option<u32> {
        // From the kernel: the entry is there, the programs attached, and
        // the addresses in ENFORCED (peers may reach the pod).
        let ifindex = self.interfaces.get(pod)?.ifindex;
        self.dp.maps.endpoint(ifindex).ok().flatten()?;
        let attached = self.dp.maps.meta(ifindex)?.attach & ATTACH_POD != 0;
        let ips = self.interfaces.ips(pod)?;
        (attached && Enforcement::holds(&self.dp.maps, ifindex, ips)).then_some(ifindex)
    }

    fn metrics(&self) -> Option<MetricsSource> {
        let layout = self.dp.layout.clone();
        let flows = self.flows.stats();
        Some(std::sync::Arc::new(move |out: &mut String| {
            observe::render_metrics(out, &layout, Some(&flows))
        }))
    }
}
