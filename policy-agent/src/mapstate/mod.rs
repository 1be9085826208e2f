//! The datapath-neutral description of what every policy map must hold,
//! and the ordered, minimal difference between two such descriptions;
//! what renderers that match addresses rather than identities need
//! ([`identity_addresses`], [`RuleOrigin`]) is read from it here.
//!
//! The compiler produces a `MapState<PodRef>` (endpoints named by pod); the
//! BPF datapath resolves pods to host interfaces, giving a `MapState<u32>`
//! keyed by ifindex, and applies [`diff`] of the pinned content and that.
mod addresses;
mod diff;
mod identity_name;
mod origin;
mod rule_name;
mod staged;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use ipnet::IpNet;
use policy_common::{
    direction,
    endpoint::{EndpointInfo, lookups},
    identity::IdentityName,
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    rule_name::{RuleKey, RuleName},
    service::ServiceEntry,
};

pub(crate) use self::identity_name::fnv1a64;
pub use self::{
    addresses::{AddressSet, identity_addresses},
    diff::{MapOp, Updating, Writes, assign_revisions, covering, diff, updating},
    identity_name::{identity_name, identity_name_str, shared_identity_name},
    origin::RuleOrigin,
    rule_name::{RuleText, entry_rules, rule_name, rule_name_text},
    staged::{StagedVerdict, StagedView},
};

/// Desired (or read-back) content of the policy maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapState<K: Ord> {
    /// Local endpoints. `revision` and the lookup bits are filled by
    /// [`MapState::finalize`] and [`assign_revisions`].
    pub endpoints: BTreeMap<K, EndpointInfo>,
    /// Prefix (host bits zero) → identities.
    pub ipcache: BTreeMap<IpNet, IpcacheEntry>,
    pub policy: BTreeMap<PolicyKey, PolicyEntry>,
    /// What each identity in use stands for.
    pub identities: BTreeMap<u32, Arc<IdentityName>>,
    /// What each rule a policy entry references is called (exactly
    /// [`MapState::referenced_rules`]), and which policies isolate each
    /// endpoint identity (`kind::ISOLATING`): for `dump` and flow records;
    /// no datapath reads it.
    pub rule_names: BTreeMap<RuleKey, RuleName>,
    /// Service frontend addresses and ranges: an isolated pod's egress to
    /// them is judged after DNAT (only the BPF datapath needs them; the
    /// iptables one judges in netfilter, after DNAT anyway).
    pub services: BTreeMap<IpNet, ServiceEntry>,
}

impl<K: Ord> Default for MapState<K> {
    fn default() -> Self {
        Self {
            endpoints: BTreeMap::new(),
            ipcache: BTreeMap::new(),
            policy: BTreeMap::new(),
            identities: BTreeMap::new(),
            rule_names: BTreeMap::new(),
            services: BTreeMap::new(),
        }
    }
}

/// The lookup bits an endpoint identity needs in one direction: which
/// port prefix lengths, any-protocol and any-peer entries exist.
pub fn lookup_bits(policy: &BTreeMap<PolicyKey, PolicyEntry>, identity: u32, dir: u8) -> u32 {
    let start = PolicyKey {
        endpoint_identity: identity,
        ..PolicyKey::default()
    };
    policy
        .range(start..)
        .map(|(k, _)| k)
        .take_while(|k| k.endpoint_identity == identity)
        .filter(|k| k.direction == dir)
        .fold(0, |bits, key| bits | key.lookup_bits())
}

impl<K: Ord + Clone> MapState<K> {
    /// Every identity number a row keys or holds, names aside: policy keys
    /// (endpoint and peer), ipcache values (identity and class), endpoint
    /// entries. A number can be here without a name: names are dropped
    /// first when the maps are full.
    pub fn identities_in_use(&self) -> BTreeSet<u32> {
        let mut out = BTreeSet::new();
        for k in self.policy.keys() {
            out.insert(k.endpoint_identity);
            out.insert(k.peer_identity);
        }
        for e in self.ipcache.values() {
            out.insert(e.identity);
            out.insert(e.cidr_identity);
        }
        out.extend(self.endpoints.values().map(|e| e.identity));
        out
    }

