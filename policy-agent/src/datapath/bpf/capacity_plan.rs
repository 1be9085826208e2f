//! Writes planned within the maps' capacities, so a full map fails closed
//! instead of stopping the sync at its first failed write (which would
//! leave new pods unattached, isolation flips unwritten and revoked flows
//! passing).
//!
//! 1. The usual order (upserts before deletes) needs room for both the old
//!    and the new entries at once. When a map would overflow that way, its
//!    deletes go first: policy deletes before policy upserts closes for a
//!    moment, never opens; ipcache deletes still follow every policy write.
//! 2. What still does not fit is dropped, choosing what fails closed:
//!    policy entries are allows (missing ones deny); ipcache entries of pod
//!    addresses only carry the pod's label identity (the address keeps its
//!    address class through the carved prefix that covers it); identity
//!    and rule names are for `dump` only. Carved prefixes are dropped last: if even
//!    those do not fit, every allow keyed by an address class or the world
//!    is withdrawn (an address could otherwise fall into a wider class).
//!    A new endpoint that does not fit is left unattached and reported.
//!    A Service frontend that does not fit is reported: flows to it are
//!    judged at the client by its address (closed, unless an ipBlock
//!    allows it; a Service range covers every frontend in it
//!    with one entry, which is why ranges are kept before addresses).
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_UPDATING, ENDPOINT_INGRESS_UPDATING, EndpointInfo},
    identity::{WORLD, is_cidr, kind},
    maps as names,
    policy::{PolicyEntry, action},
};

use policy_common::service::SERVICE_RANGE;

use crate::mapstate::{MapOp, MapState, identity_name_str};

/// The capacities of the maps a sync writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    pub policy: usize,
    pub ipcache_v4: usize,
    pub ipcache_v6: usize,
    pub identities: usize,
    pub rule_names: usize,
    /// The overflow hash (ifindexes beyond the slot array).
    pub endpoints: usize,
    /// ifindexes below this live in the slot array (always room).
    pub slots: u32,
    pub services: usize,
}

/// What did not fit, by map: entries dropped (or withdrawn).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shortfall {
    pub by_map: BTreeMap<&'static str, usize>,
    /// Endpoint identities that lost allows.
    pub identities: BTreeSet<u32>,
    /// New endpoints (ifindexes) that could not be written.
    pub endpoints: BTreeSet<u32>,
    /// Carved prefixes did not fit: allows by address class withdrawn.
    pub classes_withdrawn: bool,
    /// Endpoint identities held closed for new flows: a tier Deny or Pass
    /// by address class of theirs had to be withdrawn.
    pub held_closed: BTreeSet<u32>,
}

