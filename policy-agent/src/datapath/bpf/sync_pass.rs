//! What one sync writes. Two paths. The full one (first sync, periodic
//! resync, interface changes) re-keys the whole compiled state by
//! interface and diffs it with what the maps hold. The incremental one
//! (every other change) takes the compiler's own minimal writes, re-keys
//! just those, and appends the revision bumps: its cost follows the size
//! of the change, not of the cluster. Either way the writes are planned
//! within the maps' capacities and applied so a failure fails closed.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use tracing::{debug, error, info, warn};

use policy_common::endpoint::{ATTACH_POD, ATTACH_STANDBY};

use super::{
    error::Error,
    foreign_programs::check_order,
    loader::{PinnedClassifier, endpoint_meta_name},
    pod_range_guard::Enforcement,
    uplinks::sync_uplinks,
};
use crate::{
    cluster::{ObjectKind, PodRef, Problem},
    datapath::{Desired, Interface, InterfaceCache, SyncReport, resolve_interfaces},
    mapstate::{MapOp, MapState, assign_revisions, diff},
};

/// After a link or pod-route event, without a full pass: every local
/// pod's interface is looked up again (one route lookup per address, no
/// map read or state diff), and the endpoint writes follow what moved: a
/// pod whose interface changed or went loses its entry (and the old
/// interface its classifiers), then a pod with an interface it did not
/// have gets its entry and is attached as any new endpoint. The periodic
/// resync re-verifies every attachment.
pub(super) fn link_ops(cache: &InterfaceCache, desired: &Desired<'_>) -> Vec<MapOp<PodRef>> {
    let (current, _) = resolve_interfaces(desired.local_pods);
    let mut deletes = Vec::new();
    let mut upserts = Vec::new();
    for pod in desired.local_pods.keys() {
        let now = current.get(pod);
        let cached = cache.get(pod);
        if cached == now {
            continue;
        }
        if cached.is_some() {
            deletes.push(MapOp::DeleteEndpoint(pod.clone()));
        }
        if let (Some(_), Some(info)) = (now, desired.maps.endpoints.get(pod)) {
            upserts.push(MapOp::UpsertEndpoint(pod.clone(), *info));
        }
    }
    deletes.extend(upserts);
    deletes
}

/// What a full pass writes: the compiled state.
pub(super) struct Compiled<'a> {
    pub(super) maps: &'a MapState<PodRef>,
    pub(super) local_pods: &'a BTreeMap<PodRef, Vec<IpAddr>>,
}

