//! The pod-range guard's maps (see `policy_common::pod_range_guard`): `POD_RANGES`, the
//! node's pod ranges (the Node's `spec.podCIDRs` or `--pod-cidr`), and
//! `ENFORCED`, every local address whose interface carries both pod
//! classifiers (and the node's own).
//!
//! The ranges in the pins stay until the node's are known: an agent that
//! cannot read its Node at start keeps the guard the previous one armed.
//! Only ranges known to be none turn it off.
//!
//! Order is the point. An address enters `ENFORCED` only after its
//! interface is attached ([`Enforcement::grant`], last in a sync) and
//! leaves it before its endpoint entry goes and its interface is detached
//! ([`Enforcement::withdraw`], first in a sync). The `CONFIG_POD_RANGES`
//! bit that turns the kernel check on is set only once `ENFORCED` has
//! been filled, so turning the flag on never cuts enforced pods off.
//!
//! The classifier skips the guard for a packet of a flow tracked at its
//! endpoint's current revision (the guard is an LPM lookup on every
//! packet otherwise). So whatever makes an address newly guarded (it
//! leaves `ENFORCED`, the ranges change, the check is turned on) moves
//! every endpoint's revision: each flow is judged again, its peer checked
//! first. [`Enforcement::take_rejudge`] says when a sync owes that.
//!
//! `ENFORCED` is written whether or not there are ranges (it costs
//! nothing then: the kernel does not read it), so `Datapath::enforced`
//! means the same with and without them.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::maps::IterableMap as _;
use ipnet::IpNet;
use policy_common::{
    config::CONFIG_POD_RANGES,
    family, identity,
    ipcache::IpcacheEntry,
    maps as names,
    pod_range_guard::{ENFORCED_NODE, LocalAddr, POD_RANGE, local_addr},
};
use tracing::{error, info};

use super::{
    error::Error,
    maps::{BpfMaps, insert, remove, service_key, service_net},
};
use crate::{
    cluster::{PodRef, Problem},
    datapath::SyncReport,
};

/// The `ENFORCED` key of an address.
pub fn enforced_key(ip: IpAddr) -> LocalAddr {
    match ip {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            local_addr(family::IPV4, &b)
        }
        IpAddr::V6(a) => local_addr(family::IPV6, &a.octets()),
    }
}

/// The address an `ENFORCED` key stands for.
fn key_ip(key: &LocalAddr) -> Option<IpAddr> {
    match key[0] {
        family::IPV4 => Some(IpAddr::V4(Ipv4Addr::new(key[4], key[5], key[6], key[7]))),
        family::IPV6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&key[4..20]);
            Some(IpAddr::V6(Ipv6Addr::from(a)))
        }
        _ => None,
    }
}

/// The driver's side of the pod-range guard.
#[derive(Debug, Default)]
pub struct Enforcement {
    /// What `POD_RANGES` holds: read from the pins at open, then as
    /// written. Until the node's ranges are known, they stay.
    ranges: Vec<IpNet>,
    /// What `ENFORCED` holds (this agent is its only writer); None: read
    /// it back first.
    held: Option<BTreeMap<IpAddr, u32>>,
    /// Interfaces with both pod classifiers attached by this process (or
    /// found attached by a full pass).
    attached: BTreeSet<u32>,
    /// The node's own addresses (the ipcache's node entries).
    node: BTreeSet<IpAddr>,
    /// Whether `CONFIG_POD_RANGES` is known to be set.
    armed: bool,
    /// Whether an address became guarded since the last
    /// [`Self::take_rejudge`].
    rejudge: bool,
}

impl Enforcement {
    /// What the pins hold: `POD_RANGES` (keys this agent does not write
    /// are removed) and whether the kernel check is on. Nothing else is
    /// touched: an agent that does not know the node's ranges yet keeps
    /// the guard an earlier one armed ([`Self::set_ranges`] changes it).
    pub fn open(maps: &mut BpfMaps) -> Result<Self, Error> {
        let present: Vec<_> = maps
            .pod_ranges
            .keys()
            .collect::<Result<_, _>>()
            .map_err(Error::map(names::POD_RANGES))?;
        let mut ranges = Vec::new();
        for key in present {
            match service_net(&key) {
                Some(net) => ranges.push(net),
                None => remove(names::POD_RANGES, maps.pod_ranges.remove(&key))?,
            }
        }
        ranges.sort();
        let on = maps.config()?.flags & CONFIG_POD_RANGES != 0;
        if !ranges.is_empty() {
            info!(
                ?ranges,
                guard_on = on,
                "pod ranges as pinned, kept until this node's are known"
            );
        }
        Ok(Self {
            armed: on && !ranges.is_empty(),
            ranges,
            ..Self::default()
        })
    }

