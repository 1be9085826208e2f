//! The ordered difference between two map states.
//!
//! Order (fixed, so no pod is opened or closed wrongly in between):
//! 1. identity and rule names added or changed (a name exists before an
//!    entry references it); then every address whose
//!    resolution changes (its entry changes or goes, or a new entry claims
//!    it) while what it resolves to now gains an allow in this change is
//!    put in transit ([`identity::IN_TRANSIT`]: nothing allows it) until
//!    its turn below — left where it was while that gains allows, the
//!    address would meet them though its new entry is elsewhere (the
//!    property test found it: an address leaving a pod's identity as that
//!    identity became allowed); then new prefixes that only carve
//!    an address class out of a wider one (an `except`), longest first: an
//!    address they cover resolves to its new class, which nothing allows
//!    yet, before any allow of the wider class lands (the property test
//!    found the opening: an endpoint whose new policy allows `::/0 except
//!    fd00::/16` admitted fd00::9 until the carve landed at step 5). Not
//!    one whose class loses allows in this change, nor one with a new,
//!    longer prefix inside it (an address there would stop at the carve's
//!    class on its way to its own entry): those wait for step 5. Then
//!    Service frontends added or changed (a frontend only sends flows to be
//!    judged after DNAT, which is never more open);
//! 2. policy entries added or changed: new allows exist before anything
//!    refers to them;
//! 3. endpoints added or changed: isolation flips, identity and lookup bits
//!    switch atomically per endpoint, with their allows already present;
//! 4. endpoints removed, while their allows still exist (a leaving pod is
//!    never isolated with nothing allowed; without an entry its interface
//!    is the new state's);
//! 5. ipcache entries added or changed, longest prefix first, then removed,
//!    shortest prefix first: an address moves from the class it had to the
//!    class it will have with no stop at a third (a wide prefix's new class
//!    never lands before the prefixes an `except` carves out of it), and
//!    only once the entries that allow its new class exist, while those
//!    of its old class still do;
//! 6. policy entries removed: old allows go only after nothing needs them;
//!    then the entries of step 5 held back: an entry (changed or new)
//!    whose identity or class loses allows in this change (a removed
//!    policy entry names it as its peer) lands only now — at step 5 its
//!    addresses would have met those stale allows under their new entry,
//!    allowed by neither state (a transient opening the property test
//!    found). Held back, they keep what they resolved to a little longer:
//!    at worst a flow is denied in between, never allowed. Removals whose
//!    addresses fall to a covering class that loses allows wait likewise,
//!    after the held-back entries;
//! 7. identity names, rule names (after the last entry referencing
//!    them) and Service frontends removed;
//!
//! An endpoint judged by tiers whose identity's entries change is held
//! closed around all of it (see [`updating`]): its old entry with the
//! `UPDATING` bits first, its new entry with them at step 3, its new entry
//! without them once steps 1-7 landed, then:
//! 8. new revisions of existing endpoints (step 3 writes them with their
//!    old revision): conntrack entries are judged again only once the maps
//!    hold the whole new state.
//!
//! Between steps the datapath never allows a flow neither state allows; it
//! may deny one both allow in four known cases (an endpoint and its peer
//! changing together; a peer held back past step 6; an address a new
//! carve covers, until the allows of its new class land at step 2; an
//! address in transit).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use ipnet::IpNet;
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_UPDATING, ENDPOINT_INGRESS_UPDATING, EndpointInfo},
    identity::{self, IdentityName},
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    rule_name::{RuleKey, RuleName},
    service::ServiceEntry,
};

use super::MapState;

/// One map write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp<K> {
    UpsertIdentity(u32, Arc<IdentityName>),
    UpsertPolicy(PolicyKey, PolicyEntry),
    UpsertEndpoint(K, EndpointInfo),
    UpsertIpcache(IpNet, IpcacheEntry),
    DeletePolicy(PolicyKey),
    DeleteIpcache(IpNet),
    DeleteEndpoint(K),
    DeleteIdentity(u32),
    UpsertService(IpNet, ServiceEntry),
    DeleteService(IpNet),
    UpsertRuleName(RuleKey, Box<RuleName>),
    DeleteRuleName(RuleKey),
}

