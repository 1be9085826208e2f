//! Rendering the compiled maps as ipsets and chains. One meaning, two
//! renderers: every rule here is a `PolicyKey` the BPF datapath would hold.
//!
//! Per family (iptables and ip6tables), every name under the agent's prefix
//! (`pa-agent:`, see `ruleset.rs`):
//! ```text
//! FORWARD  -> pa-agent:FORWARD
//! pa-agent:FORWARD:  -i <pod if> -> S-<pod>          (every local pod, first)
//!                    -s <pod address> ! -i <pod if> -> DROP  (every local pod)
//!                    revoked (connmark) and REPLY -> DROP
//!                    not revoked, RELATED,ESTABLISHED -> RETURN
//!                    -i <pod if> -> E-<pod>          (egress-isolated pods)
//!                    -o <pod if> -> I-<pod>          (ingress-isolated pods)
//!                    revoked -> clear the connmark bit (judged, allowed)
//! S-<pod>:  from one of the pod's addresses -> RETURN; DROP (a forged
//!           source; link-local and :: sources are never forwarded)
//! I-<pod>:  clear mark; from and to itself on its own interface -> RETURN;
//!           -> P-<policy rule chain>...; mark set -> RETURN; DROP
//! P-<...>:  <peer set> <proto> <ports> -> set mark   (one per policy key)
//! INPUT    -> pa-agent:INPUT
//! pa-agent:INPUT:    <an encapsulation> -> TUNNEL    (if TUNNEL has rules)
//!                    -i <pod if> [-s fe80::/10 | :: -> RETURN] -> S-<pod>
//!                    -s <pod address> ! -i <pod if> -> DROP
//! TUNNEL:   -i <pod if> -d <node address> -> E-<pod> (egress-isolated pods)
//! OUTPUT   -> pa-agent:OUTPUT
//! pa-agent:OUTPUT:   RELATED,ESTABLISHED -> RETURN
//!                    -s <pod address> -> E-<pod>     (egress-isolated pods)
//!                    -o <pod if>, source not local -> I-<pod>
//! ```
//! OUTPUT is for what IPVS forwards (kube-proxy's IPVS mode): a pod's
//! packet to a Service address on `kube-ipvs0` is delivered to the node,
//! and IPVS sends it to the backend through OUTPUT, never FORWARD; there
//! the pod is known by its source address (no input interface), and a
//! packet the node itself sends has a local source and is left alone.
//! The source check comes before the RELATED,ESTABLISHED shortcut, so a
//! packet with another pod's address never rides a flow that address
//! opened, and it covers pods no policy isolates too: a pod that may send
//! anything may still not send as someone else (whose peers' "allow only
//! from C" rules would admit it).
//! A peer identity is a set: a label identity is `hash:ip` of its pods'
//! addresses; an address class (ipBlock) is `hash:net` of its prefix with
//! `nomatch` holes for the longer carved prefixes inside it, so an
//! `except` narrows only the peer whose class excludes it. Node traffic
//! never crosses FORWARD (it is INPUT/OUTPUT), so it is never judged, but
//! for an encapsulation (IP-in-IP, GRE, VXLAN, ...) a pod sends to a node
//! address: decapsulated, its inner packet would travel on with a source
//! the pod chose, so an egress-isolated pod's goes through its egress
//! chain, which judges the node address by its class like any peer's.
//! A local pod's address enters the node at its own interface only: from
//! any other (a tunnel device's decapsulated inner packet, a spoof from
//! the uplink) it is dropped, in FORWARD and in INPUT (where IPVS would
//! take it and send it on through OUTPUT, judged as that pod's).
//!
//! Names carry a 64-bit hash of what they stand for: a set the identity's
//! whole canonical name (`IdentityName::name_hash`; the stored name is cut
//! at 240 bytes, and namespace labels come first), a pod chain the pod, a
//! policy chain the policy, endpoint identity, direction and family. Two
//! things that would share a name are not rendered (fail closed: the rules
//! naming a colliding set or policy chain are left out, colliding pods'
//! traffic is dropped) and each collision is reported.
//!
//! With flow records on ([`render_with`]), each rule that decides a new
//! flow (a policy key's mark, a tier's Accept or Deny, a pod chain's
//! final drop, a forged source) jumps to a record chain that decides the
//! same and logs it to NFLOG (see `records`).
mod ports;
mod records;
mod sets;
mod tiers;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use policy_common::{
    direction, encapsulation,
    endpoint::{
        ENDPOINT_EGRESS_ISOLATED, ENDPOINT_EGRESS_TIERED, ENDPOINT_INGRESS_ISOLATED,
        ENDPOINT_INGRESS_TIERED, ENDPOINT_STAGED,
    },
    identity::{ANY, NODE},
    policy::{ENTRY_TIERS_ONLY, PolicyKey, TierSlot},
    verdict::Reason,
};

