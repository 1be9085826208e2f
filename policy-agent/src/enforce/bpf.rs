//! The BPF enforcer: pinned maps and programs, kept equal to the compiled
//! state of the cluster.
//!
//! Two paths. The full one (first sync, periodic resync, interface
//! changes) re-keys the whole compiled state by interface and diffs it with
//! what the maps hold. The incremental one (every other change) takes the
//! compiler's own minimal writes, re-keys just those, and appends the
//! revision bumps: its cost follows the size of the change, not of the
//! cluster.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use tracing::{debug, info, warn};

use super::{
    Interface, InterfaceCache, Problem, SyncReport,
    incremental::{Incremental, Input},
    unready_local_pods,
};
use crate::{
    cluster::PodRef,
    datapath::bpf::{BpfDatapath, Error, LoadOptions, PinLayout, endpoint_meta_name},
    identity::IdentityAllocator,
    mapstate::{MapOp, MapState, assign_revisions, diff},
};

pub struct BpfEnforcer {
    pub dp: BpfDatapath,
    inc: Incremental,
    /// What the maps hold after the last sync (this agent is their only
    /// writer), so a sync diffs in memory instead of reading every map.
    last: Option<MapState<u32>>,
    interfaces: InterfaceCache,
}

impl BpfEnforcer {
    /// Opens (or creates) the pinned datapath and adopts the identity
    /// numbers an earlier agent left in it, so unchanged input compiles to
    /// unchanged maps.
    pub fn open(layout: &PinLayout, opts: &LoadOptions) -> Result<Self, Error> {
        let dp = BpfDatapath::open(layout, opts)?;
        let existing = dp.maps.read_identities()?;
        let ids = IdentityAllocator::adopt(&existing);
        Ok(Self {
            dp,
            inc: Incremental::new(ids),
            last: None,
            interfaces: InterfaceCache::default(),
        })
    }

    /// Compiles `input` (incrementally after the first sync) and makes the
    /// datapath enforce it.
    pub fn sync(&mut self, input: Input<'_>) -> Result<SyncReport, Error> {
        let t = std::time::Instant::now();
        let ops = self.inc.update(input);
        let compile_us = t.elapsed().as_micros() as u64;
        let compiler = self.inc.compiler();
        let mut report = SyncReport::default();
        report
            .problems
            .extend(compiler.errors().iter().map(Problem::from_policy_error));
        report.problems.extend(unready_local_pods(self.inc.state()));
        let incremental =
            ops.is_some() && self.last.is_some() && !self.interfaces.needs_full_pass();
        match ops {
            Some(ops) if incremental => sync_ops(
                &mut self.dp,
                &mut self.last,
                &mut self.interfaces,
                compiler.local_pods(),
                ops,
                &mut report,
            )?,
            _ => sync_full(
                &mut self.dp,
                &mut self.last,
                &mut self.interfaces,
                compiler.maps(),
                compiler.local_pods(),
                &mut report,
            )?,
        }
        debug!(
            compile_us,
            total_us = t.elapsed().as_micros() as u64,
            incremental,
            writes = report.writes,
            "bpf sync"
        );
        Ok(report)
    }

    /// Makes the next sync read the maps back from the kernel and look the
    /// interfaces up again (periodic resync: heals drift).
    pub fn forget_cache(&mut self) {
        self.last = None;
        self.interfaces.clear();
    }

    /// Interfaces appeared or vanished: look them up again.
    pub fn links_changed(&mut self) {
        self.interfaces.clear();
    }
}

/// Re-keys the whole state and writes its difference from the maps.
fn sync_full(
    dp: &mut BpfDatapath,
    last: &mut Option<MapState<u32>>,
    cache: &mut InterfaceCache,
    maps: &MapState<PodRef>,
    local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
    report: &mut SyncReport,
) -> Result<(), Error> {
    let t = std::time::Instant::now();
    let (interfaces, problems) = cache.resolve(local_pods);
    report.problems.extend(problems);
    let resolve_us = t.elapsed().as_micros() as u64;

    let old = match last.take() {
        Some(state) => state,
        None => dp.maps.read_state()?,
    };
    let mut new = maps.rekey(|pod| interfaces.get(pod).map(|i| i.ifindex));
    assign_revisions(&old, &mut new);
    let ops = diff(&old, &new);
    // On failure the maps hold an unknown prefix of the writes: the next
    // sync reads them back rather than trusting a cache.
    let diff_us = t.elapsed().as_micros() as u64;
    dp.maps.apply(&ops)?;
    report.writes = ops.len();
    report.endpoints = new.endpoints.len();
    let write_us = t.elapsed().as_micros() as u64;

    // Attach after the endpoint entries exist, so the first packet on a new
    // interface is already judged. A full pass verifies every attachment.
    let meta = dp.maps.read_meta()?;
    let verify = cache.take_verify();
    let mut fresh = Vec::new();
    for (pod, iface) in &interfaces {
        let known = meta.get(&iface.ifindex).is_some_and(|m| m.attach != 0);
        if !known {
            fresh.push((pod.clone(), iface.clone()));
        } else if verify {
            verify_attached(dp, pod, iface, report);
        }
    }
    attach_fresh(dp, &fresh, report);
    let wanted: BTreeSet<u32> = interfaces.values().map(|i| i.ifindex).collect();
    for (ifindex, m) in meta.iter().filter(|(i, _)| !wanted.contains(i)) {
        detach(dp, *ifindex, &endpoint_meta_name(m), report);
    }
    debug!(
        resolve_us,
        diff_us,
        write_us,
        attach_us = t.elapsed().as_micros() as u64,
        "full sync"
    );
    *last = Some(new);
    Ok(())
}

