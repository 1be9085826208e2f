//! Typed handles on the pinned maps, reading their content back and
//! applying ordered writes.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use aya::maps::{
    Array, HashMap, IterableMap as _, LpmTrie, Map, MapData, MapError, PerCpuArray, lpm_trie::Key,
};
use ipnet::IpNet;
use policy_common::{
    config::Config,
    conntrack::{CtEntry, CtKey, FragEntry, FragKey},
    conntrack_share::{CtShare, CtUsageKey},
    endpoint::{ENDPOINT_SLOT_USED, EndpointInfo, EndpointMeta},
    identity::IdentityName,
    ipcache::IpcacheEntry,
    maps as names,
    policy::{PolicyEntry, PolicyKey},
    rule_name::{RuleKey, RuleName},
    service::{ServiceAddr, ServiceEntry, service_addr, service_prefix_len},
    verdict::{COUNTER_SLOTS, Reason, counter_index},
};

use super::{
    error::Error,
    map_layout::{ADDED_LATER, field},
    map_read::hash_entries,
    pins::PinLayout,
};
use crate::{
    identity::IdentityAllocator,
    mapstate::{MapOp, MapState, shared_identity_name},
};

/// Every map the agent reads or writes (the drop-event ring is opened by
/// the event reader on its own).
pub struct BpfMaps {
    pub config: Array<MapData, Config>,
    /// Endpoints with an ifindex below its size (see [`Self::endpoint`]).
    endpoint_slots: Array<MapData, EndpointInfo>,
    /// Endpoints with a larger ifindex.
    endpoints: HashMap<MapData, u32, EndpointInfo>,
    endpoint_meta: HashMap<MapData, u32, EndpointMeta>,
    pub ipcache_v4: LpmTrie<MapData, [u8; 4], IpcacheEntry>,
    pub ipcache_v6: LpmTrie<MapData, [u8; 16], IpcacheEntry>,
    /// The full-length prefixes of each family (see
    /// `policy_common::maps::IPCACHE_HOSTS_V4`).
    pub ipcache_hosts_v4: HashMap<MapData, [u8; 4], IpcacheEntry>,
    pub ipcache_hosts_v6: HashMap<MapData, [u8; 16], IpcacheEntry>,
    pub policy: HashMap<MapData, PolicyKey, PolicyEntry>,
    pub identities: HashMap<MapData, u32, IdentityName>,
    /// None only in pins of an older agent, opened by `dump` and the
    /// like (a writer's load creates it: see [`ADDED_LATER`]).
    pub rule_names: Option<HashMap<MapData, RuleKey, RuleName>>,
    pub services: LpmTrie<MapData, ServiceAddr, ServiceEntry>,
    pub conntrack: HashMap<MapData, CtKey, CtEntry>,
    pub fragments: HashMap<MapData, FragKey, FragEntry>,
    /// Each interface's share of `CONNTRACK` (see `super::conntrack_share`).
    pub ct_share: Array<MapData, CtShare>,
    pub ct_usage: HashMap<MapData, CtUsageKey, u64>,
    pub counters: PerCpuArray<MapData, u64>,
    /// The pod-range guard's (see `super::pod_range_guard`).
    pub pod_ranges: LpmTrie<MapData, ServiceAddr, u32>,
    pub enforced: HashMap<MapData, ServiceAddr, u32>,
}

