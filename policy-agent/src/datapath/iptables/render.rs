//! Rendering the compiled maps as ipsets and chains. One meaning, two
//! renderers: every rule here is a `PolicyKey` the BPF datapath would hold.
//!
//! Per family (iptables and ip6tables):
//! ```text
//! FORWARD  -> PA-FORWARD
//! PA-FORWARD:  RELATED,ESTABLISHED -> RETURN   (replies and tracked flows)
//!              -i <pod if> -> PA-E-<pod>       (egress-isolated pods)
//!              -o <pod if> -> PA-I-<pod>       (ingress-isolated pods)
//! PA-I-<pod>:  clear mark; to itself -> RETURN; -> PA-P-<policy rule chain>...;
//!              mark set -> RETURN; DROP
//! PA-P-<...>:  <peer set> <proto> <ports> -> set mark   (one per policy key)
//! ```
//! A peer identity is a set: a label identity is `hash:ip` of its pods'
//! addresses; an address class (ipBlock) is `hash:net` of its prefix with
//! `nomatch` holes for the longer carved prefixes inside it, so an
//! `except` narrows only the peer whose class excludes it. Node traffic
//! never crosses FORWARD (it is INPUT/OUTPUT), so it is never judged.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    identity::{ANY, WORLD, is_cidr},
    policy::PolicyKey,
    proto,
};

use super::ruleset::{Chain, FORWARD_CHAIN, Family, IpSet, Ruleset, SetKind};
use crate::{
    cluster::PodRef,
    mapstate::{AddressSet, MapState, RuleOrigin, fnv1a64, identity_addresses, identity_name_str},
};

/// The packet mark bit the chains use while judging (cleared at the start
/// of every pod chain). Reserve it for the agent on the node.
pub const DEFAULT_MARK: u32 = 0x0080_0000;

pub struct RenderInput<'a> {
    pub maps: &'a MapState<PodRef>,
    pub local_pods: &'a BTreeMap<PodRef, Vec<IpAddr>>,
    /// Host-side interface name of each local pod that has one.
    pub interfaces: &'a BTreeMap<PodRef, String>,
    pub rules: &'a BTreeMap<u32, RuleOrigin>,
    pub mark: u32,
}

fn hash8(s: &str) -> String {
    let h = fnv1a64(s.as_bytes());
    format!("{:08x}", (h ^ (h >> 32)) as u32)
}

fn set_name(maps: &MapState<PodRef>, id: u32, fam: Family) -> String {
    // Named by what the identity stands for, not its number: a fresh
    // `apply` process allocates numbers anew, the names stay put.
    let kind = if id == WORLD {
        "W"
    } else if is_cidr(id) {
        "C"
    } else {
        "I"
    };
    let canonical = if id == WORLD {
        "world".to_owned()
    } else {
        maps.identities
            .get(&id)
            .map(identity_name_str)
            .unwrap_or_else(|| id.to_string())
    };
    format!("PA{kind}-{}-v{}", hash8(&canonical), fam.suffix())
}

/// Splits a /0 (which hash:net cannot hold) into two halves.
fn storable(net: &IpNet) -> Vec<IpNet> {
    if net.prefix_len() != 0 {
        return vec![*net];
    }
    net.subnets(1).map(|s| s.collect()).unwrap_or_default()
}