/// Writes the compiler's own ops, re-keyed by interface, with the revision
/// bumps they imply appended last.
fn sync_ops(
    dp: &mut BpfDatapath,
    last: &mut Option<MapState<u32>>,
    cache: &mut InterfaceCache,
    local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
    ops: Vec<MapOp<PodRef>>,
    report: &mut SyncReport,
) -> Result<(), Error> {
    let Some(mut state) = last.take() else {
        return Ok(());
    };
    let next_revision = state.next_revision();
    let mut writes: Vec<MapOp<u32>> = Vec::with_capacity(ops.len());
    let mut bump_all = false;
    let mut bumped_identities = BTreeSet::new();
    let mut touched = BTreeSet::new();
    let mut fresh: Vec<(PodRef, Interface)> = Vec::new();
    let mut gone: Vec<(u32, String)> = Vec::new();
    for op in ops {
        match op {
            MapOp::UpsertEndpoint(pod, mut info) => {
                let Some(ips) = local_pods.get(&pod) else {
                    continue;
                };
                let (iface, problems) = cache.resolve_one(&pod, ips);
                report.problems.extend(problems);
                let Some(iface) = iface else { continue };
                match state.endpoints.get(&iface.ifindex) {
                    Some(prev) => {
                        info.revision = prev.revision;
                        touched.insert(iface.ifindex);
                    }
                    None => {
                        info.revision = next_revision;
                        fresh.push((pod.clone(), iface.clone()));
                    }
                }
                writes.push(MapOp::UpsertEndpoint(iface.ifindex, info));
            }
            MapOp::DeleteEndpoint(pod) => {
                if let Some(iface) = cache.forget(&pod) {
                    writes.push(MapOp::DeleteEndpoint(iface.ifindex));
                    gone.push((iface.ifindex, pod.to_string()));
                }
            }
            MapOp::UpsertPolicy(k, v) => {
                bumped_identities.insert(k.endpoint_identity);
                writes.push(MapOp::UpsertPolicy(k, v));
            }
            MapOp::DeletePolicy(k) => {
                bumped_identities.insert(k.endpoint_identity);
                writes.push(MapOp::DeletePolicy(k));
            }
            MapOp::UpsertIpcache(k, v) => {
                bump_all = true;
                writes.push(MapOp::UpsertIpcache(k, v));
            }
            MapOp::DeleteIpcache(k) => {
                bump_all = true;
                writes.push(MapOp::DeleteIpcache(k));
            }
            MapOp::UpsertIdentity(k, v) => writes.push(MapOp::UpsertIdentity(k, v)),
            MapOp::DeleteIdentity(k) => writes.push(MapOp::DeleteIdentity(k)),
        }
    }
    for w in &writes {
        state.apply_op(w);
    }
    // Step 9 of the diff order: the revisions, once everything else landed.
    for (ifindex, ep) in state.endpoints.iter_mut() {
        let bump = ep.revision != next_revision
            && (bump_all || bumped_identities.contains(&ep.identity) || touched.contains(ifindex));
        if bump {
            ep.revision = next_revision;
            writes.push(MapOp::UpsertEndpoint(*ifindex, *ep));
        }
    }
    // On failure an unknown prefix is written: `last` stays None, so the
    // next sync reads the maps back.
    dp.maps.apply(&writes)?;
    report.writes = writes.len();
    report.endpoints = state.endpoints.len();
    attach_fresh(dp, &fresh, report);
    for (ifindex, name) in &gone {
        detach(dp, *ifindex, name, report);
    }
    *last = Some(state);
    Ok(())
}

/// Makes sure a known interface still has both programs attached.
fn verify_attached(dp: &mut BpfDatapath, pod: &PodRef, iface: &Interface, report: &mut SyncReport) {
    if let Err(e) = dp.attach(iface.ifindex, &pod.to_string()) {
        report.problems.push(Problem {
            object: format!("pod {pod}"),
            reason: e.to_string(),
        });
    }
}

/// New interfaces, attached together (in parallel with TCX).
fn attach_fresh(dp: &mut BpfDatapath, fresh: &[(PodRef, Interface)], report: &mut SyncReport) {
    if fresh.is_empty() {
        return;
    }
    let items: Vec<(u32, String)> = fresh
        .iter()
        .map(|(p, i)| (i.ifindex, p.to_string()))
        .collect();
    for (ifindex, result) in dp.attach_many(&items) {
        let Some((pod, iface)) = fresh.iter().find(|(_, i)| i.ifindex == ifindex) else {
            continue;
        };
        match result {
            Ok(()) => {
                info!(pod = %pod, interface = %iface.name, "attached");
                report.attached.push(iface.name.clone());
            }
            Err(e) => report.problems.push(Problem {
                object: format!("pod {pod}"),
                reason: e.to_string(),
            }),
        }
    }
}

fn detach(dp: &mut BpfDatapath, ifindex: u32, name: &str, report: &mut SyncReport) {
    match dp.detach(ifindex) {
        Ok(()) => {
            info!(endpoint = %name, ifindex, "detached");
            report.detached.push(name.to_owned());
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