/// Re-keys the whole state and writes its difference from the maps.
pub(super) fn sync_full(
    dp: &mut PinnedClassifier,
    last: &mut Option<MapState<u32>>,
    cache: &mut InterfaceCache,
    enforcement: &mut Enforcement,
    compiled: Compiled<'_>,
    report: &mut SyncReport,
) -> Result<(), Error> {
    let Compiled { maps, local_pods } = compiled;
    let t = std::time::Instant::now();
    let (interfaces, problems) = cache.resolve(local_pods);
    report.problems.extend(problems);
    let resolve_us = t.elapsed().as_micros() as u64;
    // Addresses leave ENFORCED before anything of theirs is removed.
    enforcement.set_node(&maps.ipcache);
    let iface_of = |pod: &PodRef| interfaces.get(pod).map(|i| i.ifindex);
    enforcement.withdraw(&mut dp.maps, local_pods, &iface_of, report);

    let old = match last.take() {
        Some(state) => state,
        None => dp.maps.read_state()?,
    };
    let mut new = maps.rekey(|pod| interfaces.get(pod).map(|i| i.ifindex));
    assign_revisions(&old, &mut new);
    if enforcement.take_rejudge() {
        let next = old.next_revision();
        for ep in new.endpoints.values_mut() {
            ep.revision = next;
        }
    }
    let mut ops = diff(&old, &new);
    let diff_us = t.elapsed().as_micros() as u64;
    let unwritten = write(dp, &old, &mut ops, report);
    report.endpoints = new.endpoints.len();
    let write_us = t.elapsed().as_micros() as u64;

    // Attach after the endpoint entries exist, so the first packet on a new
    // interface is already judged. A full pass verifies every attachment.
    let meta = dp.maps.read_meta()?;
    let verify = cache.take_verify();
    let mut fresh = Vec::new();
    let mut attached = BTreeSet::new();
    for (pod, iface) in &interfaces {
        // Standby classifiers are in place but not yet the pod's: the
        // attach below finds them and records the pod.
        let known = meta
            .get(&iface.ifindex)
            .is_some_and(|m| m.attach & (ATTACH_POD | ATTACH_STANDBY) == ATTACH_POD);
        if unwritten.contains(&iface.ifindex) {
            continue; // No endpoint entry: attaching would pass it unjudged.
        }
        if !known {
            fresh.push((pod.clone(), iface.clone()));
        } else if !verify || verify_attached(dp, pod, iface, report) {
            attached.insert(iface.ifindex);
        }
    }
    attached.extend(attach_fresh(dp, &fresh, report));
    // Attached: their addresses become reachable (ENFORCED), last.
    enforcement.reset_attached(attached);
    enforcement.grant(&mut dp.maps, local_pods, &iface_of, report);
    if enforcement.take_rejudge() {
        rejudge_every_flow(dp, &mut new, report);
    }
    let wanted: BTreeSet<u32> = interfaces.values().map(|i| i.ifindex).collect();
    for (ifindex, m) in meta.iter().filter(|(i, m)| {
        !wanted.contains(i) && m.attach & (ATTACH_POD | ATTACH_STANDBY) == ATTACH_POD
    }) {
        detach(dp, *ifindex, &endpoint_meta_name(m), report);
    }
    // Interfaces without the pod classifiers (an endpoint left unwritten
    // included) carry the uplink one.
    let pods: BTreeSet<u32> = wanted.difference(&unwritten).copied().collect();
    let ingress = !enforcement.ranges().is_empty();
    sync_uplinks(dp, &pods, ingress, verify, report);
    debug!(
        resolve_us,
        diff_us,
        write_us,
        attach_us = t.elapsed().as_micros() as u64,
        "full sync"
    );
    // What did not land is written by the next full pass (over the maps
    // as read back then).
    *last = (!report.incomplete).then_some(new);
    Ok(())
}