/// The set of an identity's addresses in `fam` (empty without addresses).
fn build_set(name: String, id: u32, fam: Family, addrs: Option<&AddressSet>) -> IpSet {
    let kind = if id == WORLD || is_cidr(id) {
        SetKind::HashNet
    } else {
        SetKind::HashIp
    };
    let mut entries = BTreeSet::new();
    if let Some(addrs) = addrs {
        for net in addrs.include.iter().filter(|n| Family::of(n) == fam) {
            for part in storable(net) {
                entries.insert((part, false));
            }
        }
        if kind == SetKind::HashNet {
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

fn port_match(key: &PolicyKey) -> String {
    let p = match key.protocol {
        proto::TCP => "tcp",
        proto::UDP => "udp",
        proto::SCTP => "sctp",
        _ => return String::new(),
    };
    match key.port_prefix_len {
        0 => format!("-p {p} "),
        16 => format!("-p {p} --dport {} ", key.port),
        len => format!(
            "-p {p} --dport {}:{} ",
            key.port,
            key.port | (0xffff >> len)
        ),
    }
}

pub fn render(input: &RenderInput<'_>) -> Ruleset {
    let maps = input.maps;
    let addresses = identity_addresses(maps);
    let mark = format!("0x{:x}", input.mark);
    let mut out = Ruleset::default();

    for fam in Family::BOTH {
        let mut forward = Chain {
            name: FORWARD_CHAIN.into(),
            rules: vec!["-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN".into()],
        };
        let mut chains: BTreeMap<String, Chain> = BTreeMap::new();
        for (pod, ifname) in input.interfaces {
            let Some(ep) = maps.endpoints.get(pod) else {
                continue;
            };
            let ips: Vec<IpAddr> = input
                .local_pods
                .get(pod)
                .into_iter()
                .flatten()
                .copied()
                .filter(|ip| (fam == Family::V4) == ip.is_ipv4())
                .collect();
            for (dir, flag, tag, iface) in [
                (direction::EGRESS, ENDPOINT_EGRESS_ISOLATED, "E", "-i"),
                (direction::INGRESS, ENDPOINT_INGRESS_ISOLATED, "I", "-o"),
            ] {
                if ep.flags & flag == 0 {
                    continue;
                }
                let pod_chain = format!("PA-{tag}-{}", hash8(&pod.to_string()));
                forward
                    .rules
                    .push(format!("{iface} {ifname} -j {pod_chain}"));
                let mut rules = vec![format!("-j MARK --set-xmark 0x0/{mark}")];
                for ip in &ips {
                    rules.push(format!("-s {ip} -d {ip} -j RETURN"));
                }
                // Group this identity's keys by the policy they came from.
                let mut by_policy: BTreeMap<String, Vec<PolicyKey>> = BTreeMap::new();
                for (key, entry) in maps
                    .policy_of(ep.identity)
                    .filter(|(k, _)| k.direction == dir)
                {
                    let policy = input
                        .rules
                        .get(&entry.rule_ref)
                        .map(|o| o.policy.to_string())
                        .unwrap_or_else(|| format!("rule {:08x}", entry.rule_ref));
                    by_policy.entry(policy).or_default().push(*key);
                }
                for (policy, keys) in &by_policy {
                    let chain_name = format!(
                        "PA-P-{}",
                        hash8(&format!("{policy}/{}/{tag}/{fam:?}", ep.identity))
                    );
                    rules.push(format!("-m comment --comment \"{policy}\" -j {chain_name}"));
                    out.chain_refs
                        .entry(pod_chain.clone())
                        .or_default()
                        .insert(chain_name.clone());
                    if chains.contains_key(&chain_name) {
                        continue;
                    }
                    let mut policy_rules = Vec::new();
                    let mut used_sets = BTreeSet::new();
                    for key in keys {
                        let peer = if key.peer_identity == ANY {
                            String::new()
                        } else {
                            let name = set_name(maps, key.peer_identity, fam);
                            out.sets.entry(name.clone()).or_insert_with(|| {
                                let addrs = addresses.get(&key.peer_identity);
                                build_set(name.clone(), key.peer_identity, fam, addrs)
                            });
                            used_sets.insert(name.clone());
                            let side = if dir == direction::INGRESS {
                                "src"
                            } else {
                                "dst"
                            };
                            format!("-m set --match-set {name} {side} ")
                        };
                        policy_rules.push(format!(
                            "{peer}{}-j MARK --set-xmark {mark}/{mark}",
                            port_match(key)
                        ));
                    }
                    out.chain_sets.insert(chain_name.clone(), used_sets);
                    chains.insert(
                        chain_name.clone(),
                        Chain {
                            name: chain_name,
                            rules: policy_rules,
                        },
                    );
                }
                rules.push(format!("-m mark --mark {mark}/{mark} -j RETURN"));
                rules.push("-j DROP".into());
                out.pod_chains
                    .entry(pod_chain.clone())
                    .or_insert_with(|| (pod.to_string(), Vec::new()))
                    .1
                    .extend(ips.iter().copied());
                chains.insert(
                    pod_chain.clone(),
                    Chain {
                        name: pod_chain,
                        rules,
                    },
                );
            }
        }
        let mut list = vec![forward];
        list.extend(chains.into_values());
        out.chains.insert(fam, list);
    }
    out
}
