//! The compiled map content, kept up to date in place, with the bookkeeping
//! that makes incremental updates exact:
//! - which rules produced each policy key (a key stays while any does; its
//!   `rule_ref` is the smallest), and the tier slots ClusterNetworkPolicy
//!   rules give it: the entry is composed of both;
//! - per endpoint identity and direction, how many keys of each lookup
//!   shape exist (the endpoint lookup bits, without rescanning);
//! - how many entries reference each rule (`RULE_NAMES` names exactly
//!   the rules referenced: the compiler names those that start or stop
//!   being referenced, see [`Output::take_dirty_rules`]);
//! - a journal of the first old value of every entry touched, from which
//!   the same ordered ops as [`crate::mapstate::diff`] are produced without
//!   comparing the whole state.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

use ipnet::IpNet;
use policy_common::{
    endpoint::{EndpointInfo, lookups},
    identity::IdentityName,
    ipcache::IpcacheEntry,
    policy::{ENTRY_TIERS_ONLY, PolicyEntry, PolicyKey, TierSlot},
    rule_name::{RuleKey, RuleName},
    service::ServiceEntry,
};

use crate::{
    cluster::PodRef,
    mapstate::{MapOp, MapState, Writes, covering, entry_rules, updating},
};

/// Counter slots, one per bit of [`lookups`]: 0..=16 port prefix lengths,
/// 17 any protocol, 18 any peer, 19 an address-class peer.
const SLOTS: usize = 20;
const _: () = assert!(lookups::CLASS_PEER == 1 << (SLOTS - 1));

fn note<K: Ord + Clone, V: Clone>(
    journal: &mut Option<BTreeMap<K, Option<V>>>,
    key: &K,
    old: Option<&V>,
) {
    if let Some(j) = journal {
        j.entry(key.clone()).or_insert_with(|| old.cloned());
    }
}

/// Sets (Some) or removes (None) `key` in `map`, journalling its first old
/// value; an unchanged entry is left alone and not journalled.
fn set_journaled<K: Ord + Clone, V: Clone + PartialEq>(
    map: &mut BTreeMap<K, V>,
    journal: &mut Option<BTreeMap<K, Option<V>>>,
    key: &K,
    value: Option<V>,
) {
    let old = map.get(key);
    if old == value.as_ref() {
        return;
    }
    note(journal, key, old);
    match value {
        Some(v) => map.insert(key.clone(), v),
        None => map.remove(key),
    };
}

#[derive(Clone, Debug, Default)]
pub struct Output {
    pub maps: MapState<PodRef>,
    /// Contributors of keys produced by more than one rule (sorted, with
    /// repeats); a key absent here has exactly its entry's `rule_ref`.
    shared: HashMap<PolicyKey, Vec<u32>>,
    /// The tier layer (see [`Output::set_tiers`]).
    tiers: BTreeMap<PolicyKey, (TierSlot, TierSlot)>,
    counts: HashMap<(u32, u8), [u32; SLOTS]>,
    /// Endpoint identities whose lookup bits may have changed.
    pub dirty_lookups: BTreeSet<u32>,
    /// Entries referencing each rule (absent: none).
    rule_refs: HashMap<RuleKey, u32>,
    /// Rules whose name may be due: referenced or not any more, or
    /// named differently (see [`Self::mark_rules_dirty`]).
    dirty_rules: BTreeSet<RuleKey>,
    /// First old value of each entry touched since the journal started.
    journal_identities: Option<BTreeMap<u32, Option<Arc<IdentityName>>>>,
    journal_rule_names: Option<BTreeMap<RuleKey, Option<RuleName>>>,
    journal_policy: Option<BTreeMap<PolicyKey, Option<PolicyEntry>>>,
    journal_endpoints: Option<BTreeMap<PodRef, Option<EndpointInfo>>>,
    journal_ipcache: Option<BTreeMap<IpNet, Option<IpcacheEntry>>>,
    journal_services: Option<BTreeMap<IpNet, Option<ServiceEntry>>>,
}

impl Output {
    /// Starts recording old values (see [`Self::take_ops`]).
    pub fn start_journal(&mut self) {
        self.journal_identities = Some(BTreeMap::new());
        self.journal_rule_names = Some(BTreeMap::new());
        self.journal_policy = Some(BTreeMap::new());
        self.journal_endpoints = Some(BTreeMap::new());
        self.journal_ipcache = Some(BTreeMap::new());
        self.journal_services = Some(BTreeMap::new());
    }

    pub fn stop_journal(&mut self) {
        self.journal_identities = None;
        self.journal_rule_names = None;
        self.journal_policy = None;
        self.journal_endpoints = None;
        self.journal_ipcache = None;
        self.journal_services = None;
    }