impl BpfMaps {
    /// Takes the maps out of a loaded object: the writer's way in.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf, layout: Option<&PinLayout>) -> Result<Self, Error> {
        let mut maps = Self::build(layout, |name| {
            ebpf.take_map(name).ok_or(Error::MissingMap(name))
        })?;
        maps.drop_shadowed_endpoints()?;
        Ok(maps)
    }

    /// Opens the maps pinned under `layout` (for `dump`, `events`, `reset`).
    pub fn from_pins(layout: &PinLayout) -> Result<Self, Error> {
        Self::build(Some(layout), |name| {
            if ADDED_LATER.contains(&name) && !layout.map(name).exists() {
                return Err(Error::MissingMap(name));
            }
            let data = MapData::from_pin(layout.map(name)).map_err(Error::map(name))?;
            Map::from_map_data(data).map_err(Error::map(name))
        })
    }

    /// Every map from `source`, each checked against this layout.
    fn build(
        layout: Option<&PinLayout>,
        mut source: impl FnMut(&'static str) -> Result<Map, Error>,
    ) -> Result<Self, Error> {
        Ok(Self {
            config: field(names::CONFIG, layout, &mut source)?,
            endpoint_slots: field(names::ENDPOINT_SLOTS, layout, &mut source)?,
            endpoints: field(names::ENDPOINTS, layout, &mut source)?,
            endpoint_meta: field(names::ENDPOINT_META, layout, &mut source)?,
            ipcache_v4: field(names::IPCACHE_V4, layout, &mut source)?,
            ipcache_v6: field(names::IPCACHE_V6, layout, &mut source)?,
            ipcache_hosts_v4: field(names::IPCACHE_HOSTS_V4, layout, &mut source)?,
            ipcache_hosts_v6: field(names::IPCACHE_HOSTS_V6, layout, &mut source)?,
            policy: field(names::POLICY, layout, &mut source)?,
            identities: field(names::IDENTITY_NAMES, layout, &mut source)?,
            rule_names: match field(names::RULE_NAMES, layout, &mut source) {
                Ok(m) => Some(m),
                Err(Error::MissingMap(_)) => None,
                Err(e) => return Err(e),
            },
            services: field(names::SERVICES, layout, &mut source)?,
            conntrack: field(names::CONNTRACK, layout, &mut source)?,
            fragments: field(names::FRAGMENTS, layout, &mut source)?,
            ct_share: field(names::CT_SHARE, layout, &mut source)?,
            ct_usage: field(names::CT_USAGE, layout, &mut source)?,
            counters: field(names::COUNTERS, layout, &mut source)?,
            pod_ranges: field(names::POD_RANGES, layout, &mut source)?,
            enforced: field(names::ENFORCED, layout, &mut source)?,
        })
    }

    pub fn config(&self) -> Result<Config, Error> {
        self.config.get(&0, 0).map_err(Error::map(names::CONFIG))
    }

    pub fn set_config(&mut self, config: Config) -> Result<(), Error> {
        self.config
            .set(0, config, 0)
            .map_err(Error::map(names::CONFIG))
    }

    /// ifindexes below this live in `ENDPOINT_SLOTS`, the rest in
    /// `ENDPOINTS`: the classifier looks in the array first and trusts an
    /// empty slot, so an ifindex must never be in the hash as well.
    fn slot_count(&self) -> u32 {
        self.endpoint_slots.len()
    }

    /// The endpoint entry the classifier sees for `ifindex`.
    pub fn endpoint(&self, ifindex: u32) -> Result<Option<EndpointInfo>, Error> {
        if ifindex < self.slot_count() {
            let slot = self
                .endpoint_slots
                .get(&ifindex, 0)
                .map_err(Error::map(names::ENDPOINT_SLOTS))?;
            return Ok(used_slot(slot));
        }
        match self.endpoints.get(&ifindex, 0) {
            Ok(ep) => Ok(Some(ep)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::map(names::ENDPOINTS)(e)),
        }
    }

    /// Every endpoint entry the classifier sees, by ifindex. Reads each
    /// array slot: about 16k lookups, a few milliseconds.
    pub fn endpoints(&self) -> Result<BTreeMap<u32, EndpointInfo>, Error> {
        let mut out = BTreeMap::new();
        for ifindex in 0..self.slot_count() {
            if let Some(ep) = self.endpoint(ifindex)? {
                out.insert(ifindex, ep);
            }
        }
        for (k, v) in hash_entries::<_, _, Vec<_>>(&self.endpoints, names::ENDPOINTS)? {
            // A hash entry the array shadows is invisible to the classifier.
            if k >= self.slot_count() {
                out.insert(k, v);
            }
        }
        Ok(out)
    }

    /// Removes hash entries the array shadows (left by a layout with a
    /// smaller array), so each ifindex lives in one place. Once, when a
    /// writer opens the maps; the writes below keep it so.
    fn drop_shadowed_endpoints(&mut self) -> Result<(), Error> {
        let slots = self.slot_count();
        let keys = self
            .endpoints
            .keys()
            .collect::<Result<Vec<u32>, _>>()
            .map_err(Error::map(names::ENDPOINTS))?;
        for k in keys.into_iter().filter(|k| *k < slots) {
            remove(names::ENDPOINTS, self.endpoints.remove(&k))?;
        }
        Ok(())
    }

    /// Reads the policy-relevant content back (the "old" side of a diff).
    pub fn read_state(&self) -> Result<MapState<u32>, Error> {
        let mut state = MapState {
            endpoints: self.endpoints()?,
            ..MapState::default()
        };
        for item in self.ipcache_v4.iter() {
            let (k, v) = item.map_err(Error::map(names::IPCACHE_V4))?;
            if let Ok(net) = IpNet::new(IpAddr::V4(Ipv4Addr::from(k.data())), k.prefix_len() as u8)
            {
                state.ipcache.insert(net, v);
            }
        }
        for item in self.ipcache_v6.iter() {
            let (k, v) = item.map_err(Error::map(names::IPCACHE_V6))?;
            if let Ok(net) = IpNet::new(IpAddr::V6(Ipv6Addr::from(k.data())), k.prefix_len() as u8)
            {
                state.ipcache.insert(net, v);
            }
        }
        for (k, v) in hash_entries::<_, _, Vec<_>>(&self.ipcache_hosts_v4, names::IPCACHE_HOSTS_V4)?
        {
            state
                .ipcache
                .insert(IpNet::from(IpAddr::V4(Ipv4Addr::from(k))), v);
        }
        for (k, v) in hash_entries::<_, _, Vec<_>>(&self.ipcache_hosts_v6, names::IPCACHE_HOSTS_V6)?
        {
            state
                .ipcache
                .insert(IpNet::from(IpAddr::V6(Ipv6Addr::from(k))), v);
        }
        state.policy = hash_entries(&self.policy, names::POLICY)?;
        for item in self.services.iter() {
            let (k, v) = item.map_err(Error::map(names::SERVICES))?;
            if let Some(net) = service_net(&k) {
                state.services.insert(net, v);
            }
        }
        state.identities = self.read_identities()?;
        state.rule_names = self.read_rule_names()?;
        Ok(state)
    }

    /// The rule names (none in pins that lack the map).
    pub fn read_rule_names(&self) -> Result<BTreeMap<RuleKey, RuleName>, Error> {
        match &self.rule_names {
            Some(m) => hash_entries(m, names::RULE_NAMES),
            None => Ok(BTreeMap::new()),
        }
    }

    /// The identity names alone (cheaper than [`Self::read_state`]).
    pub fn read_identities(&self) -> Result<BTreeMap<u32, Arc<IdentityName>>, Error> {
        let read: Vec<(u32, IdentityName)> = hash_entries(&self.identities, names::IDENTITY_NAMES)?;
        Ok(read
            .into_iter()
            .map(|(id, name)| (id, shared_identity_name(&name)))
            .collect())
    }

    pub fn read_meta(&self) -> Result<BTreeMap<u32, EndpointMeta>, Error> {
        hash_entries(&self.endpoint_meta, names::ENDPOINT_META)
    }

    /// Applies every write in order, carrying on past failures (each write
    /// leaves the maps safe on its own); a failed ipcache upsert removes
    /// the entry instead, so an address never keeps an identity it lost.
    /// Returns the writes that failed.
    pub fn apply_all(&mut self, ops: &[MapOp<u32>]) -> Vec<(MapOp<u32>, Error)> {
        let mut failed = Vec::new();
        for op in ops {
            if let Err(e) = self.apply_one(op) {
                if let MapOp::UpsertIpcache(net, _) = op {
                    let _ = self.apply_one(&MapOp::DeleteIpcache(*net));
                }
                failed.push((op.clone(), e));
            }
        }
        failed
    }

    /// The capacities writes are planned within (the maps as created; a
    /// pinned map keeps the size it was created with).
    pub fn capacities(&self) -> super::capacity_plan::Capacities {
        fn cap(m: &MapData) -> usize {
            m.info().map(|i| i.max_entries() as usize).unwrap_or(0)
        }
        super::capacity_plan::Capacities {
            policy: cap(self.policy.map()),
            // Each family's entries are planned against both its maps.
            ipcache_v4: cap(self.ipcache_v4.map()).min(cap(self.ipcache_hosts_v4.map())),
            ipcache_v6: cap(self.ipcache_v6.map()).min(cap(self.ipcache_hosts_v6.map())),
            identities: cap(self.identities.map()),
            rule_names: self.rule_names.as_ref().map_or(0, |m| cap(m.map())),
            endpoints: cap(self.endpoints.map()),
            slots: self.slot_count(),
            services: cap(self.services.map()),
        }
    }

    /// Applies writes in the given order; stops at the first failure (the
    /// order keeps every prefix of the list safe to leave in place).
    pub fn apply(&mut self, ops: &[MapOp<u32>]) -> Result<(), Error> {
        for op in ops {
            self.apply_one(op)?;
        }
        Ok(())
    }

    fn apply_one(&mut self, op: &MapOp<u32>) -> Result<(), Error> {
        match op {
            MapOp::UpsertIdentity(id, name) => insert(
                names::IDENTITY_NAMES,
                self.identities.insert(id, name.as_ref(), 0),
                self.identities.map(),
            ),
            MapOp::UpsertPolicy(k, v) => insert(
                names::POLICY,
                self.policy.insert(k, v, 0),
                self.policy.map(),
            ),
            MapOp::UpsertEndpoint(k, v) if *k < self.slot_count() => {
                let slot = EndpointInfo {
                    flags: v.flags | ENDPOINT_SLOT_USED,
                    ..*v
                };
                self.endpoint_slots
                    .set(*k, slot, 0)
                    .map_err(Error::map(names::ENDPOINT_SLOTS))
            }
            MapOp::UpsertEndpoint(k, v) => insert(
                names::ENDPOINTS,
                self.endpoints.insert(k, v, 0),
                self.endpoints.map(),
            ),
            MapOp::UpsertIpcache(net, v) => match lpm_key(net) {
                LpmKey::Host4(a) => insert(
                    names::IPCACHE_HOSTS_V4,
                    self.ipcache_hosts_v4.insert(a, v, 0),
                    self.ipcache_hosts_v4.map(),
                ),
                LpmKey::Host6(a) => insert(
                    names::IPCACHE_HOSTS_V6,
                    self.ipcache_hosts_v6.insert(a, v, 0),
                    self.ipcache_hosts_v6.map(),
                ),
                LpmKey::V4(k) => insert(
                    names::IPCACHE_V4,
                    self.ipcache_v4.insert(&k, v, 0),
                    self.ipcache_v4.map(),
                ),
                LpmKey::V6(k) => insert(
                    names::IPCACHE_V6,
                    self.ipcache_v6.insert(&k, v, 0),
                    self.ipcache_v6.map(),
                ),
            },
            MapOp::DeletePolicy(k) => remove(names::POLICY, self.policy.remove(k)),
            MapOp::DeleteEndpoint(k) if *k < self.slot_count() => self
                .endpoint_slots
                .set(*k, EndpointInfo::default(), 0)
                .map_err(Error::map(names::ENDPOINT_SLOTS)),
            MapOp::DeleteEndpoint(k) => remove(names::ENDPOINTS, self.endpoints.remove(k)),
            MapOp::DeleteIdentity(k) => remove(names::IDENTITY_NAMES, self.identities.remove(k)),
            // Only a reader of older pins lacks the map, and it writes none.
            MapOp::UpsertRuleName(k, v) => match &mut self.rule_names {
                Some(m) => insert(names::RULE_NAMES, m.insert(k, v.as_ref(), 0), m.map()),
                None => Err(Error::MissingMap(names::RULE_NAMES)),
            },
            MapOp::DeleteRuleName(k) => match &mut self.rule_names {
                Some(m) => remove(names::RULE_NAMES, m.remove(k)),
                None => Ok(()),
            },
            MapOp::UpsertService(net, v) => insert(
                names::SERVICES,
                self.services.insert(&service_key(net), v, 0),
                self.services.map(),
            ),
            MapOp::DeleteService(net) => {
                remove(names::SERVICES, self.services.remove(&service_key(net)))
            }
            MapOp::DeleteIpcache(net) => match lpm_key(net) {
                LpmKey::Host4(a) => {
                    remove(names::IPCACHE_HOSTS_V4, self.ipcache_hosts_v4.remove(&a))
                }
                LpmKey::Host6(a) => {
                    remove(names::IPCACHE_HOSTS_V6, self.ipcache_hosts_v6.remove(&a))
                }
                LpmKey::V4(k) => remove(names::IPCACHE_V4, self.ipcache_v4.remove(&k)),
                LpmKey::V6(k) => remove(names::IPCACHE_V6, self.ipcache_v6.remove(&k)),
            },
        }
    }

    /// The ENDPOINT_META record of `ifindex`; None when absent (or
    /// unreadable: then nothing is known to be attached).
    pub fn meta(&self, ifindex: u32) -> Option<EndpointMeta> {
        self.endpoint_meta.get(&ifindex, 0).ok()
    }

    pub fn set_meta(&mut self, ifindex: u32, meta: &EndpointMeta) -> Result<(), Error> {
        insert(
            names::ENDPOINT_META,
            self.endpoint_meta.insert(ifindex, meta, 0),
            self.endpoint_meta.map(),
        )
    }

    pub fn remove_meta(&mut self, ifindex: u32) -> Result<(), Error> {
        remove(names::ENDPOINT_META, self.endpoint_meta.remove(&ifindex))
    }

    /// Verdict counters summed over CPUs: (reason, direction) → packets.
    pub fn counters(&self) -> Result<BTreeMap<(Reason, u8), u64>, Error> {
        let mut out = BTreeMap::new();
        for reason in Reason::ALL {
            for dir in [
                policy_common::direction::INGRESS,
                policy_common::direction::EGRESS,
            ] {
                let idx = counter_index(reason, dir);
                if idx >= COUNTER_SLOTS {
                    continue;
                }
                let per_cpu = self
                    .counters
                    .get(&idx, 0)
                    .map_err(Error::map(names::COUNTERS))?;
                out.insert((reason, dir), per_cpu.iter().sum());
            }
        }
        Ok(out)
    }

    /// Number of entries per map, for fill metrics.
    pub fn fill(&self) -> Vec<(&'static str, usize, u32)> {
        fn cap(m: &MapData) -> u32 {
            m.info().map(|i| i.max_entries()).unwrap_or(0)
        }
        let slots = self.slot_count();
        let in_slots = (0..slots)
            .filter(|i| matches!(self.endpoint(*i), Ok(Some(_))))
            .count();
        let mut out = vec![
            (names::ENDPOINT_SLOTS, in_slots, slots),
            (
                names::ENDPOINTS,
                self.endpoints.keys().count(),
                cap(self.endpoints.map()),
            ),
            (
                names::IPCACHE_V4,
                self.ipcache_v4.keys().count(),
                cap(self.ipcache_v4.map()),
            ),
            (
                names::IPCACHE_V6,
                self.ipcache_v6.keys().count(),
                cap(self.ipcache_v6.map()),
            ),
            (
                names::IPCACHE_HOSTS_V4,
                self.ipcache_hosts_v4.keys().count(),
                cap(self.ipcache_hosts_v4.map()),
            ),
            (
                names::IPCACHE_HOSTS_V6,
                self.ipcache_hosts_v6.keys().count(),
                cap(self.ipcache_hosts_v6.map()),
            ),
            (
                names::POLICY,
                self.policy.keys().count(),
                cap(self.policy.map()),
            ),
            (
                names::CONNTRACK,
                self.conntrack.keys().count(),
                cap(self.conntrack.map()),
            ),
            (
                names::IDENTITY_NAMES,
                self.identities.keys().count(),
                cap(self.identities.map()),
            ),
            (
                names::SERVICES,
                self.services.keys().count(),
                cap(self.services.map()),
            ),
        ];
        if let Some(m) = &self.rule_names {
            out.push((names::RULE_NAMES, m.keys().count(), cap(m.map())));
        }
        out
    }
}