fn upserts<'a, K: Ord + Clone, V: PartialEq + Clone>(
    old: &'a BTreeMap<K, V>,
    new: &'a BTreeMap<K, V>,
) -> impl Iterator<Item = (K, V)> + 'a {
    new.iter()
        .filter(move |(k, v)| old.get(k) != Some(v))
        .map(|(k, v)| (k.clone(), v.clone()))
}

fn removals<'a, K: Ord + Clone, V>(
    old: &'a BTreeMap<K, V>,
    new: &'a BTreeMap<K, V>,
) -> impl Iterator<Item = K> + 'a {
    old.keys().filter(move |k| !new.contains_key(k)).cloned()
}

/// The writes of one change, map by map, in no particular order.
pub struct Writes<K> {
    pub identity_upserts: Vec<(u32, Arc<IdentityName>)>,
    pub identity_removals: Vec<u32>,
    pub rule_name_upserts: Vec<(RuleKey, RuleName)>,
    pub rule_name_removals: Vec<RuleKey>,
    pub policy_upserts: Vec<(PolicyKey, PolicyEntry)>,
    pub policy_removals: Vec<PolicyKey>,
    pub endpoint_upserts: Vec<(K, EndpointInfo)>,
    pub endpoint_removals: Vec<K>,
    pub ipcache_upserts: Vec<(IpNet, IpcacheEntry)>,
    /// The old value of every entry an upsert replaces (an address
    /// moving) or a removal deletes.
    pub ipcache_old: BTreeMap<IpNet, IpcacheEntry>,
    /// For every new entry, what its prefix resolved to before it (the
    /// longest shorter prefix then; none: nobody).
    pub ipcache_covering_old: BTreeMap<IpNet, IpcacheEntry>,
    pub ipcache_removals: Vec<IpNet>,
    /// For every removed entry, what its prefix resolves to after it (the
    /// longest shorter prefix of the new state; none: nobody).
    pub ipcache_covering_new: BTreeMap<IpNet, IpcacheEntry>,
    pub service_upserts: Vec<(IpNet, ServiceEntry)>,
    pub service_removals: Vec<IpNet>,
    /// Endpoints held closed while the change lands (see [`updating`]).
    pub updating: Updating<K>,
}

/// Endpoints whose tier entries change, by key: the `ENDPOINT_*_UPDATING`
/// bits to hold, their old entry and their new one.
pub type Updating<K> = BTreeMap<K, (u32, Option<EndpointInfo>, Option<EndpointInfo>)>;

/// The endpoints a change must hold closed: a pod judged by tiers in a
/// direction (before or after) whose identity's policy entries in that
/// direction change. Tier verdicts are not monotonic, so no order of the
/// entry writes keeps every state in between within what the two ends
/// allow; the endpoint drops new flows in that direction from before the
/// first write to after the last. `endpoints`: every endpoint, old and
/// new entry.
pub fn updating<K: Ord>(
    endpoints: impl Iterator<Item = (K, Option<EndpointInfo>, Option<EndpointInfo>)>,
    policy_changes: impl Iterator<Item = PolicyKey>,
) -> Updating<K> {
    let changed: BTreeSet<(u32, u8)> = policy_changes
        .map(|k| (k.endpoint_identity, k.direction))
        .collect();
    if changed.is_empty() {
        return Updating::new();
    }
    endpoints
        .filter_map(|(k, old, new)| {
            let mut bits = 0;
            for (dir, bit) in [
                (direction::INGRESS, ENDPOINT_INGRESS_UPDATING),
                (direction::EGRESS, ENDPOINT_EGRESS_UPDATING),
            ] {
                let both = || old.iter().chain(new.iter());
                if both().any(|e| e.tiered(dir))
                    && both().any(|e| changed.contains(&(e.identity, dir)))
                {
                    bits |= bit;
                }
            }
            (bits != 0).then_some((k, (bits, old, new)))
        })
        .collect()
}

