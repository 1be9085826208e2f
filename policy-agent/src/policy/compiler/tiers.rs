//! The tier layer: ClusterNetworkPolicy rules resolved into policy-map keys
//! with their tier slots (see `policy_common::policy::TierSlot`).
//!
//! Each rule gets a rank in its tier (see [`rank`]): policies by priority
//! ("Policies with lower priority values have higher precedence"), equal
//! priorities by name, then the rule's place ("a rule that appears at the
//! top of the ingress rules would take the highest precedence"). Its slot goes into
//! every key it matches for every local endpoint identity its subject
//! selects; a key several rules match keeps the best slot of each tier.
//! The classifier folds the slots of every key a packet matches, so the
//! rule that decides is the best of all the rules matching the packet.
//!
//! Recomputed whole whenever a ClusterNetworkPolicy exists and anything
//! changes, and written as a difference: only changed keys are written.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use policy_common::{
    direction,
    identity::ANY,
    policy::{PolicyKey, TierSlot},
    proto,
    rule_name::{RuleKey, RuleName, kind as rule_kind},
};

use super::Compiler;
use crate::{
    identity::LabelKey,
    mapstate::rule_name,
    policy::{
        cluster_policy::{
            Action, ClusterPeer, ClusterRule, ParsedClusterPolicy, ProtocolMatch, RuleMatch, Tier,
        },
        ports::{ANY_PORT, PortKey, range_blocks},
    },
};

/// Keys with their (Admin, Baseline) slots; sorted once complete.
type Layer = Vec<(PolicyKey, (TierSlot, TierSlot))>;

/// The `RULE_NAMES` kind of a tier's slots.
fn tier_kind(tier: Tier) -> u8 {
    match tier {
        Tier::Admin => rule_kind::ADMIN,
        Tier::Baseline => rule_kind::BASELINE,
    }
}

/// A rule's rank in its tier (see [`TierSlot::rule_rank`]).
fn rank(priority: u32, place: u32, rule_index: usize) -> u32 {
    TierSlot::rule_rank(priority, place, u32::try_from(rule_index).unwrap_or(31))
}

impl Compiler {
    /// Brings the tier layer up to date; endpoints whose tier keys changed
    /// get their flags recomputed.
    pub(super) fn sync_tiers(&mut self) {
        let mut overflow = BTreeMap::new();
        let mut names = BTreeMap::new();
        let want = self.tier_layer(&mut overflow, &mut names);
        self.tier_overflow = overflow;
        self.set_tier_rule_names(names);
        // Both sorted by key: one merge finds what went and what changed
        // (hundreds of thousands of keys at scale: no lookup per key).
        let mut gone = Vec::new();
        let mut set = Vec::new();
        let mut have = self.out.tiers().iter().peekable();
        for (key, slots) in want {
            while let Some((k, _)) = have.next_if(|(k, _)| **k < key) {
                gone.push(*k);
            }
            match have.next_if(|(k, _)| **k == key) {
                Some((_, had)) if *had == slots => {}
                _ => set.push((key, slots)),
            }
        }
        gone.extend(have.map(|(k, _)| *k));
        for key in gone {
            self.flags_dirty.insert(key.endpoint_identity);
            self.out.set_tiers(key, None);
        }
        for (key, slots) in set {
            self.flags_dirty.insert(key.endpoint_identity);
            self.out.set_tiers(key, Some(slots));
        }
    }

    /// Whether endpoint identity `e` has tier keys in `dir`.
    pub(super) fn tiered(&self, e: u32, dir: u8) -> bool {
        let start = PolicyKey {
            endpoint_identity: e,
            ..PolicyKey::default()
        };
        self.out
            .tiers()
            .range(start..)
            .take_while(|(k, _)| k.endpoint_identity == e)
            .any(|(k, _)| k.direction == dir)
    }

