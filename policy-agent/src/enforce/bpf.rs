//! The BPF enforcer: pinned maps and programs, kept equal to the compiled
//! state of the cluster.
use std::collections::{BTreeMap, BTreeSet};

use tracing::{debug, info, warn};

use super::{Interface, Problem, SyncReport, resolve_interfaces};
use crate::{
    cluster::{ClusterState, PodRef},
    datapath::bpf::{BpfDatapath, Error, LoadOptions, PinLayout},
    identity::IdentityAllocator,
    mapstate::{MapState, assign_revisions, diff},
    policy::{self, Compiled},
};

pub struct BpfEnforcer {
    pub dp: BpfDatapath,
    ids: IdentityAllocator,
    /// What the maps hold after the last sync (this agent is their only
    /// writer), so a sync diffs in memory instead of reading every map.
    last: Option<MapState<u32>>,
}

impl BpfEnforcer {
    /// Opens (or creates) the pinned datapath and adopts the identity
    /// numbers an earlier agent left in it, so unchanged input compiles to
    /// unchanged maps.
    pub fn open(layout: &PinLayout, opts: &LoadOptions) -> Result<Self, Error> {
        let dp = BpfDatapath::open(layout, opts)?;
        let existing = dp.maps.read_state()?.identities;
        let ids = IdentityAllocator::adopt(&existing);
        Ok(Self {
            dp,
            ids,
            last: None,
        })
    }

    /// Compiles `state` and makes the datapath enforce it.
    pub fn sync(&mut self, state: &ClusterState) -> Result<SyncReport, Error> {
        let compiled = policy::compile(state, &mut self.ids);
        self.sync_compiled(&compiled)
    }

    /// Makes the datapath enforce `compiled`.
    pub fn sync_compiled(&mut self, compiled: &Compiled) -> Result<SyncReport, Error> {
        let mut report = SyncReport::default();
        report
            .problems
            .extend(compiled.errors.iter().map(Problem::from_policy_error));
        let (mut interfaces, problems) = resolve_interfaces(&compiled.local_pods);
        report.problems.extend(problems);
        drop_shared_interfaces(&mut interfaces, &mut report.problems);

        let old = match self.last.take() {
            Some(state) => state,
            None => self.dp.maps.read_state()?,
        };
        let mut new = compiled
            .maps
            .rekey(|pod| interfaces.get(pod).map(|i| i.ifindex));
        assign_revisions(&old, &mut new);
        let ops = diff(&old, &new);
        debug!(writes = ops.len(), "applying map diff");
        // On failure the maps hold an unknown prefix of the writes: the
        // next sync reads them back rather than trusting a cache.
        self.dp.maps.apply(&ops)?;
        report.writes = ops.len();
        report.endpoints = new.endpoints.len();

        // Attach after the endpoint entries exist, so the first packet on a
        // new interface is already judged.
        let meta = self.dp.maps.read_meta()?;
        for (pod, iface) in &interfaces {
            let fresh = !meta.contains_key(&iface.ifindex);
            match self.dp.attach(iface.ifindex, &pod.to_string()) {
                Ok(()) if fresh => {
                    info!(pod = %pod, interface = %iface.name, "attached");
                    report.attached.push(iface.name.clone());
                }
                Ok(()) => {}
                Err(e) => report.problems.push(Problem {
                    object: format!("pod {pod}"),
                    reason: e.to_string(),
                }),
            }
        }
        let wanted: BTreeSet<u32> = interfaces.values().map(|i| i.ifindex).collect();
        for (ifindex, m) in meta.iter().filter(|(i, _)| !wanted.contains(i)) {
            let name = String::from_utf8_lossy(&m.name[..(m.name_len as usize).min(m.name.len())])
                .into_owned();
            match self.dp.detach(*ifindex) {
                Ok(()) => {
                    info!(endpoint = %name, ifindex, "detached");
                    report.detached.push(name);
                }
                Err(errors) => {
                    for e in errors {
                        warn!(endpoint = %name, error = %e, "detach");
                        report.problems.push(Problem {
                            object: format!("endpoint {name}"),
                            reason: e.to_string(),
                        });
                    }
                }
            }
        }
        self.ids.end_generation();
        self.last = Some(new);
        Ok(report)
    }

    /// Makes the next sync read the maps back from the kernel (periodic
    /// resync: heals any drift from writes by others).
    pub fn forget_cache(&mut self) {
        self.last = None;
    }
}

/// Two pods routed to one interface cannot both be that endpoint: keep
/// the first, report the rest.
pub(super) fn drop_shared_interfaces(
    interfaces: &mut BTreeMap<PodRef, Interface>,
    problems: &mut Vec<Problem>,
) {
    let mut owner: BTreeMap<u32, PodRef> = BTreeMap::new();
    let mut drop = Vec::new();
    for (pod, iface) in interfaces.iter() {
        if let Some(first) = owner.get(&iface.ifindex) {
            problems.push(Problem {
                object: format!("pod {pod}"),
                reason: format!(
                    "its interface {} already belongs to pod {first}",
                    iface.name
                ),
            });
            drop.push(pod.clone());
        } else {
            owner.insert(iface.ifindex, pod.clone());
        }
    }
    for pod in drop {
        interfaces.remove(&pod);
    }
}