impl<K: Ord + Clone> Writes<K> {
    /// The writes in the order of steps 1-7 (the module's comment).
    pub fn ordered(self) -> Vec<MapOp<K>> {
        let Self {
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
        } = self;
        let mut ops = Vec::with_capacity(
            identity_upserts.len()
                + identity_removals.len()
                + rule_name_upserts.len()
                + rule_name_removals.len()
                + policy_upserts.len()
                + policy_removals.len()
                + endpoint_upserts.len()
                + endpoint_removals.len()
                + ipcache_upserts.len()
                + ipcache_removals.len()
                + service_upserts.len()
                + service_removals.len(),
        );
        // Endpoints held closed first (their old entry, new flows dropped
        // in the directions whose tier entries change).
        ops.extend(updating.iter().filter_map(|(k, (bits, old, _))| {
            old.map(|mut e| {
                e.flags |= bits;
                MapOp::UpsertEndpoint(k.clone(), e)
            })
        }));
        ops.extend(
            identity_upserts
                .into_iter()
                .map(|(k, v)| MapOp::UpsertIdentity(k, v)),
        );
        ops.extend(
            rule_name_upserts
                .into_iter()
                .map(|(k, v)| MapOp::UpsertRuleName(k, Box::new(v))),
        );
        let losing: BTreeSet<u32> = policy_removals.iter().map(|k| k.peer_identity).collect();
        let gaining: BTreeSet<u32> = policy_upserts
            .iter()
            .map(|(k, _)| k.peer_identity)
            .collect();
        let ipcache_moved: BTreeSet<IpNet> = ipcache_upserts
            .iter()
            .filter(|(net, _)| ipcache_old.contains_key(net))
            .map(|(net, _)| *net)
            .collect();
        let (mut carves, ipcache_upserts) = early_carves(ipcache_upserts, &ipcache_moved, &losing);
        // Step 1: addresses whose entry changes or goes, or that a new
        // entry will claim, while what they resolve to now gains allows,
        // go in transit first.
        let leaving = ipcache_old
            .iter()
            .filter(|(_, old)| names_any(old, &gaining))
            .map(|(net, _)| *net);
        // A new entry held back past the removals (below) goes in transit
        // too: its addresses would otherwise stop at whatever a shorter
        // prefix changes to at step 5, a class neither state gives them.
        let claimed = ipcache_upserts
            .iter()
            .filter(|(net, _)| !ipcache_moved.contains(net))
            .filter(|(net, v)| {
                names_any(v, &losing)
                    || ipcache_covering_old
                        .get(net)
                        .is_some_and(|cover| names_any(cover, &gaining))
            })
            .map(|(net, _)| *net);
        ops.extend(
            leaving
                .chain(claimed)
                .map(|net| MapOp::UpsertIpcache(net, IN_TRANSIT_ENTRY)),
        );
        carves.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
        ops.extend(carves.into_iter().map(|(k, v)| MapOp::UpsertIpcache(k, v)));
        ops.extend(
            service_upserts
                .into_iter()
                .map(|(k, v)| MapOp::UpsertService(k, v)),
        );
        ops.extend(
            policy_upserts
                .into_iter()
                .map(|(k, v)| MapOp::UpsertPolicy(k, v)),
        );
        ops.extend(endpoint_upserts.into_iter().map(|(k, mut v)| {
            if let Some((bits, ..)) = updating.get(&k) {
                v.flags |= bits;
            }
            MapOp::UpsertEndpoint(k, v)
        }));
        ops.extend(endpoint_removals.into_iter().map(MapOp::DeleteEndpoint));
        let (mut late, mut ipcache_upserts): (Vec<_>, Vec<_>) = ipcache_upserts
            .into_iter()
            .partition(|(_, v)| names_any(v, &losing));
        // Stable sorts: within one length the maps' own order stays.
        ipcache_upserts.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
        ops.extend(
            ipcache_upserts
                .into_iter()
                .map(|(k, v)| MapOp::UpsertIpcache(k, v)),
        );
        // A removal hands its addresses to the prefix covering it; when
        // that class loses allows in this change, the removal waits for
        // the policy removals like the late upserts (the property test
        // found the opening: `0.0.0.0/0 except 10.0.0.0/8` on port 53
        // becoming `0.0.0.0/0` on port 80 admitted 10.0.0.9:53 in between).
        let (mut late_removals, mut ipcache_removals): (Vec<_>, Vec<_>) =
            ipcache_removals.into_iter().partition(|net| {
                ipcache_covering_new
                    .get(net)
                    .is_some_and(|cover| names_any(cover, &losing))
            });
        ipcache_removals.sort_by_key(IpNet::prefix_len);
        ops.extend(ipcache_removals.into_iter().map(MapOp::DeleteIpcache));
        ops.extend(policy_removals.into_iter().map(MapOp::DeletePolicy));
        late.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
        ops.extend(late.into_iter().map(|(k, v)| MapOp::UpsertIpcache(k, v)));
        late_removals.sort_by_key(IpNet::prefix_len);
        ops.extend(late_removals.into_iter().map(MapOp::DeleteIpcache));
        ops.extend(identity_removals.into_iter().map(MapOp::DeleteIdentity));
        ops.extend(rule_name_removals.into_iter().map(MapOp::DeleteRuleName));
        ops.extend(service_removals.into_iter().map(MapOp::DeleteService));
        // Everything landed: the held endpoints open, as the new state
        // says (with their old revision: the bumps follow).
        ops.extend(updating.into_iter().filter_map(|(k, (_, old, new))| {
            new.map(|mut e| {
                if let Some(o) = old {
                    e.revision = o.revision;
                }
                MapOp::UpsertEndpoint(k, e)
            })
        }));
        ops
    }
}

