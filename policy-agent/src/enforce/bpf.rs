//! The BPF enforcer: pinned maps and programs, kept equal to the compiled
//! state of the cluster.
use std::collections::{BTreeMap, BTreeSet, btree_map::Entry};
use std::net::IpAddr;

use tracing::{debug, info, warn};

use super::{Interface, InterfaceCache, Problem, SyncReport, incremental::Incremental};
use crate::{
    cluster::{ClusterState, PodRef},
    datapath::bpf::{BpfDatapath, Error, LoadOptions, PinLayout},
    identity::IdentityAllocator,
    mapstate::{MapState, assign_revisions, diff},
    policy::PolicyError,
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
        let existing = dp.maps.read_state()?.identities;
        let ids = IdentityAllocator::adopt(&existing);
        Ok(Self {
            dp,
            inc: Incremental::new(ids),
            last: None,
            interfaces: InterfaceCache::default(),
        })
    }

    /// Compiles `state` (incrementally after the first call) and makes the
    /// datapath enforce it.
    pub fn sync(&mut self, state: &ClusterState) -> Result<SyncReport, Error> {
        let compiler = self.inc.update(state);
        let errors = compiler.errors();
        sync_parts(
            &mut self.dp,
            &mut self.last,
            &mut self.interfaces,
            compiler.maps(),
            compiler.local_pods(),
            &errors,
        )
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

/// Makes the datapath enforce `maps`.
fn sync_parts(
    dp: &mut BpfDatapath,
    last: &mut Option<MapState<u32>>,
    cache: &mut InterfaceCache,
    maps: &MapState<PodRef>,
    local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
    errors: &[PolicyError],
) -> Result<SyncReport, Error> {
    let mut report = SyncReport::default();
    report
        .problems
        .extend(errors.iter().map(Problem::from_policy_error));
    let (mut interfaces, problems) = cache.resolve(local_pods);
    report.problems.extend(problems);
    drop_shared_interfaces(&mut interfaces, &mut report.problems);

    let old = match last.take() {
        Some(state) => state,
        None => dp.maps.read_state()?,
    };
    let mut new = maps.rekey(|pod| interfaces.get(pod).map(|i| i.ifindex));
    assign_revisions(&old, &mut new);
    let ops = diff(&old, &new);
    debug!(writes = ops.len(), "applying map diff");
    // On failure the maps hold an unknown prefix of the writes: the next
    // sync reads them back rather than trusting a cache.
    dp.maps.apply(&ops)?;
    report.writes = ops.len();
    report.endpoints = new.endpoints.len();

    // Attach after the endpoint entries exist, so the first packet on a new
    // interface is already judged. Interfaces already recorded are left
    // alone: attachments are pinned, and a link event resyncs them.
    let meta = dp.maps.read_meta()?;
    let verify = cache.take_verify();
    for (pod, iface) in &interfaces {
        let known = meta.get(&iface.ifindex);
        if !verify && known.is_some_and(|m| m.attach != 0) {
            continue;
        }
        let fresh = known.is_none();
        match dp.attach(iface.ifindex, &pod.to_string()) {
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
        match dp.detach(*ifindex) {
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
    *last = Some(new);
    Ok(report)
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
        match owner.entry(iface.ifindex) {
            Entry::Occupied(first) => {
                problems.push(Problem {
                    object: format!("pod {pod}"),
                    reason: format!(
                        "its interface {} already belongs to pod {}",
                        iface.name,
                        first.get()
                    ),
                });
                drop.push(pod.clone());
            }
            Entry::Vacant(v) => {
                v.insert(pod.clone());
            }
        }
    }
    for pod in drop {
        interfaces.remove(&pod);
    }
}