    fn count(&mut self, key: &PolicyKey, delta: i64) {
        let c = self
            .counts
            .entry((key.endpoint_identity, key.direction))
            .or_insert([0; SLOTS]);
        let bits = key.lookup_bits();
        for slot in (0..SLOTS).filter(|s| bits & (1 << s) != 0) {
            let before = c[slot];
            c[slot] = if delta > 0 {
                before.saturating_add(1)
            } else {
                before.saturating_sub(1)
            };
            if (before == 0) != (c[slot] == 0) {
                self.dirty_lookups.insert(key.endpoint_identity);
            }
        }
    }

    /// The lookup bits of endpoint identity `e` in `dir`.
    pub fn lookup_bits(&self, e: u32, dir: u8) -> u32 {
        self.counts.get(&(e, dir)).map_or(0, |c| {
            c.iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .fold(0, |bits, (slot, _)| bits | (1 << slot))
        })
    }

    /// Rule `rule_ref` produces `key`.
    pub fn add_policy(&mut self, key: PolicyKey, rule_ref: u32) {
        let np = match self.np_of(&key) {
            None => rule_ref,
            Some(current) => {
                let list = self.shared.entry(key).or_insert_with(|| vec![current]);
                let at = list.partition_point(|r| *r <= rule_ref);
                list.insert(at, rule_ref);
                list.first().copied().unwrap_or(rule_ref)
            }
        };
        self.compose(&key, Some(np));
    }

    /// The smallest rule_ref of the NetworkPolicy rules producing `key`
    /// (None: none does; the entry, if any, holds only tier slots).
    fn np_of(&self, key: &PolicyKey) -> Option<u32> {
        self.maps
            .policy
            .get(key)
            .filter(|e| e.flags & ENTRY_TIERS_ONLY == 0)
            .map(|e| e.rule_ref)
    }

    /// Rule `rule_ref` no longer produces `key`.
    pub fn remove_policy(&mut self, key: PolicyKey, rule_ref: u32) {
        if let Some(list) = self.shared.get_mut(&key) {
            let Some(at) = list.iter().position(|r| *r == rule_ref) else {
                debug_assert!(
                    false,
                    "removing a contribution never added: {key:?} {rule_ref}"
                );
                return;
            };
            list.remove(at);
            let min = list.first().copied().unwrap_or(rule_ref);
            if list.len() <= 1 {
                self.shared.remove(&key);
            }
            self.compose(&key, Some(min));
        } else if let Some(current) = self.np_of(&key) {
            debug_assert_eq!(current, rule_ref, "sole contributor of {key:?}");
            self.compose(&key, None);
        } else {
            debug_assert!(false, "removing a key never added: {key:?}");
        }
    }

    /// Sets the tier slots of `key` (None: no ClusterNetworkPolicy rule
    /// matches it).
    pub fn set_tiers(&mut self, key: PolicyKey, slots: Option<(TierSlot, TierSlot)>) {
        match slots {
            Some(s) => self.tiers.insert(key, s),
            None => self.tiers.remove(&key),
        };
        let np = self.np_of(&key);
        self.compose(&key, np);
    }

    /// The tier layer: every key a ClusterNetworkPolicy rule matches, with
    /// its Admin and Baseline slots.
    pub fn tiers(&self) -> &BTreeMap<PolicyKey, (TierSlot, TierSlot)> {
        &self.tiers
    }

    /// Writes the policy entry of `key` from its two sources: the
    /// NetworkPolicy rules that allow it (`np`: their smallest rule_ref) and
    /// the tier slots.
    fn compose(&mut self, key: &PolicyKey, np: Option<u32>) {
        let tiers = self.tiers.get(key).copied();
        let want = match (np, tiers) {
            (None, None) => None,
            (np, tiers) => {
                let (admin, baseline) = tiers.unwrap_or_default();
                Some(PolicyEntry {
                    rule_ref: np.unwrap_or(0),
                    flags: if np.is_some() { 0 } else { ENTRY_TIERS_ONLY },
                    admin,
                    baseline,
                })
            }
        };
        let old = self.maps.policy.get(key);
        if old == want.as_ref() {
            return;
        }
        let was = old.is_some();
        note(&mut self.journal_policy, key, old);
        let old = old.copied();
        self.reference(key, old.as_ref(), -1);
        self.reference(key, want.as_ref(), 1);
        match want {
            Some(e) => {
                self.maps.policy.insert(*key, e);
                if !was {
                    self.count(key, 1);
                }
            }
            None => {
                self.maps.policy.remove(key);
                self.count(key, -1);
            }
        }
    }