/// What an address in transit resolves to (see step 1).
const IN_TRANSIT_ENTRY: IpcacheEntry = IpcacheEntry {
    identity: identity::IN_TRANSIT,
    cidr_identity: identity::IN_TRANSIT,
};

/// The entry that covers `net` from a shorter prefix, as `lookup` reads
/// the map (its longest such prefix).
pub fn covering(
    net: &IpNet,
    lookup: impl Fn(&IpNet) -> Option<IpcacheEntry>,
) -> Option<IpcacheEntry> {
    (0..net.prefix_len()).rev().find_map(|len| {
        let shorter = IpNet::new(net.addr(), len).ok()?.trunc();
        lookup(&shorter)
    })
}

/// Whether an entry's identities are among `ids` (its label identity
/// only when it has one: `ANY` in a policy key is the wildcard peer).
fn names_any(entry: &IpcacheEntry, ids: &BTreeSet<u32>) -> bool {
    (entry.identity != identity::ANY && ids.contains(&entry.identity))
        || ids.contains(&entry.cidr_identity)
}

/// The ipcache upserts of step 1 (see the module's comment), and the
/// rest: a new prefix that only carves an address class (no label
/// identity, a class no removed entry names), unless a new, longer prefix
/// inside it also lands in this change (an address there would stop at
/// the carve's class on its way to its own entry).
type Upserts = Vec<(IpNet, IpcacheEntry)>;

fn early_carves(
    upserts: Upserts,
    moved: &BTreeSet<IpNet>,
    losing: &BTreeSet<u32>,
) -> (Upserts, Upserts) {
    let inserted: Vec<IpNet> = upserts
        .iter()
        .filter(|(net, _)| !moved.contains(net))
        .map(|(net, _)| *net)
        .collect();
    upserts.into_iter().partition(|(net, v)| {
        !moved.contains(net)
            && v.identity == identity::ANY
            && !losing.contains(&v.cidr_identity)
            && !inserted
                .iter()
                .any(|n| n.prefix_len() > net.prefix_len() && net.contains(&n.network()))
    })
}