    /// Makes `POD_RANGES` hold `wanted` (sorted, host bits clear); None:
    /// not known yet, what is held stays. Without ranges the kernel check
    /// is turned off first; with them it is turned on by the next
    /// [`Self::grant`]. True when the ranges changed.
    pub fn set_ranges(
        &mut self,
        maps: &mut BpfMaps,
        wanted: Option<&[IpNet]>,
        report: &mut SyncReport,
    ) -> bool {
        let Some(wanted) = wanted else {
            return false;
        };
        if wanted == self.ranges.as_slice() {
            return false;
        }
        if wanted.is_empty() {
            let off = maps.config().and_then(|mut c| {
                c.flags &= !CONFIG_POD_RANGES;
                maps.set_config(c)
            });
            if let Err(e) = off {
                fail(report, format!("turning the pod-range guard off: {e}"));
                return false;
            }
            self.armed = false;
            info!(
                "this node has no pod ranges: the pod-range guard for unenforced local addresses is off"
            );
        }
        // New ranges first, then the stale ones go: in between the guard
        // covers both, which drops nothing enforced.
        for net in wanted {
            if self.ranges.contains(net) {
                continue;
            }
            let r = maps.pod_ranges.insert(&service_key(net), POD_RANGE, 0);
            if let Err(e) = insert(names::POD_RANGES, r, maps.pod_ranges.map()) {
                fail(report, format!("writing pod range {net}: {e}"));
            }
        }
        for net in &self.ranges {
            if wanted.contains(net) {
                continue;
            }
            if let Err(e) = remove(names::POD_RANGES, maps.pod_ranges.remove(&service_key(net))) {
                fail(report, format!("removing pod range {net}: {e}"));
            }
        }
        info!(ranges = ?wanted, "pod ranges");
        self.ranges = wanted.to_vec();
        self.rejudge = true;
        true
    }

    /// Whether an address may have become guarded (it left `ENFORCED`,
    /// the ranges changed, the kernel check was turned on) since the last
    /// call: every tracked flow must then be judged again (every
    /// endpoint's revision moves), or its packets would keep skipping the
    /// guard.
    pub fn take_rejudge(&mut self) -> bool {
        std::mem::take(&mut self.rejudge)
    }

    /// The ranges `POD_RANGES` holds.
    pub fn ranges(&self) -> &[IpNet] {
        &self.ranges
    }

    /// Read everything back at the next sync (periodic resync).
    pub fn forget(&mut self) {
        self.held = None;
        self.armed = false;
    }

    /// Notes the node's addresses from the compiled ipcache.
    pub fn set_node(&mut self, ipcache: &BTreeMap<IpNet, IpcacheEntry>) {
        self.node = ipcache
            .iter()
            .filter(|(net, e)| {
                e.identity == identity::NODE && net.prefix_len() == net.max_prefix_len()
            })
            .map(|(net, _)| net.addr())
            .collect();
    }

    /// Whether ipcache writes may have changed the node's addresses.
    pub fn node_may_change(&self, net: &IpNet, entry: Option<&IpcacheEntry>) -> bool {
        net.prefix_len() == net.max_prefix_len()
            && (entry.is_some_and(|e| e.identity == identity::NODE)
                || self.node.contains(&net.addr()))
    }

    /// Records the attachment state of one interface.
    pub fn set_attached(&mut self, ifindex: u32, attached: bool) {
        if attached {
            self.attached.insert(ifindex);
        } else {
            self.attached.remove(&ifindex);
        }
    }

    /// Replaces the attached set (a full pass read it back).
    pub fn reset_attached(&mut self, attached: BTreeSet<u32>) {
        self.attached = attached;
    }

    /// address → ifindex for the local pods whose interface `iface_of`
    /// knows (and, with `attached_only`, carries both classifiers), and
    /// the node's addresses.
    fn wanted(
        &self,
        local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
        iface_of: &dyn Fn(&PodRef) -> Option<u32>,
        attached_only: bool,
    ) -> BTreeMap<IpAddr, u32> {
        let mut out: BTreeMap<IpAddr, u32> =
            self.node.iter().map(|ip| (*ip, ENFORCED_NODE)).collect();
        for (pod, ips) in local_pods {
            let Some(ifindex) = iface_of(pod) else {
                continue;
            };
            if attached_only && !self.attached.contains(&ifindex) {
                continue;
            }
            for ip in ips {
                out.entry(*ip).or_insert(ifindex);
            }
        }
        out
    }

    fn held(&mut self, maps: &mut BpfMaps) -> Result<&mut BTreeMap<IpAddr, u32>, Error> {
        if self.held.is_none() {
            let mut held = BTreeMap::new();
            let mut foreign = Vec::new();
            for item in maps.enforced.iter() {
                let (k, v) = item.map_err(Error::map(names::ENFORCED))?;
                match key_ip(&k) {
                    Some(ip) => {
                        held.insert(ip, v);
                    }
                    None => foreign.push(k),
                }
            }
            // Not keys this agent writes: nothing may rely on them.
            for k in foreign {
                remove(names::ENFORCED, maps.enforced.remove(&k))?;
            }
            self.held = Some(held);
        }
        Ok(self.held.get_or_insert_default())
    }