/// Writes the compiler's own ops, re-keyed by interface, with the revision
/// bumps they imply appended last.
pub(super) fn sync_ops(
    dp: &mut PinnedClassifier,
    last: &mut Option<MapState<u32>>,
    cache: &mut InterfaceCache,
    enforcement: &mut Enforcement,
    desired: &Desired<'_>,
    ops: &[MapOp<PodRef>],
    report: &mut SyncReport,
) -> Result<(), Error> {
    let local_pods = desired.local_pods;
    let Some(mut state) = last.take() else {
        return Ok(());
    };
    // Addresses leave ENFORCED before anything of theirs is removed.
    let node_moved = ops.iter().any(|op| match op {
        MapOp::UpsertIpcache(k, v) => enforcement.node_may_change(k, Some(v)),
        MapOp::DeleteIpcache(k) => enforcement.node_may_change(k, None),
        _ => false,
    });
    if node_moved {
        enforcement.set_node(&desired.maps.ipcache);
    }
    {
        // A pod whose endpoint this sync removes (it went, or its
        // interface did) holds no interface any more: its addresses leave
        // ENFORCED now, before its entry goes and its interface is
        // detached (a moved pod's come back with its new interface, last).
        let leaving: BTreeSet<&PodRef> = ops
            .iter()
            .filter_map(|op| match op {
                MapOp::DeleteEndpoint(pod) => Some(pod),
                _ => None,
            })
            .collect();
        let iface_of = |pod: &PodRef| {
            if leaving.contains(pod) {
                return None;
            }
            cache.get(pod).map(|i| i.ifindex)
        };
        enforcement.withdraw(&mut dp.maps, local_pods, &iface_of, report);
    }
    let next_revision = state.next_revision();
    let mut writes: Vec<MapOp<u32>> = Vec::with_capacity(ops.len());
    // An address the pod-range guard covers now: every flow judged again.
    let mut bump_all = enforcement.take_rejudge();
    let mut bumped_identities = BTreeSet::new();
    let mut touched = BTreeSet::new();
    let mut fresh: Vec<(PodRef, Interface)> = Vec::new();
    let mut gone: Vec<(u32, String)> = Vec::new();
    for op in ops.iter().cloned() {
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
                        // Once: an endpoint written twice in one batch is
                        // still one interface to attach.
                        if !fresh.iter().any(|(_, i)| i.ifindex == iface.ifindex) {
                            fresh.push((pod.clone(), iface.clone()));
                        }
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
            MapOp::UpsertRuleName(k, v) => writes.push(MapOp::UpsertRuleName(k, v)),
            MapOp::DeleteRuleName(k) => writes.push(MapOp::DeleteRuleName(k)),
            MapOp::UpsertService(k, v) => writes.push(MapOp::UpsertService(k, v)),
            MapOp::DeleteService(k) => writes.push(MapOp::DeleteService(k)),
        }
    }
    let shortfall = super::capacity_plan::fit(&state, &mut writes, &dp.capacities);
    fresh.retain(|(_, iface)| !shortfall.endpoints.contains(&iface.ifindex));
    for w in &writes {
        state.apply_op(w);
    }
    // Step 8 of the diff order: the revisions, once everything else landed.
    for (ifindex, ep) in state.endpoints.iter_mut() {
        let bump = ep.revision != next_revision
            && (bump_all || bumped_identities.contains(&ep.identity) || touched.contains(ifindex));
        if bump {
            ep.revision = next_revision;
            writes.push(MapOp::UpsertEndpoint(*ifindex, *ep));
        }
    }
    report_shortfall(&shortfall, &dp.capacities, report);
    let t = std::time::Instant::now();
    let failed = apply_all(dp, &writes, report);
    let writes_us = t.elapsed().as_micros() as u64;
    report.endpoints = state.endpoints.len();
    fresh.retain(|(_, iface)| !failed.contains(&iface.ifindex));
    let t = std::time::Instant::now();
    for ifindex in attach_fresh(dp, &fresh, report) {
        enforcement.set_attached(ifindex, true);
    }
    tracing::debug!(
        writes = writes.len(),
        writes_us,
        attached = fresh.len(),
        attach_us = t.elapsed().as_micros() as u64,
        "bpf incremental writes"
    );
    let iface_of = |pod: &PodRef| cache.get(pod).map(|i| i.ifindex);
    enforcement.grant(&mut dp.maps, local_pods, &iface_of, report);
    if enforcement.take_rejudge() {
        rejudge_every_flow(dp, &mut state, report);
    }
    for (ifindex, name) in &gone {
        enforcement.set_attached(*ifindex, false);
        detach(dp, *ifindex, name, report);
    }
    // Anything short: the next sync is a full pass over the maps read back.
    *last = (!report.incomplete).then_some(state);
    Ok(())
}

/// Moves every endpoint's revision, last in a sync (after the pod-range
/// guard was turned on): each tracked flow is judged again at its next
/// packet, its peer checked by the guard its packets skip otherwise.
fn rejudge_every_flow(
    dp: &mut PinnedClassifier,
    state: &mut MapState<u32>,
    report: &mut SyncReport,
) {
    let next = state.next_revision();
    let writes: Vec<MapOp<u32>> = state
        .endpoints
        .iter_mut()
        .map(|(ifindex, ep)| {
            ep.revision = next;
            MapOp::UpsertEndpoint(*ifindex, *ep)
        })
        .collect();
    apply_all(dp, &writes, report);
}

/// Writes `ops` (turning `before` into the desired content) as far as the
/// maps have room, failing closed for the rest (see `fit`). Returns the
/// new endpoints (ifindexes) left unwritten: they must not be attached.
pub(super) fn write(
    dp: &mut PinnedClassifier,
    before: &MapState<u32>,
    ops: &mut Vec<MapOp<u32>>,
    report: &mut SyncReport,
) -> BTreeSet<u32> {
    let shortfall = super::capacity_plan::fit(before, ops, &dp.capacities);
    report_shortfall(&shortfall, &dp.capacities, report);
    let mut unwritten = apply_all(dp, ops, report);
    unwritten.extend(shortfall.endpoints);
    unwritten
}