/// The minimal ordered list of writes turning `old` into `new`.
pub fn diff<K: Ord + Clone>(old: &MapState<K>, new: &MapState<K>) -> Vec<MapOp<K>> {
    let writes = Writes {
        identity_upserts: upserts(&old.identities, &new.identities).collect(),
        identity_removals: removals(&old.identities, &new.identities).collect(),
        rule_name_upserts: upserts(&old.rule_names, &new.rule_names).collect(),
        rule_name_removals: removals(&old.rule_names, &new.rule_names).collect(),
        policy_upserts: upserts(&old.policy, &new.policy).collect(),
        policy_removals: removals(&old.policy, &new.policy).collect(),
        // Existing endpoints keep their old revision here; the new one is
        // written last (below).
        endpoint_upserts: upserts(&old.endpoints, &new.endpoints)
            .filter_map(|(k, mut v)| {
                if let Some(prev) = old.endpoints.get(&k) {
                    v.revision = prev.revision;
                    if *prev == v {
                        return None;
                    }
                }
                Some((k, v))
            })
            .collect(),
        endpoint_removals: removals(&old.endpoints, &new.endpoints).collect(),
        ipcache_upserts: upserts(&old.ipcache, &new.ipcache).collect(),
        ipcache_old: old
            .ipcache
            .iter()
            .filter(|(k, v)| new.ipcache.get(k) != Some(v))
            .map(|(k, v)| (*k, *v))
            .collect(),
        ipcache_covering_old: new
            .ipcache
            .keys()
            .filter(|k| !old.ipcache.contains_key(k))
            .filter_map(|k| covering(k, |n| old.ipcache.get(n).copied()).map(|c| (*k, c)))
            .collect(),
        ipcache_removals: removals(&old.ipcache, &new.ipcache).collect(),
        ipcache_covering_new: removals(&old.ipcache, &new.ipcache)
            .filter_map(|k| covering(&k, |n| new.ipcache.get(n).copied()).map(|c| (k, c)))
            .collect(),
        service_upserts: upserts(&old.services, &new.services).collect(),
        service_removals: removals(&old.services, &new.services).collect(),
        updating: updating(
            old.endpoints
                .keys()
                .chain(new.endpoints.keys())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .map(|k| {
                    (
                        k.clone(),
                        old.endpoints.get(k).copied(),
                        new.endpoints.get(k).copied(),
                    )
                }),
            upserts(&old.policy, &new.policy)
                .map(|(k, _)| k)
                .chain(removals(&old.policy, &new.policy)),
        ),
    };
    let mut ops = writes.ordered();
    ops.extend(revision_bumps(old, new));
    ops
}

/// Step 8: new revisions of existing endpoints, once every other write has
/// landed. A flow re-judged earlier (under half-applied maps) would be
/// stamped with the new revision and never judged again.
fn revision_bumps<K: Ord + Clone>(old: &MapState<K>, new: &MapState<K>) -> Vec<MapOp<K>> {
    new.endpoints
        .iter()
        .filter(|(k, v)| {
            old.endpoints
                .get(k)
                .is_some_and(|prev| prev.revision != v.revision)
        })
        .map(|(k, v)| MapOp::UpsertEndpoint(k.clone(), *v))
        .collect()
}