/// The endpoint in an array slot, without the writer's marker.
fn used_slot(slot: EndpointInfo) -> Option<EndpointInfo> {
    (slot.flags & ENDPOINT_SLOT_USED != 0).then_some(EndpointInfo {
        flags: slot.flags & !ENDPOINT_SLOT_USED,
        ..slot
    })
}

/// Where an ipcache prefix lives: a full-length one in its family's host
/// table, any other in the trie.
enum LpmKey {
    Host4([u8; 4]),
    Host6([u8; 16]),
    V4(Key<[u8; 4]>),
    V6(Key<[u8; 16]>),
}

fn lpm_key(net: &IpNet) -> LpmKey {
    match net.trunc() {
        IpNet::V4(n) if n.prefix_len() == 32 => LpmKey::Host4(n.addr().octets()),
        IpNet::V6(n) if n.prefix_len() == 128 => LpmKey::Host6(n.addr().octets()),
        IpNet::V4(n) => LpmKey::V4(Key::new(u32::from(n.prefix_len()), n.addr().octets())),
        IpNet::V6(n) => LpmKey::V6(Key::new(u32::from(n.prefix_len()), n.addr().octets())),
    }
}

/// The `SERVICES` key of a prefix.
pub(super) fn service_key(net: &IpNet) -> Key<ServiceAddr> {
    let net = net.trunc();
    let (fam, addr) = match net.addr() {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            (policy_common::family::IPV4, b)
        }
        IpAddr::V6(a) => (policy_common::family::IPV6, a.octets()),
    };
    Key::new(
        service_prefix_len(net.prefix_len()),
        service_addr(fam, &addr),
    )
}