    /// Drops every key of endpoint identity `e`.
    pub fn remove_endpoint_identity(&mut self, e: u32) {
        let keys: Vec<PolicyKey> = self.maps.policy_of(e).map(|(k, _)| *k).collect();
        for key in keys {
            self.shared.remove(&key);
            self.tiers.remove(&key);
            if let Some(old) = self.maps.policy.remove(&key) {
                note(&mut self.journal_policy, &key, Some(&old));
                self.reference(&key, Some(&old), -1);
            }
        }
        for dir in [0, 1] {
            if self.counts.remove(&(e, dir)).is_some() {
                self.dirty_lookups.insert(e);
            }
            self.set_isolating(e, dir, Vec::new());
        }
    }

    /// Counts `entry`'s references to its rules (`delta`: 1 or -1); a rule
    /// whose first reference comes or whose last goes needs its name
    /// written or removed.
    fn reference(&mut self, key: &PolicyKey, entry: Option<&PolicyEntry>, delta: i32) {
        for rule in entry.into_iter().flat_map(|e| entry_rules(key, e)) {
            let n = self.rule_refs.entry(rule).or_default();
            let before = *n;
            *n = if delta > 0 {
                n.saturating_add(1)
            } else {
                n.saturating_sub(1)
            };
            let after = *n;
            if after == 0 {
                self.rule_refs.remove(&rule);
            }
            if (before == 0) != (after == 0) {
                self.dirty_rules.insert(rule);
            }
        }
    }

    /// Whether some entry references `rule`.
    pub fn references(&self, rule: &RuleKey) -> bool {
        self.rule_refs.contains_key(rule)
    }

    /// Rules whose name may have changed (their policies came, went or
    /// moved): looked at again by the next [`Self::take_dirty_rules`].
    pub fn mark_rules_dirty(&mut self, rules: impl IntoIterator<Item = RuleKey>) {
        self.dirty_rules.extend(rules);
    }

    /// The rules to name (or unname) since the last call.
    pub fn take_dirty_rules(&mut self) -> BTreeSet<RuleKey> {
        std::mem::take(&mut self.dirty_rules)
    }

    /// The names of the policies isolating endpoint identity `e` in `dir`:
    /// keys from index 0, the ones past `names` removed.
    pub fn set_isolating(&mut self, e: u32, dir: u8, names: Vec<RuleName>) {
        let mut index: u16 = 0;
        for name in names {
            self.set_rule_name(RuleKey::isolating(dir, e, index), Some(name));
            index = index.saturating_add(1);
        }
        while self
            .maps
            .rule_names
            .contains_key(&RuleKey::isolating(dir, e, index))
        {
            self.set_rule_name(RuleKey::isolating(dir, e, index), None);
            index = index.saturating_add(1);
        }
    }

    pub fn set_rule_name(&mut self, rule: RuleKey, name: Option<RuleName>) {
        set_journaled(
            &mut self.maps.rule_names,
            &mut self.journal_rule_names,
            &rule,
            name,
        );
    }

    pub fn set_endpoint(&mut self, pod: &PodRef, info: Option<EndpointInfo>) {
        set_journaled(
            &mut self.maps.endpoints,
            &mut self.journal_endpoints,
            pod,
            info,
        );
    }

    pub fn set_ipcache(&mut self, net: IpNet, entry: Option<IpcacheEntry>) {
        set_journaled(
            &mut self.maps.ipcache,
            &mut self.journal_ipcache,
            &net,
            entry,
        );
    }

    pub fn set_service(&mut self, net: IpNet, entry: Option<ServiceEntry>) {
        set_journaled(
            &mut self.maps.services,
            &mut self.journal_services,
            &net,
            entry,
        );
    }

    pub fn set_identity(&mut self, id: u32, name: Option<IdentityName>) {
        set_journaled(
            &mut self.maps.identities,
            &mut self.journal_identities,
            &id,
            name.as_ref().map(crate::mapstate::shared_identity_name),
        );
    }

    /// The map content as it was when the journal started.
    pub fn journal_start_state(&self) -> MapState<PodRef> {
        fn revert<K: Ord + Clone, V: Clone>(
            map: &mut BTreeMap<K, V>,
            journal: Option<&BTreeMap<K, Option<V>>>,
        ) {
            for (k, old) in journal.into_iter().flatten() {
                match old {
                    Some(v) => map.insert(k.clone(), v.clone()),
                    None => map.remove(k),
                };
            }
        }
        let mut m = self.maps.clone();
        revert(&mut m.identities, self.journal_identities.as_ref());
        revert(&mut m.rule_names, self.journal_rule_names.as_ref());
        revert(&mut m.policy, self.journal_policy.as_ref());
        revert(&mut m.endpoints, self.journal_endpoints.as_ref());
        revert(&mut m.ipcache, self.journal_ipcache.as_ref());
        revert(&mut m.services, self.journal_services.as_ref());
        m
    }

