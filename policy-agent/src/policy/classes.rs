//! Address classes: the equivalence classes of addresses that ipBlocks carve.
//!
//! Every `cidr` and `except` prefix of every valid policy is carved. The
//! class of an address is the longest carved prefix containing it (or
//! WORLD). An ipBlock {C, except E1..En} then matches exactly the classes
//! {P carved : P ⊆ C and no Ei with P ⊆ Ei}:
//! - if a ∈ C and a ∉ every Ei, its class P is at least as long as C and
//!   both contain a, so P ⊆ C; P ⊆ Ei would put a in Ei;
//! - if the class P of a is allowed, a ∈ P ⊆ C; were a ∈ Ei, Ei (carved,
//!   containing a) would be no longer than P, so P ⊆ Ei.
//!
//! `/0` prefixes get a class of their own like any other (with an ipcache
//! entry), rather than WORLD: WORLD is what *any* unclaimed address resolves
//! to, IPv4 or IPv6, so a `0.0.0.0/0` block mapped to WORLD would also admit
//! the IPv6 world.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use ipnet::IpNet;
use policy_common::identity::WORLD;

use super::peer::IpBlock;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Classes {
    ids: BTreeMap<IpNet, u32>,
    by_net: HashMap<IpNet, u32>,
    /// Prefix lengths in use, longest first.
    v4_lens: Vec<u8>,
    v6_lens: Vec<u8>,
}

impl Classes {
    /// Classes for the carved prefixes with their identity numbers.
    pub fn new(ids: BTreeMap<IpNet, u32>) -> Self {
        let by_net = ids.iter().map(|(n, id)| (*n, *id)).collect();
        let lens = |v4: bool| {
            let set: BTreeSet<u8> = ids
                .keys()
                .filter(|n| matches!(n, IpNet::V4(_)) == v4)
                .map(IpNet::prefix_len)
                .collect();
            set.into_iter().rev().collect()
        };
        Self {
            v4_lens: lens(true),
            v6_lens: lens(false),
            by_net,
            ids,
        }
    }

    /// Carved prefix → class identity.
    pub fn prefixes(&self) -> &BTreeMap<IpNet, u32> {
        &self.ids
    }

    /// The class identity of a carved prefix.
    pub fn id_of(&self, net: &IpNet) -> Option<u32> {
        self.by_net.get(net).copied()
    }

    /// The class of an address: its longest carved prefix, or WORLD.
    pub fn class_of(&self, ip: IpAddr) -> u32 {
        let lens = if ip.is_ipv4() {
            &self.v4_lens
        } else {
            &self.v6_lens
        };
        lens.iter()
            .filter_map(|len| IpNet::new(ip, *len).ok())
            .find_map(|net| self.by_net.get(&net.trunc()).copied())
            .unwrap_or(WORLD)
    }

    /// The classes an ipBlock matches (see the module comment).
    pub fn allowed<'a>(&'a self, block: &'a IpBlock) -> impl Iterator<Item = u32> + 'a {
        self.ids
            .iter()
            .filter(move |(p, _)| {
                block.cidr.contains(*p) && !block.except.iter().any(|e| e.contains(*p))
            })
            .map(|(_, id)| *id)
    }
}