impl Shortfall {
    pub fn is_empty(&self) -> bool {
        self.by_map.is_empty()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Map {
    Identities,
    RuleNames,
    Policy,
    Endpoints,
    Ipcache4,
    Ipcache6,
    Services,
}

fn map_of(op: &MapOp<u32>, slots: u32) -> Option<Map> {
    Some(match op {
        MapOp::UpsertIdentity(..) | MapOp::DeleteIdentity(_) => Map::Identities,
        MapOp::UpsertRuleName(..) | MapOp::DeleteRuleName(_) => Map::RuleNames,
        MapOp::UpsertPolicy(..) | MapOp::DeletePolicy(_) => Map::Policy,
        MapOp::UpsertEndpoint(k, _) | MapOp::DeleteEndpoint(k) if *k >= slots => Map::Endpoints,
        MapOp::UpsertIpcache(n, _) | MapOp::DeleteIpcache(n) => match n {
            IpNet::V4(_) => Map::Ipcache4,
            IpNet::V6(_) => Map::Ipcache6,
        },
        MapOp::UpsertService(..) | MapOp::DeleteService(_) => Map::Services,
        MapOp::UpsertEndpoint(..) | MapOp::DeleteEndpoint(_) => return None,
    })
}

fn is_upsert(op: &MapOp<u32>) -> bool {
    matches!(
        op,
        MapOp::UpsertIdentity(..)
            | MapOp::UpsertRuleName(..)
            | MapOp::UpsertPolicy(..)
            | MapOp::UpsertEndpoint(..)
            | MapOp::UpsertIpcache(..)
            | MapOp::UpsertService(..)
    )
}

/// Whether the op writes a key the map does not hold yet.
fn adds_key(op: &MapOp<u32>, before: &MapState<u32>) -> bool {
    match op {
        MapOp::UpsertIdentity(k, _) => !before.identities.contains_key(k),
        MapOp::UpsertRuleName(k, _) => !before.rule_names.contains_key(k),
        MapOp::UpsertPolicy(k, _) => !before.policy.contains_key(k),
        MapOp::UpsertEndpoint(k, _) => !before.endpoints.contains_key(k),
        MapOp::UpsertIpcache(k, _) => !before.ipcache.contains_key(k),
        MapOp::UpsertService(k, _) => !before.services.contains_key(k),
        _ => false,
    }
}

fn removes_key(op: &MapOp<u32>, before: &MapState<u32>) -> bool {
    match op {
        MapOp::DeleteIdentity(k) => before.identities.contains_key(k),
        MapOp::DeleteRuleName(k) => before.rule_names.contains_key(k),
        MapOp::DeletePolicy(k) => before.policy.contains_key(k),
        MapOp::DeleteEndpoint(k) => before.endpoints.contains_key(k),
        MapOp::DeleteIpcache(k) => before.ipcache.contains_key(k),
        MapOp::DeleteService(k) => before.services.contains_key(k),
        _ => false,
    }
}

fn held(before: &MapState<u32>, map: Map, slots: u32) -> usize {
    match map {
        Map::Identities => before.identities.len(),
        Map::RuleNames => before.rule_names.len(),
        Map::Policy => before.policy.len(),
        Map::Endpoints => before.endpoints.keys().filter(|k| **k >= slots).count(),
        Map::Ipcache4 => before.ipcache.keys().filter(|n| n.addr().is_ipv4()).count(),
        Map::Ipcache6 => before.ipcache.keys().filter(|n| n.addr().is_ipv6()).count(),
        Map::Services => before.services.len(),
    }
}

fn capacity(caps: &Capacities, map: Map) -> usize {
    match map {
        Map::Identities => caps.identities,
        Map::RuleNames => caps.rule_names,
        Map::Policy => caps.policy,
        Map::Endpoints => caps.endpoints,
        Map::Ipcache4 => caps.ipcache_v4,
        Map::Ipcache6 => caps.ipcache_v6,
        Map::Services => caps.services,
    }
}

fn map_name(map: Map) -> &'static str {
    match map {
        Map::Identities => names::IDENTITY_NAMES,
        Map::RuleNames => names::RULE_NAMES,
        Map::Policy => names::POLICY,
        Map::Endpoints => names::ENDPOINTS,
        Map::Ipcache4 => names::IPCACHE_V4,
        Map::Ipcache6 => names::IPCACHE_V6,
        Map::Services => names::SERVICES,
    }
}

/// The prefixes ipBlocks carve (address classes), from the identity names.
/// Those named in this change as well: a prefix carved for the first time
/// is one too (else it would be dropped as a pod address, and a Deny keyed
/// by its class would silently stop applying).
fn carved(state: &MapState<u32>, ops: &[MapOp<u32>]) -> BTreeSet<IpNet> {
    let named = ops.iter().filter_map(|o| match o {
        MapOp::UpsertIdentity(id, n) => Some((id, n)),
        _ => None,
    });
    state
        .identities
        .iter()
        .chain(named)
        .filter(|(id, n)| is_cidr(**id) && n.kind == kind::CIDR)
        .filter_map(|(_, n)| identity_name_str(n).parse::<IpNet>().ok())
        .collect()
}

/// Fits `ops` (turning `before` into the desired state) into `caps`,
/// reordering and dropping as the module comment says.
pub fn fit(before: &MapState<u32>, ops: &mut Vec<MapOp<u32>>, caps: &Capacities) -> Shortfall {
    let slots = caps.slots;
    let mut shortfall = Shortfall::default();
    // Peak use per map in the usual order: everything added before
    // anything removed.
    let maps = [
        Map::Identities,
        Map::RuleNames,
        Map::Policy,
        Map::Endpoints,
        Map::Ipcache4,
        Map::Ipcache6,
        Map::Services,
    ];
    let added = |ops: &[MapOp<u32>], m: Map| {
        ops.iter()
            .filter(|o| map_of(o, slots) == Some(m) && adds_key(o, before))
            .count()
    };
    let removed = |ops: &[MapOp<u32>], m: Map| {
        ops.iter()
            .filter(|o| map_of(o, slots) == Some(m) && removes_key(o, before))
            .count()
    };
    let tight: BTreeSet<Map> = maps
        .into_iter()
        .filter(|m| held(before, *m, slots) + added(ops, *m) > capacity(caps, *m))
        .collect();
    if tight.is_empty() {
        return shortfall;
    }
    // 1. Deletes of a tight map move before its first upsert. When an
    //    ipcache is tight, policy deletes move too (before theirs): an
    //    address must not lose a carved prefix while allows keyed by the
    //    wider class it would fall into still exist.
    let mut hoist = tight.clone();
    if hoist.contains(&Map::Ipcache4) || hoist.contains(&Map::Ipcache6) {
        hoist.insert(Map::Policy);
    }
    let hoisted =
        |o: &MapOp<u32>| !is_upsert(o) && map_of(o, slots).is_some_and(|m| hoist.contains(&m));
    let original = std::mem::take(ops);
    let deletes_of = |m: Map| -> Vec<MapOp<u32>> {
        original
            .iter()
            .filter(|o| hoisted(o) && map_of(o, slots) == Some(m))
            .cloned()
            .collect()
    };
    let mut emitted: BTreeSet<Map> = BTreeSet::new();
    for op in &original {
        if hoisted(op) {
            continue;
        }
        if is_upsert(op)
            && let Some(m) = map_of(op, slots).filter(|m| hoist.contains(m))
        {
            if matches!(m, Map::Ipcache4 | Map::Ipcache6) && emitted.insert(Map::Policy) {
                ops.extend(deletes_of(Map::Policy));
            }
            if emitted.insert(m) {
                ops.extend(deletes_of(m));
            }
        }
        ops.push(op.clone());
    }
    // Deletes of maps that had no upserts keep their relative order.
    ops.extend(
        original
            .iter()
            .filter(|o| hoisted(o) && map_of(o, slots).is_some_and(|m| !emitted.contains(&m)))
            .cloned(),
    );
    // 2. Drop what still does not fit.
    let carved = carved(before, ops);
    for m in tight {
        let cap = capacity(caps, m);
        let mut left = (held(before, m, slots) + added(ops, m)).saturating_sub(removed(ops, m));
        if left <= cap {
            continue;
        }
        let mut dropped = 0;
        // Pod addresses first (ipcache), then from the end of the list.
        // Never an entry holding a tier Deny or Pass: without it the flows
        // it stops would meet whatever comes after it.
        let mut order: Vec<usize> = (0..ops.len())
            .filter(|i| map_of(&ops[*i], slots) == Some(m) && adds_key(&ops[*i], before))
            .filter(|i| !matches!(&ops[*i], MapOp::UpsertPolicy(_, e) if stops_flows(e)))
            .collect();
        order.reverse();
        order.sort_by_key(|i| match &ops[*i] {
            MapOp::UpsertIpcache(net, _) if carved.contains(net) => 1,
            MapOp::UpsertService(_, v) if v.flags & SERVICE_RANGE != 0 => 1,
            _ => 0,
        });
        let mut drop: BTreeSet<usize> = BTreeSet::new();
        for i in order {
            if left <= cap {
                break;
            }
            if let MapOp::UpsertIpcache(net, _) = &ops[i]
                && carved.contains(net)
            {
                // Dropped last; what its class allowed goes with it.
                shortfall.classes_withdrawn = true;
            }
            match &ops[i] {
                MapOp::UpsertPolicy(k, _) => {
                    shortfall.identities.insert(k.endpoint_identity);
                }
                MapOp::UpsertEndpoint(k, _) => {
                    shortfall.endpoints.insert(*k);
                }
                _ => {}
            }
            drop.insert(i);
            dropped += 1;
            left -= 1;
        }
        let mut i = 0;
        ops.retain(|_| {
            let keep = !drop.contains(&i);
            i += 1;
            keep
        });
        if dropped > 0 || left > cap {
            *shortfall.by_map.entry(map_name(m)).or_default() += dropped + left.saturating_sub(cap);
        }
    }
    if shortfall.classes_withdrawn {
        withdraw_class_allows(before, ops, &mut shortfall);
    }
    shortfall
}

/// Whether an entry holds a tier slot that stops or passes flows
/// (dropping it could only open).
fn stops_flows(e: &PolicyEntry) -> bool {
    [e.admin, e.baseline]
        .iter()
        .any(|s| !s.is_none() && matches!(s.action(), action::DENY | action::PASS))
}

/// Carved prefixes do not fit: no allow keyed by an address class (or the
/// world) may stay, written or existing. A tier Deny or Pass keyed by one
/// cannot stay either (an address may now resolve to a wider class, where
/// it does not apply), and without it the flows it stops would meet what
/// comes after it: the endpoints it belongs to are held closed for new
/// flows in that direction (`UPDATING`) until the maps have room.
fn withdraw_class_allows(before: &MapState<u32>, ops: &mut Vec<MapOp<u32>>, s: &mut Shortfall) {
    let by_class = |peer: u32| is_cidr(peer) || peer == WORLD;
    let mut closed: BTreeSet<(u32, u8)> = BTreeSet::new();
    ops.retain(|op| match op {
        MapOp::UpsertPolicy(k, e) if by_class(k.peer_identity) => {
            s.identities.insert(k.endpoint_identity);
            if stops_flows(e) {
                closed.insert((k.endpoint_identity, k.direction));
            }
            false
        }
        _ => true,
    });
    closed.extend(
        before
            .policy
            .iter()
            .filter(|(k, e)| by_class(k.peer_identity) && stops_flows(e))
            .map(|(k, _)| (k.endpoint_identity, k.direction)),
    );
    let first_ipcache = ops
        .iter()
        .position(|o| matches!(o, MapOp::UpsertIpcache(..) | MapOp::DeleteIpcache(_)))
        .unwrap_or(ops.len());
    // Closed first, before any Deny goes; every later write of those
    // endpoints keeps them closed.
    let hold = |ep: &mut EndpointInfo| {
        for (identity, dir) in &closed {
            if ep.identity == *identity {
                ep.flags |= if *dir == direction::INGRESS {
                    ENDPOINT_INGRESS_UPDATING
                } else {
                    ENDPOINT_EGRESS_UPDATING
                };
            }
        }
    };
    let mut closing: BTreeMap<u32, EndpointInfo> = before.endpoints.clone();
    for op in &ops[..first_ipcache] {
        match op {
            MapOp::UpsertEndpoint(k, e) => {
                closing.insert(*k, *e);
            }
            MapOp::DeleteEndpoint(k) => {
                closing.remove(k);
            }
            _ => {}
        }
    }
    let closing: Vec<MapOp<u32>> = closing
        .into_iter()
        .filter(|(_, e)| closed.iter().any(|(id, _)| *id == e.identity))
        .map(|(k, mut e)| {
            hold(&mut e);
            s.held_closed.insert(e.identity);
            MapOp::UpsertEndpoint(k, e)
        })
        .collect();
    for op in &mut ops[first_ipcache..] {
        if let MapOp::UpsertEndpoint(_, e) = op {
            hold(e);
        }
    }
    let first_ipcache = {
        let n = closing.len();
        ops.splice(first_ipcache..first_ipcache, closing);
        first_ipcache + n
    };
    let withdraw: Vec<MapOp<u32>> = before
        .policy
        .keys()
        .filter(|k| by_class(k.peer_identity))
        .filter(|k| !ops.contains(&MapOp::DeletePolicy(**k)))
        .map(|k| {
            s.identities.insert(k.endpoint_identity);
            MapOp::DeletePolicy(*k)
        })
        .collect();
    let n = withdraw.len();
    ops.splice(first_ipcache..first_ipcache, withdraw);
    *s.by_map.entry(names::POLICY).or_default() += n;
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use policy_common::{
        direction,
        endpoint::EndpointInfo,
        identity::FIRST_CIDR,
        ipcache::IpcacheEntry,
        policy::{PolicyEntry, PolicyKey},
        proto,
    };

    use super::*;
    use crate::mapstate::{diff, identity_name};

    fn caps(policy: usize, ipcache: usize) -> Capacities {
        Capacities {
            policy,
            ipcache_v4: ipcache,
            ipcache_v6: ipcache,
            identities: 100,
            rule_names: 100,
            endpoints: 10,
            slots: 100,
            services: 100,
        }
    }

    fn key(peer: u32, port: u16) -> PolicyKey {
        PolicyKey::new(300, direction::INGRESS, peer, proto::TCP, 16, port)
    }

    fn state(ports: &[u16]) -> MapState<u32> {
        let mut s = MapState::default();
        s.endpoints.insert(
            7,
            EndpointInfo {
                identity: 300,
                ..Default::default()
            },
        );
        for p in ports {
            s.policy.insert(key(301, *p), PolicyEntry::default());
        }
        s
    }

    /// Applies `ops` to `before`, asserting no map ever exceeds `caps`.
    fn replay(before: &MapState<u32>, ops: &[MapOp<u32>], caps: &Capacities) -> MapState<u32> {
        let mut s = before.clone();
        for op in ops {
            s.apply_op(op);
            assert!(
                s.policy.len() <= caps.policy,
                "policy over capacity at {op:?}"
            );
            assert!(s.ipcache.len() <= caps.ipcache_v4, "ipcache over capacity");
        }
        s
    }

    #[test]
    fn a_swap_that_needs_room_for_both_deletes_first() {
        let before = state(&[1, 2, 3]);
        let after = state(&[4, 5, 6]);
        let caps = caps(4, 10);
        let mut ops = diff(&before, &after);
        let short = fit(&before, &mut ops, &caps);
        assert!(short.is_empty(), "{short:?}");
        assert_eq!(replay(&before, &ops, &caps).policy, after.policy);
    }

    #[test]
    fn allows_that_do_not_fit_are_dropped_the_rest_lands() {
        let before = state(&[]);
        let after = state(&[1, 2, 3, 4, 5, 6]);
        let caps = caps(4, 10);
        let mut ops = diff(&before, &after);
        let short = fit(&before, &mut ops, &caps);
        assert_eq!(short.by_map.get(names::POLICY), Some(&2));
        assert!(short.identities.contains(&300));
        let landed = replay(&before, &ops, &caps);
        assert_eq!(landed.policy.len(), 4);
        assert!(landed.policy.keys().all(|k| after.policy.contains_key(k)));
        assert!(
            landed.endpoints.contains_key(&7),
            "the endpoint still lands"
        );
    }

    #[test]
    fn pod_addresses_go_before_carved_prefixes_and_carving_that_cannot_fit_withdraws_class_allows()
    {
        let class = policy_common::identity::FIRST_CIDR;
        let mut before = state(&[]);
        before.identities.insert(
            class,
            std::sync::Arc::new(identity_name(kind::CIDR, "10.0.0.0/8")),
        );
        let mut after = before.clone();
        after.policy.insert(key(class, 80), PolicyEntry::default());
        let entry = IpcacheEntry {
            identity: 301,
            cidr_identity: class,
        };
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        after.ipcache.insert(net("10.0.0.0/8"), entry);
        for i in 1..=3u8 {
            let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, i));
            after.ipcache.insert(IpNet::new(ip, 32).unwrap(), entry);
        }
        // Room for the carved prefix and one pod address.
        let mut ops = diff(&before, &after);
        let short = fit(&before, &mut ops, &caps(10, 2));
        assert_eq!(short.by_map.get(names::IPCACHE_V4), Some(&2));
        assert!(!short.classes_withdrawn);
        let landed = replay(&before, &ops, &caps(10, 2));
        assert!(landed.ipcache.contains_key(&net("10.0.0.0/8")));
        assert!(landed.policy.contains_key(&key(class, 80)));
        // No room even for the prefix: the class allow is withdrawn.
        let mut ops = diff(&before, &after);
        let short = fit(&before, &mut ops, &caps(10, 0));
        assert!(short.classes_withdrawn);
        let landed = replay(&before, &ops, &caps(10, 0));
        assert!(!landed.policy.contains_key(&key(class, 80)));
        assert!(short.held_closed.is_empty(), "no tier Deny was withdrawn");
    }

    /// A tier Deny keyed by an address class that has to go (a carved
    /// prefix does not fit) would open what it stops: its endpoint is held
    /// closed for new flows in that direction before it goes, and every
    /// later write of the endpoint keeps it closed.
    #[test]
    fn a_withdrawn_tier_deny_by_address_class_holds_its_endpoint_closed() {
        use policy_common::policy::{ENTRY_TIERS_ONLY, TierSlot, action};
        let (a, b) = (FIRST_CIDR, FIRST_CIDR + 1);
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let carve = |class: u32| IpcacheEntry {
            identity: 0,
            cidr_identity: class,
        };
        // Held: an Admin Deny of class a, its prefix carved.
        let mut before = state(&[]);
        before.identities.insert(
            a,
            std::sync::Arc::new(identity_name(kind::CIDR, "10.0.0.0/8")),
        );
        let deny = PolicyEntry {
            admin: TierSlot::new(5, action::DENY),
            flags: ENTRY_TIERS_ONLY,
            ..PolicyEntry::default()
        };
        before.policy.insert(key(a, 80), deny);
        before.ipcache.insert(net("10.0.0.0/8"), carve(a));
        // Wanted: a second carved prefix, which does not fit.
        let mut after = before.clone();
        after.identities.insert(
            b,
            std::sync::Arc::new(identity_name(kind::CIDR, "192.168.0.0/16")),
        );
        after.policy.insert(key(b, 443), PolicyEntry::default());
        after.ipcache.insert(net("192.168.0.0/16"), carve(b));
        let mut ops = diff(&before, &after);
        // A revision bump after everything else, as a sync writes one.
        let mut bumped = after.endpoints[&7];
        bumped.revision = 9;
        ops.push(MapOp::UpsertEndpoint(7, bumped));
        let short = fit(&before, &mut ops, &caps(10, 1));
        assert!(short.classes_withdrawn);
        assert!(short.held_closed.contains(&300), "{short:?}");
        let closed_at = ops.iter().position(
            |o| matches!(o, MapOp::UpsertEndpoint(7, e) if e.updating(direction::INGRESS)),
        );
        let deny_gone_at = ops
            .iter()
            .position(|o| *o == MapOp::DeletePolicy(key(a, 80)));
        assert!(
            matches!((closed_at, deny_gone_at), (Some(c), Some(d)) if c < d),
            "closed at {closed_at:?}, the Deny removed at {deny_gone_at:?}: {ops:#?}"
        );
        let landed = replay(&before, &ops, &caps(10, 1));
        assert!(!landed.policy.contains_key(&key(a, 80)));
        let ep = landed.endpoints[&7];
        assert!(ep.updating(direction::INGRESS), "{ep:?}");
        assert!(!ep.updating(direction::EGRESS), "{ep:?}");
        assert_eq!(ep.revision, 9);
    }
}