use self::records::Records;
pub use self::records::{DEFAULT_BURST, DEFAULT_GROUP, DEFAULT_RATE, FlowLogOptions};

use self::ports::{coalesce, port_match};
use self::sets::{PeerSets, peer_match, set_of};
use self::tiers::{TierKeys, chain_label, tier_keys, tier_rules, to_node_chain, to_node_rules};
use super::ruleset::{
    Chain, ChainKind, FORWARD_CHAIN, Family, INPUT_CHAIN, OUTPUT_CHAIN, Ruleset, TUNNEL_CHAIN,
};
use crate::{
    cluster::{ObjectKind, PodRef, Problem},
    mapstate::{MapState, RuleOrigin, fnv1a64, identity_addresses},
};

/// The packet mark bit the chains use while judging (cleared at the start
/// of every pod chain). Reserve it for the agent on the node.
pub const DEFAULT_MARK: u32 = 0x0080_0000;

/// The width of the hashes in names (tests narrow it to force collisions).
pub const NAME_BITS: u32 = 64;

pub struct RenderInput<'a> {
    pub maps: &'a MapState<PodRef>,
    pub local_pods: &'a BTreeMap<PodRef, Vec<IpAddr>>,
    /// Host-side interface name of each local pod that has one.
    pub interfaces: &'a BTreeMap<PodRef, String>,
    pub rules: &'a BTreeMap<u32, RuleOrigin>,
    pub mark: u32,
    /// How many bits of each name hash are used: [`NAME_BITS`].
    pub name_bits: u32,
}

impl RenderInput<'_> {
    fn narrow(&self, hash: u64) -> u64 {
        if self.name_bits >= 64 {
            hash
        } else {
            hash & ((1u64 << self.name_bits) - 1)
        }
    }
}

/// Groups `items` by the name each gets and returns those that share a
/// name with something else.
fn collisions<T: Ord + Clone, N: Ord>(items: impl IntoIterator<Item = (N, T)>) -> BTreeSet<T> {
    let mut by_name: BTreeMap<N, BTreeSet<T>> = BTreeMap::new();
    for (name, item) in items {
        by_name.entry(name).or_default().insert(item);
    }
    by_name
        .into_values()
        .filter(|items| items.len() > 1)
        .flatten()
        .collect()
}

/// One endpoint's keys in one direction, each with its entry's rule ref,
/// by the policy they came from (its name, or the rule ref when the
/// origin is unknown).
type ByPolicy = BTreeMap<String, (Option<RuleOrigin>, Vec<(PolicyKey, u32)>)>;

/// One local pod to render.
struct PodEntry<'a> {
    pod: &'a PodRef,
    ifname: &'a str,
    identity: u32,
    flags: u32,
    chain_hash: u64,
}

pub fn render(input: &RenderInput<'_>) -> Ruleset {
    render_with(input, None)
}