    /// First in a sync: removes every address that no longer belongs to
    /// the interface it names (the pod went, moved or changed address).
    pub fn withdraw(
        &mut self,
        maps: &mut BpfMaps,
        local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
        iface_of: &dyn Fn(&PodRef) -> Option<u32>,
        report: &mut SyncReport,
    ) {
        let wanted = self.wanted(local_pods, iface_of, false);
        let held = match self.held(maps) {
            Ok(h) => h,
            Err(e) => return fail(report, format!("reading ENFORCED: {e}")),
        };
        let stale: Vec<IpAddr> = held
            .iter()
            .filter(|(ip, ifindex)| wanted.get(ip) != Some(ifindex))
            .map(|(ip, _)| *ip)
            .collect();
        // Guarded from now on (or not removed: judged again either way).
        let withdrawn = !stale.is_empty();
        for ip in stale {
            match remove(names::ENFORCED, maps.enforced.remove(&enforced_key(ip))) {
                Ok(()) => {
                    held.remove(&ip);
                }
                Err(e) => {
                    error!(%ip, error = %e, "ENFORCED entry not removed");
                    fail(report, format!("ENFORCED entry for {ip} not removed: {e}"));
                }
            }
        }
        self.rejudge |= withdrawn;
    }

    /// Last in a sync: adds the addresses of attached interfaces, then
    /// turns the kernel check on if there are ranges.
    pub fn grant(
        &mut self,
        maps: &mut BpfMaps,
        local_pods: &BTreeMap<PodRef, Vec<IpAddr>>,
        iface_of: &dyn Fn(&PodRef) -> Option<u32>,
        report: &mut SyncReport,
    ) {
        let wanted = self.wanted(local_pods, iface_of, true);
        let held = match self.held(maps) {
            Ok(h) => h,
            Err(e) => return fail(report, format!("reading ENFORCED: {e}")),
        };
        for (ip, ifindex) in wanted {
            if held.get(&ip) == Some(&ifindex) {
                continue;
            }
            let r = maps.enforced.insert(enforced_key(ip), ifindex, 0);
            match insert(names::ENFORCED, r, maps.enforced.map()) {
                Ok(()) => {
                    held.insert(ip, ifindex);
                }
                Err(e) => {
                    // Fail closed: the address stays unreachable.
                    error!(%ip, error = %e, "ENFORCED entry not written");
                    *report.map_failures.entry(names::ENFORCED).or_default() += 1;
                    fail(report, format!("ENFORCED entry for {ip} not written: {e}"));
                }
            }
        }
        if !self.ranges.is_empty() && !self.armed {
            let armed = maps.config().and_then(|mut c| {
                let was_off = c.flags & CONFIG_POD_RANGES == 0;
                c.flags |= CONFIG_POD_RANGES;
                maps.set_config(c).map(|()| was_off)
            });
            match armed {
                Ok(turned_on) => {
                    self.armed = true;
                    self.rejudge |= turned_on;
                    info!(ranges = ?self.ranges, "pod-range guard on: unenforced local addresses are dropped");
                }
                Err(e) => fail(report, format!("turning the pod-range guard on: {e}")),
            }
        }
    }

    /// Whether every address of the pod at `ifindex` is in `ENFORCED`
    /// (read from the kernel).
    pub fn holds(maps: &BpfMaps, ifindex: u32, ips: &[IpAddr]) -> bool {
        !ips.is_empty()
            && ips
                .iter()
                .all(|ip| maps.enforced.get(&enforced_key(*ip), 0).ok() == Some(ifindex))
    }
}

fn fail(report: &mut SyncReport, msg: String) {
    report.incomplete = true;
    report.problems.push(Problem::node(msg));
}

impl BpfMaps {
    /// The pod-range guard's content (for `dump`): the pod ranges, whether the
    /// kernel check is on, and the enforced addresses by ifindex.
    #[allow(clippy::type_complexity)] // three plain parts, read together
    pub fn read_pod_range_guard(&self) -> Result<(Vec<IpNet>, bool, BTreeMap<IpAddr, u32>), Error> {
        let mut ranges = Vec::new();
        for key in self.pod_ranges.keys() {
            let key = key.map_err(Error::map(names::POD_RANGES))?;
            ranges.extend(service_net(&key));
        }
        let mut enforced = BTreeMap::new();
        for item in self.enforced.iter() {
            let (k, v) = item.map_err(Error::map(names::ENFORCED))?;
            if let Some(ip) = key_ip(&k) {
                enforced.insert(ip, v);
            }
        }
        let on = self.config()?.flags & CONFIG_POD_RANGES != 0;
        Ok((ranges, on, enforced))
    }
}