/// The prefix a `SERVICES` key stands for (None: not one this agent writes).
pub(super) fn service_net(key: &Key<ServiceAddr>) -> Option<IpNet> {
    let data = key.data();
    let bits = u8::try_from(key.prefix_len().checked_sub(32)?).ok()?;
    let ip = match data[0] {
        policy_common::family::IPV4 => {
            IpAddr::V4(Ipv4Addr::new(data[4], data[5], data[6], data[7]))
        }
        policy_common::family::IPV6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&data[4..20]);
            IpAddr::V6(Ipv6Addr::from(a))
        }
        _ => return None,
    };
    IpNet::new(ip, bits).ok()
}

pub(super) fn insert(
    name: &'static str,
    r: Result<(), MapError>,
    map: &MapData,
) -> Result<(), Error> {
    r.map_err(|e| match &e {
        MapError::SyscallError(s)
            if matches!(
                s.io_error.raw_os_error(),
                Some(libc::E2BIG) | Some(libc::ENOSPC)
            ) =>
        {
            Error::MapFull {
                name,
                capacity: map.info().map(|i| i.max_entries()).unwrap_or(0),
            }
        }
        _ => Error::map(name)(e),
    })
}

/// A missing key is fine: the state we wanted is reached.
pub(super) fn remove(name: &'static str, r: Result<(), MapError>) -> Result<(), Error> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other.map_err(Error::map(name)),
    }
}

/// The identity numbers an earlier agent left in `state` (the pins, read):
/// by name where `IDENTITY_NAMES` has one, and every number a row of
/// `POLICY`, the ipcache or the endpoint maps still holds (quarantined,
/// see [`IdentityAllocator::adopt`]). Names are for `dump` and dropped
/// first on a full map, so they alone miss numbers still enforced.
pub fn adopt_from(state: &MapState<u32>) -> IdentityAllocator {
    IdentityAllocator::adopt(&state.identities, &state.identities_in_use())
}
