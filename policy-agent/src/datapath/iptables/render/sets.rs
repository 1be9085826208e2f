//! Peer sets and port matches: how a policy key's peer and ports read as
//! iptables matches.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use policy_common::{
    direction,
    identity::{ANY, WORLD, is_cidr},
    policy::PolicyKey,
};

use super::{
    super::ruleset::{Family, IpSet, SetKind, SetName},
    RenderInput,
};
use crate::mapstate::AddressSet;

/// What a set name stands for: the identity's kind letter and the hash of
/// its whole canonical name (None: the identity has no name, so no stable
/// set name either).
pub(super) fn set_of(input: &RenderInput<'_>, id: u32) -> Option<SetName> {
    let kind = if id == WORLD {
        SetKind::World
    } else if is_cidr(id) {
        SetKind::Class
    } else {
        SetKind::Identity
    };
    let name = input.maps.identities.get(&id)?;
    Some(SetName {
        kind,
        hash: input.narrow(name.name_hash),
    })
}

/// Splits a /0 (which hash:net cannot hold) into two halves.
fn storable(net: &IpNet) -> Vec<IpNet> {
    if net.prefix_len() != 0 {
        return vec![*net];
    }
    net.subnets(1).map(|s| s.collect()).unwrap_or_default()
}

/// The set of an identity's addresses in `fam` (empty without addresses).
pub(super) fn build_set(
    name: String,
    kind: SetKind,
    fam: Family,
    addrs: Option<&AddressSet>,
) -> IpSet {
    let mut entries = BTreeSet::new();
    if let Some(addrs) = addrs {
        for net in addrs.include.iter().filter(|n| Family::of(n) == fam) {
            for part in storable(net) {
                entries.insert((part, false));
            }
        }
        if kind.is_net() {
            for net in addrs.exclude.iter().filter(|n| Family::of(n) == fam) {
                entries.insert((*net, true));
            }
        }
    }
    IpSet {
        name,
        kind,
        family: fam,
        entries,
    }
}

/// What a key's peer match needs: the sets made so far and those one
/// chain uses.
pub(super) struct PeerSets<'a, 'b> {
    pub(super) input: &'a RenderInput<'b>,
    pub(super) addresses: &'a BTreeMap<u32, AddressSet>,
    pub(super) unnamed: &'a BTreeSet<u32>,
    pub(super) fam: Family,
    pub(super) sets: &'a mut BTreeMap<String, IpSet>,
    pub(super) used: &'a mut BTreeSet<String>,
}

/// The match of `key`'s peer (its set, made on first use; nothing for any
/// peer), or None when the peer's set cannot be named.
pub(super) fn peer_match(p: &mut PeerSets<'_, '_>, key: &PolicyKey, dir: u8) -> Option<String> {
    if key.peer_identity == ANY {
        return Some(String::new());
    }
    if p.unnamed.contains(&key.peer_identity) {
        return None;
    }
    let set = set_of(p.input, key.peer_identity)?;
    let name = set.render(p.fam);
    let (fam, addresses) = (p.fam, p.addresses);
    p.sets.entry(name.clone()).or_insert_with(|| {
        build_set(
            name.clone(),
            set.kind,
            fam,
            addresses.get(&key.peer_identity),
        )
    });
    p.used.insert(name.clone());
    let side = if dir == direction::INGRESS {
        "src"
    } else {
        "dst"
    };
    Some(format!("-m set --match-set {name} {side} "))
}