    /// The ordered writes from the journal start to now (the same list
    /// [`crate::mapstate::diff`] would give); the journal ends.
    pub fn take_ops(&mut self) -> Vec<MapOp<PodRef>> {
        fn split<K: Ord + Clone, V: Clone + PartialEq>(
            current: &BTreeMap<K, V>,
            journal: Option<BTreeMap<K, Option<V>>>,
        ) -> (Vec<(K, V)>, Vec<K>) {
            let (mut up, mut del) = (Vec::new(), Vec::new());
            for (k, old) in journal.into_iter().flatten() {
                match (old, current.get(&k)) {
                    (old, Some(new)) if old.as_ref() != Some(new) => up.push((k, new.clone())),
                    (Some(_), None) => del.push(k),
                    _ => {}
                }
            }
            (up, del)
        }
        let (identity_upserts, identity_removals) =
            split(&self.maps.identities, self.journal_identities.take());
        let (rule_name_upserts, rule_name_removals) =
            split(&self.maps.rule_names, self.journal_rule_names.take());
        let (policy_upserts, policy_removals) =
            split(&self.maps.policy, self.journal_policy.take());
        let journal_endpoints = self.journal_endpoints.take();
        let updating = {
            let journal = journal_endpoints.as_ref();
            let old_of = |k: &PodRef| match journal.and_then(|j| j.get(k)) {
                Some(old) => *old,
                None => self.maps.endpoints.get(k).copied(),
            };
            let keys: BTreeSet<&PodRef> = self
                .maps
                .endpoints
                .keys()
                .chain(journal.into_iter().flat_map(|j| j.keys()))
                .collect();
            updating(
                keys.into_iter()
                    .map(|k| (k.clone(), old_of(k), self.maps.endpoints.get(k).copied())),
                policy_upserts
                    .iter()
                    .map(|(k, _)| *k)
                    .chain(policy_removals.iter().copied()),
            )
        };
        let (endpoint_upserts, endpoint_removals) = split(&self.maps.endpoints, journal_endpoints);
        let ipcache_journal = self.journal_ipcache.take();
        let ipcache_old = ipcache_journal
            .iter()
            .flatten()
            .filter_map(|(k, old)| {
                let old = (*old)?;
                (self.maps.ipcache.get(k) != Some(&old)).then_some((*k, old))
            })
            .collect();
        // What a prefix held when the journal started.
        let was = |net: &IpNet| -> Option<IpcacheEntry> {
            match ipcache_journal.as_ref().and_then(|j| j.get(net)) {
                Some(old) => *old,
                None => self.maps.ipcache.get(net).copied(),
            }
        };
        let ipcache_covering_old = ipcache_journal
            .iter()
            .flatten()
            .filter(|(k, old)| old.is_none() && self.maps.ipcache.contains_key(*k))
            .filter_map(|(k, _)| covering(k, was).map(|c| (*k, c)))
            .collect();
        let (ipcache_upserts, ipcache_removals) = split(&self.maps.ipcache, ipcache_journal);
        let ipcache_covering_new = ipcache_removals
            .iter()
            .filter_map(|k| covering(k, |n| self.maps.ipcache.get(n).copied()).map(|c| (*k, c)))
            .collect();
        let (service_upserts, service_removals) =
            split(&self.maps.services, self.journal_services.take());
        Writes {
            identity_upserts,
            identity_removals,
            rule_name_upserts,
            rule_name_removals,
            policy_upserts,
            policy_removals,
            endpoint_upserts,
            endpoint_removals,
            ipcache_upserts,
            ipcache_old,
            ipcache_covering_old,
            ipcache_removals,
            ipcache_covering_new,
            service_upserts,
            service_removals,
            updating,
        }
        .ordered()
    }

    /// Memory estimate of the content and the bookkeeping, in bytes:
    /// entries × (key + value) plus the shared-contributor lists and
    /// counters (no allocator overhead).
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        let m = &self.maps;
        m.policy.len() * (size_of::<PolicyKey>() + size_of::<PolicyEntry>())
            + m.ipcache.len() * (size_of::<IpNet>() + size_of::<IpcacheEntry>())
            + m.endpoints.len() * (size_of::<PodRef>() + size_of::<EndpointInfo>())
            + m.identities.len() * (4 + size_of::<IdentityName>())
            + m.rule_names.len() * (size_of::<RuleKey>() + size_of::<RuleName>())
            + self.rule_refs.len() * (size_of::<RuleKey>() + 4)
            + self
                .shared
                .values()
                .map(|v| size_of::<PolicyKey>() + 24 + v.len() * 4)
                .sum::<usize>()
            + self.counts.len() * (8 + SLOTS * 4)
            + self.tiers.len() * (size_of::<PolicyKey>() + 8)
    }
}