    /// Every key a rule matches with its best slot of each tier, sorted.
    /// Policies past the per-policy budget fail closed (see
    /// [`Self::tier_overflow`]): `overflow` gets each one's entry count.
    /// `names` gets the name of every rule by the key its slots are
    /// named by (tier, direction, rank).
    fn tier_layer(
        &self,
        overflow: &mut BTreeMap<String, u64>,
        names: &mut BTreeMap<RuleKey, RuleName>,
    ) -> Layer {
        let mut out = Layer::new();
        // Same-priority policies by name: their place among those.
        let mut place: BTreeMap<(Tier, u32), u32> = BTreeMap::new();
        for p in self.cluster_policies.values() {
            let at = place.entry((p.tier, p.priority)).or_default();
            let start = out.len();
            for dir in [direction::INGRESS, direction::EGRESS] {
                for rule in p.rules(dir) {
                    let rank = rank(p.priority, *at, rule.index);
                    let name = rule_name(dir, rule.index, p.priority, "", &p.name, &rule.name);
                    // Ranks clamped alike (see `TierSlot::rule_rank`): the
                    // smallest name, as the incremental path keeps it.
                    names
                        .entry(RuleKey::new(tier_kind(p.tier), dir, rank))
                        .and_modify(|n| *n = (*n).min(name))
                        .or_insert(name);
                    let slot = TierSlot::new(rank, rule.action.code());
                    self.add_rule(&mut out, p, dir, rule, p.tier, slot);
                }
            }
            // Past the budget: its Accepts match nothing, its Denies and
            // Passes deny everything (one entry per subject and rule).
            let entries = (out.len() - start) as u64;
            if entries > self.options.budget.per_policy {
                out.truncate(start);
                overflow.insert(p.name.clone(), entries);
                for dir in [direction::INGRESS, direction::EGRESS] {
                    for rule in p.rules(dir).iter().filter(|r| r.action != Action::Accept) {
                        let closed = ClusterRule {
                            action: Action::Deny,
                            matches: RuleMatch::Everything,
                            ..rule.clone()
                        };
                        let slot =
                            TierSlot::new(rank(p.priority, *at, rule.index), Action::Deny.code());
                        self.add_rule(&mut out, p, dir, &closed, p.tier, slot);
                    }
                }
            }
            *at += 1;
        }
        // Sorted, each key once with the best slot of each tier.
        out.sort_unstable_by_key(|(k, _)| *k);
        out.dedup_by(|later, kept| {
            if later.0 != kept.0 {
                return false;
            }
            kept.1 = (kept.1.0.best(later.1.0), kept.1.1.best(later.1.1));
            true
        });
        out
    }

    fn add_rule(
        &self,
        out: &mut Layer,
        p: &ParsedClusterPolicy,
        dir: u8,
        rule: &ClusterRule,
        tier: Tier,
        slot: TierSlot,
    ) {
        // The peers do not depend on the subject: found once per rule.
        let peers = self.rule_peers(rule);
        for e in &self.index.endpoint_ids {
            let Some(ident) = self.index.idents.get(e) else {
                continue;
            };
            // "Note that host-networked pods are not included in subject
            // selection": they have no identity here.
            if !p
                .subject
                .selects(&ident.key.namespace_labels, &ident.key.labels)
            {
                continue;
            }
            for (peer, (protocol, len, port)) in self.rule_keys(&peers, dir, &ident.key) {
                let key = PolicyKey::new(*e, dir, peer, protocol, len, port);
                out.push(match tier {
                    Tier::Admin => (key, (slot, TierSlot::default())),
                    Tier::Baseline => (key, (TierSlot::default(), slot)),
                });
            }
        }
    }

    /// The peer identities of `rule`: label identities and address
    /// classes (an `Everything` rule: ANY; a `Nothing` rule: none).
    fn rule_peers<'r>(&self, rule: &'r ClusterRule) -> RulePeers<'r> {
        let (peers, protocols) = match &rule.matches {
            RuleMatch::Nothing => return RulePeers::default(),
            RuleMatch::Everything => {
                return RulePeers {
                    everything: true,
                    ..RulePeers::default()
                };
            }
            RuleMatch::Peers { peers, protocols } => (peers, protocols),
        };
        let mut labels = BTreeSet::new();
        let mut classes = BTreeSet::new();
        for peer in peers {
            match peer {
                // Pods only: host-networked pods have no identity.
                ClusterPeer::Namespaces(ns) => labels.extend(
                    self.index
                        .idents
                        .iter()
                        .filter(|(_, x)| ns.matches(&x.key.namespace_labels))
                        .map(|(id, _)| *id),
                ),
                ClusterPeer::Pods { namespaces, pods } => labels.extend(
                    self.index
                        .idents
                        .iter()
                        .filter(|(_, x)| {
                            namespaces.matches(&x.key.namespace_labels)
                                && pods.matches(&x.key.labels)
                        })
                        .map(|(id, _)| *id),
                ),
                // Every address class inside one of the networks: an
                // address's class is the longest carved prefix holding it.
                ClusterPeer::Networks(nets) => classes.extend(
                    self.classes
                        .prefixes()
                        .iter()
                        .filter(|(net, _)| nets.iter().any(|n| n.contains(*net)))
                        .map(|(_, id)| *id),
                ),
                // The class of each address of each Node selected (each
                // a carved host prefix, see `node_peer_addresses`).
                ClusterPeer::Nodes(sel) => classes.extend(
                    self.nodes
                        .values()
                        .filter(|n| sel.matches(&n.labels))
                        .flat_map(|n| n.addresses.iter())
                        .filter_map(|ip| self.classes.id_of(&IpNet::from(*ip))),
                ),
            }
        }
        RulePeers {
            everything: false,
            labels,
            classes,
            protocols: protocols.as_deref(),
        }
    }

    /// The (peer identity, port key) pairs of a rule's `peers` for a
    /// subject with `subject`'s labels.
    fn rule_keys(&self, peers: &RulePeers<'_>, dir: u8, subject: &LabelKey) -> Vec<(u32, PortKey)> {
        if peers.everything {
            return vec![(ANY, ANY_PORT)];
        }
        let mut out = Vec::new();
        for peer in peers.labels.iter().chain(peers.classes.iter()) {
            // "DestinationNamedPort selects a destination port on a pod":
            // the subject for ingress, the peer's identity for egress (an
            // address class has no pod to resolve it on).
            let destination = if dir == direction::INGRESS {
                Some(subject)
            } else if peers.labels.contains(peer) {
                self.index.idents.get(peer).map(|x| &x.key)
            } else {
                None
            };
            for port in port_keys(peers.protocols, destination) {
                out.push((*peer, port));
            }
        }
        out
    }
}

