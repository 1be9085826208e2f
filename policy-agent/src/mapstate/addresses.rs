//! Which addresses each identity stands for, for renderers that match
//! addresses (the iptables fallback's ipsets) rather than identities.
use std::collections::BTreeMap;

use ipnet::IpNet;
use policy_common::identity::{NODE, WORLD, is_cidr, kind};
use serde::Serialize;

use super::{MapState, identity_name_str};

/// The addresses of one identity: every address inside some `include`
/// prefix and inside no `exclude` prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AddressSet {
    pub include: Vec<IpNet>,
    pub exclude: Vec<IpNet>,
}

/// For each identity a policy key may name as peer: label identities and
/// the node (their host prefixes), address classes (the carved prefix
/// minus the longer carved prefixes inside it, which are other classes)
/// and WORLD (everything outside every carved prefix).
///
/// Together with the ANY wildcard this is exactly how the datapath
/// resolves a peer: an address matches a key for X iff it is in X's set.
pub fn identity_addresses<K: Ord>(maps: &MapState<K>) -> BTreeMap<u32, AddressSet> {
    let mut out: BTreeMap<u32, AddressSet> = BTreeMap::new();
    for (net, entry) in &maps.ipcache {
        if entry.identity != 0 && net.prefix_len() == net.max_prefix_len() {
            out.entry(entry.identity).or_default().include.push(*net);
        }
    }
    let carved: BTreeMap<u32, IpNet> = maps
        .identities
        .iter()
        .filter(|(id, n)| is_cidr(**id) && n.kind == kind::CIDR)
        .filter_map(|(id, n)| {
            identity_name_str(n)
                .parse::<IpNet>()
                .ok()
                .map(|net| (*id, net))
        })
        .collect();
    let inside = |outer: &IpNet, inner: &IpNet| outer != inner && outer.contains(inner);
    // Only the outermost carved prefixes inside another need excluding.
    let maximal_inside = |outer: Option<&IpNet>| -> Vec<IpNet> {
        let within: Vec<IpNet> = carved
            .values()
            .filter(|n| outer.is_none_or(|o| inside(o, n)))
            .copied()
            .collect();
        let mut keep: Vec<IpNet> = within
            .iter()
            .filter(|n| !within.iter().any(|m| inside(m, n)))
            .copied()
            .collect();
        keep.sort();
        keep.dedup();
        keep
    };
    for (id, net) in &carved {
        out.insert(
            *id,
            AddressSet {
                include: vec![*net],
                exclude: maximal_inside(Some(net)),
            },
        );
    }
    let world: Vec<IpNet> = ["0.0.0.0/0", "::/0"]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    out.insert(
        WORLD,
        AddressSet {
            include: world,
            exclude: maximal_inside(None),
        },
    );
    out.entry(NODE).or_default();
    out
}