/// Gives `new`'s endpoints their revisions: an endpoint whose verdicts
/// cannot have changed keeps its revision; any other gets one above every
/// revision in `old`, so conntrack entries judged before are judged again.
///
/// Verdicts of an endpoint depend on its own entry, the policy entries of
/// its identity, and the whole ipcache (any peer may have moved).
pub fn assign_revisions<K: Ord + Clone>(old: &MapState<K>, new: &mut MapState<K>) {
    let next = old.next_revision();
    let ipcache_changed = old.ipcache != new.ipcache;
    let mut policy_changed: BTreeMap<u32, bool> = BTreeMap::new();
    let mut changed_for = |identity: u32, old: &MapState<K>, new: &MapState<K>| -> bool {
        *policy_changed
            .entry(identity)
            .or_insert_with(|| !old.policy_of(identity).eq(new.policy_of(identity)))
    };
    let keys: Vec<K> = new.endpoints.keys().cloned().collect();
    for key in keys {
        let Some(mut ep) = new.endpoints.get(&key).copied() else {
            continue;
        };
        let same = match old.endpoints.get(&key) {
            Some(prev) => {
                let mut prev_cmp = *prev;
                prev_cmp.revision = ep.revision;
                !ipcache_changed && prev_cmp == ep && !changed_for(ep.identity, old, new)
            }
            None => false,
        };
        ep.revision = match (same, old.endpoints.get(&key)) {
            (true, Some(prev)) => prev.revision,
            _ => next,
        };
        new.endpoints.insert(key, ep);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use policy_common::{direction, endpoint::ENDPOINT_INGRESS_ISOLATED, identity, proto};

    use super::*;

    fn state() -> MapState<u32> {
        let mut s = MapState::default();
        s.endpoints.insert(
            7,
            EndpointInfo {
                identity: 300,
                ..Default::default()
            },
        );
        s.ipcache.insert(
            IpNet::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)), 32).unwrap(),
            IpcacheEntry {
                identity: 300,
                cidr_identity: identity::WORLD,
            },
        );
        s.finalize();
        s
    }

    #[test]
    fn identical_states_need_no_writes() {
        let a = state();
        assert!(diff(&a, &a.clone()).is_empty());
    }

    #[test]
    fn allows_come_before_isolation_and_removals_after() {
        let old = state();
        let mut new = old.clone();
        let key = PolicyKey::new(300, direction::INGRESS, 301, proto::TCP, 16, 80);
        new.policy.insert(key, PolicyEntry::default());
        new.endpoints.get_mut(&7).unwrap().flags = ENDPOINT_INGRESS_ISOLATED;
        new.finalize();
        assign_revisions(&old, &mut new);
        let ops = diff(&old, &new);
        assert!(matches!(ops[0], MapOp::UpsertPolicy(k, _) if k == key));
        // Isolation flips with the old revision; the new revision comes last.
        assert!(
            matches!(ops[1], MapOp::UpsertEndpoint(7, e) if e.flags == ENDPOINT_INGRESS_ISOLATED && e.revision == 0)
        );
        assert!(matches!(ops[2], MapOp::UpsertEndpoint(7, e) if e.revision == 1));
        assert_eq!(ops.len(), 3);

        // And back: the endpoint opens before the entry goes, and its
        // revision moves only after.
        let mut back = old.clone();
        assign_revisions(&new, &mut back);
        let ops = diff(&new, &back);
        assert!(matches!(ops[0], MapOp::UpsertEndpoint(7, e) if e.flags == 0 && e.revision == 1));
        assert!(matches!(ops[1], MapOp::DeletePolicy(k) if k == key));
        assert!(matches!(ops[2], MapOp::UpsertEndpoint(7, e) if e.flags == 0 && e.revision == 2));
        assert_eq!(ops.len(), 3);
    }

    #[test]
    fn unrelated_change_keeps_revision() {
        let mut old = state();
        old.endpoints.get_mut(&7).unwrap().revision = 5;
        old.endpoints.insert(
            8,
            EndpointInfo {
                identity: 400,
                revision: 3,
                ..Default::default()
            },
        );
        let mut new = old.clone();
        new.policy.insert(
            PolicyKey::new(400, direction::INGRESS, 0, proto::ANY, 0, 0),
            PolicyEntry::default(),
        );
        new.finalize();
        assign_revisions(&old, &mut new);
        assert_eq!(new.endpoints[&7].revision, 5);
        assert_eq!(new.endpoints[&8].revision, 6);
    }
}