/// Applies every write that can be applied (a failure does not stop the
/// rest: each write keeps the state safe on its own); a failed ipcache
/// write removes the entry, so an address never keeps an identity it lost.
/// Returns the endpoints whose entry could not be written.
pub(super) fn apply_all(
    dp: &mut PinnedClassifier,
    ops: &[MapOp<u32>],
    report: &mut SyncReport,
) -> BTreeSet<u32> {
    let mut unwritten = BTreeSet::new();
    for (op, e) in dp.maps.apply_all(ops) {
        error!(error = %e, op = ?op, "map write failed");
        if let MapOp::UpsertEndpoint(ifindex, _) = op {
            unwritten.insert(ifindex);
        }
        *report.map_failures.entry(e.map_name()).or_default() += 1;
        report
            .problems
            .push(Problem::node(format!("map write failed: {e}")));
        report.incomplete = true;
    }
    report.writes += ops.len();
    unwritten
}

/// Says loudly what did not fit.
pub(super) fn report_shortfall(
    s: &super::capacity_plan::Shortfall,
    caps: &super::capacity_plan::Capacities,
    report: &mut SyncReport,
) {
    if s.is_empty() {
        return;
    }
    report.incomplete = true;
    for (map, n) in &s.by_map {
        error!(
            map,
            entries = n,
            ?caps,
            "map full: entries not written, failing closed"
        );
        *report.map_failures.entry(map).or_default() += n;
        report.problems.push(Problem::node(format!(
            "map {map} is full: {n} entries not written; the pods they concern stay isolated with what fits (raise its size: --map-size {map}=N, see docs/ARCHITECTURE.md)"
        )));
    }
    if !s.identities.is_empty() {
        report.problems.push(Problem::node(format!(
            "allows missing for endpoint identities {:?} (fail closed)",
            s.identities
        )));
    }
    if !s.endpoints.is_empty() {
        report.problems.push(Problem::node(format!(
            "interfaces {:?} have no endpoint entry (the map is full): not attached, not enforced",
            s.endpoints
        )));
    }
    if s.classes_withdrawn {
        report.problems.push(Problem::node(
            "ipBlock prefixes do not fit the ipcache: every allow by address block is withdrawn",
        ));
    }
    if !s.held_closed.is_empty() {
        report.problems.push(Problem::node(format!(
            "endpoint identities {:?} refuse every new flow in a direction where a ClusterNetworkPolicy Deny or Pass by address block could not be kept (fail closed until the ipcache has room)",
            s.held_closed
        )));
    }
}

/// Makes sure a known interface still has both programs attached, and
/// that nobody else's program runs before them. False: not attached.
pub(super) fn verify_attached(
    dp: &mut PinnedClassifier,
    pod: &PodRef,
    iface: &Interface,
    report: &mut SyncReport,
) -> bool {
    let attached = match dp.attach(iface.ifindex, &pod.to_string()) {
        Ok(()) => true,
        Err(e) => {
            report
                .problems
                .push(Problem::object(ObjectKind::Pod, pod.clone(), e.to_string()));
            false
        }
    };
    check_order(dp, pod, iface, report);
    attached
}

/// New interfaces, attached together (in parallel with TCX). Returns
/// those that carry both classifiers now.
pub(super) fn attach_fresh(
    dp: &mut PinnedClassifier,
    fresh: &[(PodRef, Interface)],
    report: &mut SyncReport,
) -> BTreeSet<u32> {
    let mut done = BTreeSet::new();
    if fresh.is_empty() {
        return done;
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
                done.insert(ifindex);
                check_order(dp, pod, iface, report);
            }
            Err(e) => {
                report
                    .problems
                    .push(Problem::object(ObjectKind::Pod, pod.clone(), e.to_string()))
            }
        }
    }
    done
}

pub(super) fn detach(dp: &mut PinnedClassifier, ifindex: u32, name: &str, report: &mut SyncReport) {
    match dp.detach(ifindex) {
        Ok(()) => {
            info!(endpoint = %name, ifindex, "detached");
            report.detached.push(name.to_owned());
        }
        Err(errors) => {
            for e in errors {
                warn!(endpoint = %name, error = %e, "detach");
                report
                    .problems
                    .push(Problem::node(format!("detaching endpoint {name}: {e}")));
            }
        }
    }
}