/// [`render`], with flow records logged to NFLOG when `records` is given
/// (see `records`).
pub fn render_with(input: &RenderInput<'_>, records: Option<&FlowLogOptions>) -> Ruleset {
    let maps = input.maps;
    let addresses = identity_addresses(maps);
    let mark = format!("0x{:x}", input.mark);
    let mut out = Ruleset {
        mark: input.mark,
        ..Ruleset::default()
    };

    let pods: Vec<PodEntry<'_>> = input
        .interfaces
        .iter()
        .filter_map(|(pod, ifname)| {
            let ep = maps.endpoints.get(pod)?;
            Some(PodEntry {
                pod,
                ifname,
                identity: ep.identity,
                flags: ep.flags,
                chain_hash: input.narrow(fnv1a64(pod.to_string().as_bytes())),
            })
        })
        .collect();
    // Pods whose chains would share a name: their traffic is dropped (all
    // of what they send; what they receive where they are isolated).
    let colliding_pods: BTreeSet<&PodRef> = collisions(pods.iter().map(|p| (p.chain_hash, p.pod)));
    for pod in &colliding_pods {
        out.problems.push(Problem::object(
            ObjectKind::Pod,
            (*pod).clone(),
            "iptables: its chain name collides with another pod's (hash collision); its traffic is dropped",
        ));
    }
    // Identities whose sets would share a name, and identities without a
    // name: the rules naming them are left out.
    let peers: BTreeSet<u32> = maps
        .policy
        .keys()
        .map(|k| k.peer_identity)
        .filter(|id| *id != ANY)
        .collect();
    let mut unnamed_peers: BTreeSet<u32> = collisions(
        peers
            .iter()
            .filter_map(|id| set_of(input, *id).map(|n| (n, *id))),
    );
    for id in &unnamed_peers {
        out.problems.push(Problem::node(format!(
            "iptables: the set name of identity {} collides with another identity's (hash collision); the rules allowing it are left out",
            identity_label(maps, *id)
        )));
    }
    for id in peers.iter().filter(|id| set_of(input, **id).is_none()) {
        out.problems.push(Problem::node(format!(
            "iptables: identity {id} has no name to name its set by; the rules allowing it are left out"
        )));
        unnamed_peers.insert(*id);
    }

    // The node's own addresses (the ipcache's NODE host entries).
    let node_addrs: Vec<IpAddr> = maps
        .ipcache
        .iter()
        .filter(|(net, e)| e.identity == NODE && net.prefix_len() == net.max_prefix_len())
        .map(|(net, _)| net.addr())
        .collect();

    for fam in Family::BOTH {
        let mut forward = Chain {
            name: FORWARD_CHAIN.into(),
            rules: Vec::new(),
        };
        let mut chains: BTreeMap<String, Chain> = BTreeMap::new();
        let fam_ips = |pod: &PodRef| -> Vec<IpAddr> {
            input
                .local_pods
                .get(pod)
                .into_iter()
                .flatten()
                .copied()
                .filter(|ip| (fam == Family::V4) == ip.is_ipv4())
                .collect()
        };
        // What pods send to the node's own addresses: the source check
        // (node traffic is always allowed; encapsulations aside, see
        // TUNNEL below). With kube-proxy's IPVS mode a ClusterIP is one of
        // them, and what IPVS forwards is judged in OUTPUT by its source
        // address: a forged one would borrow another pod's egress.
        // Link-local and unspecified IPv6 sources (neighbour discovery,
        // MLD, to the node) pass: no pod is known by them.
        let mut input_chain = Chain {
            name: INPUT_CHAIN.into(),
            rules: Vec::new(),
        };
        let mut records = records.map(|o| Records::new(*o, &mark, input.name_bits, fam));
        // Source validation, for every local pod, before anything accepts.
        for p in &pods {
            if colliding_pods.contains(p.pod) {
                forward.rules.push(format!("-i {} -j DROP", p.ifname));
                input_chain.rules.push(format!("-i {} -j DROP", p.ifname));
                continue;
            }
            let name = ChainKind::Source.name(p.chain_hash);
            forward.rules.push(format!("-i {} -j {name}", p.ifname));
            if fam == Family::V6 {
                for unbound in ["fe80::/10", "::/128"] {
                    input_chain
                        .rules
                        .push(format!("-i {} -s {unbound} -j RETURN", p.ifname));
                }
            }
            input_chain.rules.push(format!("-i {} -j {name}", p.ifname));
            let mut rules = source_rules(&fam_ips(p.pod));
            if let Some(record) = records.as_mut().and_then(|r| {
                r.drop(
                    &mut chains,
                    Reason::DropSpoofed,
                    direction::EGRESS,
                    p.identity,
                )
            }) && let Some(last) = rules.last_mut()
            {
                *last = format!("-m comment --comment \"pa-agent: forged source\" -j {record}");
            }
            chains.insert(name.clone(), Chain { name, rules });
        }
        // A local pod's address enters the node at its own interface only
        // (whose source check is above): from anywhere else, a tunnel
        // device's decapsulated inner packet or a spoof from the uplink, it
        // is dropped, isolated pod or not, before the shortcut. In INPUT
        // too: with kube-proxy's IPVS mode such a packet to a Service
        // address would leave through OUTPUT, which has no input interface
        // to tell, and be judged there as the pod's.
        for p in &pods {
            for ip in fam_ips(p.pod) {
                let rule = format!(
                    "-s {ip} ! -i {} -m comment --comment \"pa-agent: local address from elsewhere\" -j DROP",
                    p.ifname
                );
                forward.rules.push(rule.clone());
                input_chain.rules.push(rule);
            }
        }
        // A flow whose verdict a change may have moved is revoked (its
        // connmark bit set, `apply`), not deleted: deleted, the kernel
        // would pick it up again in the name of whichever side sent first.
        // Revoked, its reply-direction packets wait and its
        // original-direction ones are judged again (below); the rest ride
        // the shortcut. The same in FORWARD and in OUTPUT.
        let shortcut = format!(
            "-m connmark ! --mark {mark}/{mark} -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN"
        );
        forward.rules.push(format!(
            "-m connmark --mark {mark}/{mark} -m conntrack --ctdir REPLY -j DROP"
        ));
        forward.rules.push(shortcut.clone());
        // The new flows of a pod only a staged policy would judge, in the
        // directions no enforced one does: recorded, nothing decided.
        for p in pods.iter().filter(|p| p.flags & ENDPOINT_STAGED != 0) {
            if colliding_pods.contains(p.pod) {
                continue;
            }
            for (dir, judged, iface) in [
                (
                    direction::EGRESS,
                    ENDPOINT_EGRESS_ISOLATED | ENDPOINT_EGRESS_TIERED,
                    "-i",
                ),
                (
                    direction::INGRESS,
                    ENDPOINT_INGRESS_ISOLATED | ENDPOINT_INGRESS_TIERED,
                    "-o",
                ),
            ] {
                if p.flags & judged != 0 {
                    continue;
                }
                if let Some(record) = records
                    .as_mut()
                    .and_then(|r| r.observe(&mut chains, dir, p.identity))
                {
                    forward.rules.push(format!(
                        "{iface} {} -m conntrack --ctstate NEW -j {record}",
                        p.ifname
                    ));
                }
            }
        }
        // In OUTPUT the node's own packets are never held: a pod's flow to
        // the node (INPUT, never judged here) is answered through OUTPUT,
        // and node traffic is always allowed.
        let mut output = Chain {
            name: OUTPUT_CHAIN.into(),
            rules: vec![
                format!(
                    "-m addrtype ! --src-type LOCAL -m connmark --mark {mark}/{mark} -m conntrack --ctdir REPLY -j DROP"
                ),
                shortcut,
            ],
        };
        // What IPVS forwards: the pod by its source address, a backend by
        // its interface when the source is not the node's own.
        let output_match = |dir: u8, ifname: &str, ips: &[IpAddr]| -> Vec<String> {
            if dir == direction::INGRESS {
                vec![format!("-o {ifname} -m addrtype ! --src-type LOCAL")]
            } else {
                ips.iter().map(|ip| format!("-s {ip}")).collect()
            }
        };
        // The policy chains each (pod, direction) would jump to, by policy.
        let mut wanted: Vec<(&PodEntry<'_>, u8, ByPolicy, Option<[TierKeys; 2]>)> = Vec::new();
        for p in &pods {
            for (dir, flag, tiered) in [
                (
                    direction::EGRESS,
                    ENDPOINT_EGRESS_ISOLATED,
                    ENDPOINT_EGRESS_TIERED,
                ),
                (
                    direction::INGRESS,
                    ENDPOINT_INGRESS_ISOLATED,
                    ENDPOINT_INGRESS_TIERED,
                ),
            ] {
                if p.flags & (flag | tiered) == 0 {
                    continue;
                }
                let tiers = (p.flags & tiered != 0).then(|| tier_keys(maps, p.identity, dir));
                let mut by_policy = ByPolicy::new();
                // Group this identity's keys by the policy they came from
                // (NetworkPolicy allows only; tier slots are the tier
                // chains').
                for (key, entry) in maps
                    .policy_of(p.identity)
                    .filter(|(k, e)| k.direction == dir && e.flags & ENTRY_TIERS_ONLY == 0)
                {
                    let origin = input.rules.get(&entry.rule_ref);
                    let policy = origin
                        .map(|o| o.policy.to_string())
                        .unwrap_or_else(|| format!("rule {:08x}", entry.rule_ref));
                    let slot = by_policy
                        .entry(policy)
                        .or_insert_with(|| (origin.cloned(), Vec::new()));
                    slot.1.push((*key, entry.rule_ref));
                }
                wanted.push((p, dir, by_policy, tiers));
            }
        }
        // A policy chain is named by what it holds: the policy, the
        // endpoint identity (by its name, stable across processes), the
        // direction and the family.
        let policy_chain_hash = |policy: &str, identity: u32, dir: u8| -> u64 {
            let who = maps
                .identities
                .get(&identity)
                .map(|n| format!("{:016x}", n.name_hash))
                .unwrap_or_else(|| identity.to_string());
            input.narrow(fnv1a64(
                format!("{policy}/{who}/{}/{fam:?}", direction::name(dir)).as_bytes(),
            ))
        };
        let colliding_chains: BTreeSet<(String, u32, u8)> =
            collisions(wanted.iter().flat_map(|(p, dir, by_policy, tiers)| {
                let tier_chains = tiers.iter().flat_map(|t| {
                    (0..2)
                        .filter(|i| !t[*i].is_empty())
                        .map(|i| chain_label(i).to_owned())
                });
                by_policy
                    .keys()
                    .cloned()
                    .chain(tier_chains)
                    .map(move |policy| {
                        (
                            policy_chain_hash(&policy, p.identity, *dir),
                            (policy, p.identity, *dir),
                        )
                    })
            }));
        for (policy, _, dir) in &colliding_chains {
            let origin = wanted
                .iter()
                .flat_map(|(_, _, b, _)| b.get(policy))
                .find_map(|(o, _)| o.clone());
            let reason = format!(
                "iptables: its {} rule chain name collides with another's (hash collision); those rules are left out",
                direction::name(*dir)
            );
            out.problems.push(match origin {
                Some(o) => Problem::object(ObjectKind::NetworkPolicy, o.policy, reason),
                None => Problem::node(format!("{policy}: {reason}")),
            });
        }

        // An egress-isolated pod's encapsulations to the node's addresses,
        // to its egress chain.
        let mut tunnel = Vec::new();
        // What tier-judged pods send the node itself (INPUT), see
        // `to_node_chain`.
        let mut to_node = Vec::new();
        for (p, dir, by_policy, tiers) in &wanted {
            let (kind, iface) = if *dir == direction::INGRESS {
                (ChainKind::Ingress, "-o")
            } else {
                (ChainKind::Egress, "-i")
            };
            let ips = fam_ips(p.pod);
            let outs = output_match(*dir, p.ifname, &ips);
            if colliding_pods.contains(p.pod) {
                forward.rules.push(format!("{iface} {} -j DROP", p.ifname));
                output
                    .rules
                    .extend(outs.iter().map(|m| format!("{m} -j DROP")));
                continue;
            }
            let pod_chain = kind.name(p.chain_hash);
            if *dir == direction::EGRESS {
                tunnel.extend(
                    node_addrs
                        .iter()
                        .filter(|a| (fam == Family::V4) == a.is_ipv4())
                        .map(|a| format!("-i {} -d {a} -j {pod_chain}", p.ifname)),
                );
            }
            forward
                .rules
                .push(format!("{iface} {} -j {pod_chain}", p.ifname));
            output
                .rules
                .extend(outs.iter().map(|m| format!("{m} -j {pod_chain}")));
            let mut rules = vec![format!("-j MARK --set-xmark 0x0/{mark}")];
            // A pod talking to itself through the node (a Service hairpin)
            // enters and leaves by its own interface; the same addresses
            // arriving from anywhere else are forged. Allowed, but where
            // tiers judge it: then after the Admin tier (see `tiers`).
            let hairpin: Vec<String> = ips
                .iter()
                .map(|ip| {
                    format!(
                        "-i {if_} -o {if_} -s {ip} -d {ip} -j RETURN",
                        if_ = p.ifname
                    )
                })
                .collect();
            if tiers.is_none() {
                rules.extend(hairpin.iter().cloned());
            }
            let isolated = p.flags
                & if *dir == direction::INGRESS {
                    ENDPOINT_INGRESS_ISOLATED
                } else {
                    ENDPOINT_EGRESS_ISOLATED
                }
                != 0;
            // The tier chains this pod's chain jumps to: Admin first, then
            // (not isolated by a NetworkPolicy) Baseline after the policies.
            let mut tier_jumps: [Option<String>; 2] = [None, None];
            let mut tier_failed = false;
            for (i, keys) in tiers.iter().flat_map(|t| t.iter().enumerate()) {
                if keys.is_empty() {
                    continue;
                }
                let label = chain_label(i);
                if colliding_chains.contains(&(label.to_owned(), p.identity, *dir)) {
                    tier_failed = true;
                    continue;
                }
                let chain_name = ChainKind::Policy.name(policy_chain_hash(label, p.identity, *dir));
                tier_jumps[i] = Some(chain_name.clone());
                out.chain_refs
                    .entry(pod_chain.clone())
                    .or_default()
                    .insert(chain_name.clone());
                if chains.contains_key(&chain_name) {
                    continue;
                }
                let mut used_sets = BTreeSet::new();
                let identity = p.identity;
                let mut record = |slot: TierSlot| {
                    records
                        .as_mut()
                        .and_then(|r| r.tier(&mut chains, i, slot, *dir, identity))
                };
                let tier_chain_rules = tier_rules(
                    &coalesce(keys),
                    |span| {
                        let peer = peer_match(
                            &mut PeerSets {
                                input,
                                addresses: &addresses,
                                unnamed: &unnamed_peers,
                                fam,
                                sets: &mut out.sets,
                                used: &mut used_sets,
                            },
                            &span.key,
                            *dir,
                        )?;
                        Some(format!("{peer}{}", port_match(span)))
                    },
                    port_match,
                    &mut record,
                    &mark,
                    *dir,
                );
                out.chain_sets.insert(chain_name.clone(), used_sets);
                chains.insert(
                    chain_name.clone(),
                    Chain {
                        name: chain_name,
                        rules: tier_chain_rules,
                    },
                );
            }
            if tier_failed {
                // A tier chain that cannot be named: nothing new passes.
                rules.push("-j DROP".into());
            }
            if *dir == direction::EGRESS && tiers.is_some() {
                let chain = to_node_chain(p, &tier_jumps, tier_failed, isolated, &mark);
                to_node.extend(to_node_rules(
                    p.ifname,
                    &chain.name,
                    &mark,
                    fam == Family::V6,
                ));
                chains.insert(chain.name.clone(), chain);
            }
            if let Some(admin) = &tier_jumps[0] {
                rules.push(format!(
                    "-m comment --comment \"{}\" -j {admin}",
                    chain_label(0)
                ));
                rules.push(format!("-m mark --mark {mark}/{mark} -j RETURN"));
            }
            let baseline_decides = tiers.is_some() && !isolated;
            if tiers.is_some() && isolated {
                // The NetworkPolicy tier allows a pod's traffic to itself.
                rules.extend(hairpin);
            }
            for (policy, (_, keys)) in by_policy {
                if baseline_decides {
                    break;
                }
                if colliding_chains.contains(&(policy.clone(), p.identity, *dir)) {
                    continue;
                }
                let chain_name =
                    ChainKind::Policy.name(policy_chain_hash(policy, p.identity, *dir));
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
                // Which rule of the policy allows is a record's name only:
                // keys of one rule together, merged into port ranges.
                let mut keys = keys.clone();
                keys.sort_by_key(|&(key, rule_ref)| (rule_ref, key));
                for (span, rule_ref) in coalesce(&keys) {
                    let Some(peer) = peer_match(
                        &mut PeerSets {
                            input,
                            addresses: &addresses,
                            unnamed: &unnamed_peers,
                            fam,
                            sets: &mut out.sets,
                            used: &mut used_sets,
                        },
                        &span.key,
                        *dir,
                    ) else {
                        continue;
                    };
                    let target = records
                        .as_mut()
                        .and_then(|r| r.allow_policy(&mut chains, *dir, p.identity, rule_ref))
                        .unwrap_or_else(|| format!("MARK --set-xmark {mark}/{mark}"));
                    policy_rules.push(format!("{peer}{}-j {target}", port_match(&span)));
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
            if baseline_decides {
                // Not isolated by a NetworkPolicy: the Baseline tier, then
                // the default (allowed).
                if let Some(baseline) = &tier_jumps[1] {
                    rules.push(format!(
                        "-m comment --comment \"{}\" -j {baseline}",
                        chain_label(1)
                    ));
                }
                rules.push("-j RETURN".into());
            } else {
                rules.push(format!("-m mark --mark {mark}/{mark} -j RETURN"));
                let record = records
                    .as_mut()
                    .and_then(|r| r.drop(&mut chains, Reason::DropPolicy, *dir, p.identity));
                rules.push(format!("-j {}", record.as_deref().unwrap_or("DROP")));
            }
            out.pod_chains
                .entry(pod_chain.clone())
                .or_insert_with(|| (p.pod.clone(), *dir, Vec::new()))
                .2
                .extend(ips.iter().copied());
            chains.insert(
                pod_chain.clone(),
                Chain {
                    name: pod_chain,
                    rules,
                },
            );
        }
        // First in INPUT: the egress verdict does not depend on the
        // source, which is checked after it, and a link-local source (let
        // through below for neighbour discovery) must not carry an
        // encapsulation past it. The colliding pods' packets are dropped
        // there whatever they are.
        input_chain.rules.extend(to_node);
        if !tunnel.is_empty() {
            input_chain.rules.splice(
                0..0,
                encapsulation_matches().map(|m| format!("{m} -j {TUNNEL_CHAIN}")),
            );
            chains.insert(
                TUNNEL_CHAIN.into(),
                Chain {
                    name: TUNNEL_CHAIN.into(),
                    rules: tunnel,
                },
            );
        }
        // Judged and allowed: a revoked flow resumes (its replies pass).
        let resume = format!("-m connmark --mark {mark}/{mark} -j CONNMARK --set-xmark 0x0/{mark}");
        forward.rules.push(resume.clone());
        output.rules.push(resume);
        if let Some(r) = records {
            for chain in r.limited_chains() {
                chains.insert(chain.name.clone(), chain);
            }
            out.problems.extend(r.problems);
        }
        let mut list = vec![forward, input_chain, output];
        list.extend(chains.into_values());
        out.chains.insert(fam, list);
    }
    out.problems.sort();
    out.problems.dedup();
    out
}

/// The source check of one pod in `fam`: its own addresses pass (back to
/// the FORWARD chain), anything else is a forged source and dropped
/// (counted by the rule, which names the reason). IPv6 neighbour discovery
/// and MLD from fe80::/10 or :: need no exception here: the kernel never
/// forwards a link-local or unspecified source (`ip6_forward` drops it
/// before the FORWARD hook), and ND goes to the node, not through it.
fn source_rules(ips: &[IpAddr]) -> Vec<String> {
    let mut rules: Vec<String> = ips.iter().map(|ip| format!("-s {ip} -j RETURN")).collect();
    rules.push("-m comment --comment \"pa-agent: forged source\" -j DROP".into());
    rules
}

/// The encapsulations a node may decapsulate
/// (`policy_common::encapsulation::is`), as iptables matches.
fn encapsulation_matches() -> impl Iterator<Item = String> {
    let protocols = encapsulation::PROTOCOLS
        .into_iter()
        .map(|p| format!("-p {p}"));
    let ports = encapsulation::UDP_PORTS
        .into_iter()
        .map(|port| format!("-p udp --dport {port}"));
    protocols.chain(ports)
}

/// An identity as a reader knows it: its (possibly cut) canonical name.
fn identity_label(maps: &MapState<PodRef>, id: u32) -> String {
    maps.identities
        .get(&id)
        .map(|n| crate::mapstate::identity_name_str(n))
        .map(|n| format!("{id} ({n})"))
        .unwrap_or_else(|| id.to_string())
}