/// What a rule matches, independent of its subject.
#[derive(Default)]
struct RulePeers<'r> {
    /// `RuleMatch::Everything`: every peer, port and protocol.
    everything: bool,
    labels: BTreeSet<u32>,
    classes: BTreeSet<u32>,
    protocols: Option<&'r [ProtocolMatch]>,
}

/// The port keys of a rule's `protocols` ("If unspecified,
/// protocol-specific attributes will not be used to match traffic").
fn port_keys(protocols: Option<&[ProtocolMatch]>, destination: Option<&LabelKey>) -> Vec<PortKey> {
    let Some(list) = protocols else {
        return vec![ANY_PORT];
    };
    let mut out = Vec::new();
    for m in list {
        match m {
            ProtocolMatch::AllPorts(p) => out.push((*p, 0, 0)),
            ProtocolMatch::Ports {
                protocol,
                first,
                last,
            } => out.extend(
                range_blocks(*first, *last)
                    .into_iter()
                    .map(|(port, len)| (*protocol, len, port)),
            ),
            ProtocolMatch::Named(name) => {
                if let Some(d) = destination {
                    for p in [proto::TCP, proto::UDP, proto::SCTP] {
                        out.extend(d.resolve(name, p).map(|port| (p, 16, port)));
                    }
                }
            }
        }
    }
    out
}

impl Compiler {
    /// Whether some ClusterNetworkPolicy has a `nodes` peer.
    pub(super) fn has_node_peers(&self) -> bool {
        self.cluster_policies
            .values()
            .any(|p| p.node_selectors().next().is_some())
    }

    /// The addresses of every Node a `nodes` peer selects: "It selects the
    /// nodeIPs as the peer type by matching on the IPs present in the
    /// node.Status.Addresses field of the node." Each is carved as a
    /// host prefix, so it resolves to a class of its own (this node's
    /// keep the node identity, with that class beside it).
    pub(super) fn node_peer_addresses(&self) -> BTreeSet<std::net::IpAddr> {
        let selectors: Vec<_> = self
            .cluster_policies
            .values()
            .flat_map(ParsedClusterPolicy::node_selectors)
            .collect();
        self.nodes
            .values()
            .filter(|n| selectors.iter().any(|s| s.matches(&n.labels)))
            .flat_map(|n| n.addresses.iter().copied())
            .collect()
    }

    /// Every ClusterNetworkPolicy's standing for its status: the
    /// generation compiled, and each field not enforced as written.
    pub fn cluster_policy_standings(
        &self,
    ) -> BTreeMap<String, crate::cluster::cluster_policy::Standing> {
        self.cluster_policies
            .iter()
            .map(|(name, p)| {
                let mut problems: Vec<String> = p
                    .errors
                    .iter()
                    .map(|e| format!("{}: {} ({})", e.field, e.kind, e.effect))
                    .collect();
                problems.extend(self.tier_overflow_reason(name));
                let standing = crate::cluster::cluster_policy::Standing {
                    generation: p.generation,
                    problems,
                };
                (name.clone(), standing)
            })
            .collect()
    }

    /// Why policy `name` fails closed for its size, if it does.
    pub(super) fn tier_overflow_reason(&self, name: &str) -> Option<String> {
        self.tier_overflow.get(name).map(|entries| {
            format!(
                "it compiles to {entries} policy entries on this node, over the budget of {} per policy: it fails closed (its Accept rules match nothing, its Deny and Pass rules deny everything to the pods it selects)",
                self.options.budget.per_policy
            )
        })
    }
}