    /// Fills every endpoint's lookup bits from the policy entries.
    pub fn finalize(&mut self) {
        let mut cache: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        for ep in self.endpoints.values_mut() {
            let (ingress, egress) = *cache.entry(ep.identity).or_insert_with(|| {
                (
                    lookup_bits(&self.policy, ep.identity, direction::INGRESS),
                    lookup_bits(&self.policy, ep.identity, direction::EGRESS),
                )
            });
            ep.ingress_lookups = lookups::stored(ingress);
            ep.egress_lookups = lookups::stored(egress);
        }
    }

    /// The same content with endpoints re-keyed (pods → interfaces);
    /// endpoints `resolve` maps to `None` are left out.
    pub fn rekey<J: Ord>(&self, mut resolve: impl FnMut(&K) -> Option<J>) -> MapState<J> {
        MapState {
            endpoints: self
                .endpoints
                .iter()
                .filter_map(|(k, v)| resolve(k).map(|j| (j, *v)))
                .collect(),
            ipcache: self.ipcache.clone(),
            policy: self.policy.clone(),
            identities: self.identities.clone(),
            rule_names: self.rule_names.clone(),
            services: self.services.clone(),
        }
    }

    /// A revision above every endpoint's (never 0): what an endpoint whose
    /// verdicts may have changed moves to.
    pub fn next_revision(&self) -> u32 {
        self.endpoints
            .values()
            .map(|e| e.revision)
            .max()
            .unwrap_or(0)
            .wrapping_add(1)
            .max(1)
    }

    /// The policy entries of one endpoint identity.
    pub fn policy_of(&self, identity: u32) -> impl Iterator<Item = (&PolicyKey, &PolicyEntry)> {
        let start = PolicyKey {
            endpoint_identity: identity,
            ..PolicyKey::default()
        };
        self.policy
            .range(start..)
            .take_while(move |(k, _)| k.endpoint_identity == identity)
    }

    /// The pure-Rust lookup model of this content (endpoints keyed by `key`).
    pub fn to_model(&self, mut key: impl FnMut(&K) -> u32) -> policy_common::model::Maps {
        let mut m = policy_common::model::Maps {
            endpoints: self.endpoints.iter().map(|(k, v)| (key(k), *v)).collect(),
            policy: self.policy.clone(),
            ..Default::default()
        };
        for (net, entry) in &self.ipcache {
            m.insert_prefix(net.addr(), u32::from(net.prefix_len()), *entry);
        }
        for (net, entry) in &self.services {
            m.insert_frontend(net.addr(), u32::from(net.prefix_len()), *entry);
        }
        m
    }
}

impl<K: Ord + Clone> MapState<K> {
    /// Applies one write (as the datapath would).
    pub fn apply_op(&mut self, op: &MapOp<K>) {
        match op {
            MapOp::UpsertIdentity(k, v) => {
                self.identities.insert(*k, v.clone());
            }
            MapOp::UpsertPolicy(k, v) => {
                self.policy.insert(*k, *v);
            }
            MapOp::UpsertEndpoint(k, v) => {
                self.endpoints.insert(k.clone(), *v);
            }
            MapOp::UpsertIpcache(k, v) => {
                self.ipcache.insert(*k, *v);
            }
            MapOp::DeletePolicy(k) => {
                self.policy.remove(k);
            }
            MapOp::DeleteIpcache(k) => {
                self.ipcache.remove(k);
            }
            MapOp::DeleteEndpoint(k) => {
                self.endpoints.remove(k);
            }
            MapOp::DeleteIdentity(k) => {
                self.identities.remove(k);
            }
            MapOp::UpsertService(k, v) => {
                self.services.insert(*k, *v);
            }
            MapOp::UpsertRuleName(k, v) => {
                self.rule_names.insert(*k, **v);
            }
            MapOp::DeleteRuleName(k) => {
                self.rule_names.remove(k);
            }
            MapOp::DeleteService(k) => {
                self.services.remove(k);
            }
        }
    }
}
