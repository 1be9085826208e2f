//! The compiler: cluster state in, map content out, full or incremental.
//!
//! Work is done per identity, never per pod: selectors are evaluated once
//! per label identity, and each policy remembers which identities it
//! selects and, per rule, which identities its peers match (`members`).
//! A change (pod, namespace, policy) is turned into identities born, gone,
//! or whose addresses moved, and only the keys involving those are added
//! or removed; the [`Output`] journal turns that into the ordered map ops.
//! A full compile is the same machinery applied to an empty compiler.
//!
//! The parts, one concern each:
//! - [`claims`]: which pod holds each address;
//! - [`index`]: the label identities in use, their pods and endpoints;
//! - [`selection`]: which identities each policy selects and each rule
//!   reaches, and the prefixes ipBlocks carve;
//! - [`keys`]: the policy-map keys one rule gives one endpoint identity;
//! - [`budget`] and [`admission`]: how much compiled state a policy, and
//!   all of them, may hold, counted before it is built;
//! - [`output`]: the compiled maps, their bookkeeping and the journal;
//! - [`rule_names`]: the names of the rules the entries reference;
//! - `inputs` (changes of the inputs), `pods` (the steps that follow a
//!   pod change) and `entries` (endpoint and ipcache entries).
//!
//! Named ports resolve on the destination pod: for ingress on E (exact,
//! since E's identity includes its named ports); for egress on each peer
//! X, which only a label identity key can express. So egress named ports
//! produce keys with peer X for every pod identity X that the rule reaches:
//! X matched by a selector peer, every X when `to` is absent, and X whose
//! every address lies inside the rule's ipBlocks. A pod address inside an
//! ipBlock whose identity also has addresses outside it is not matched by
//! the named port (fail closed: a key for X would open X's other addresses),
//! and non-pod addresses never are (no pod to resolve the name on).
mod admission;
mod budget;
mod claims;
mod entries;
mod frontends;
mod index;
mod inputs;
mod keys;
mod members;
mod output;
mod pods;
mod rule_names;
mod selection;
mod tiers;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use policy_common::{
    endpoint::ENDPOINT_STAGED,
    identity::{NODE, WORLD, kind},
    rule_name::{RuleKey, RuleName},
};

use self::{
    claims::AddressClaims,
    index::IdentityIndex,
    output::Output,
    selection::{Carving, PolicyState},
};
use super::{
    Compiled,
    classes::Classes,
    cluster_policy::ParsedClusterPolicy,
    error::{PolicyError, PolicyErrorKind},
    parse::ParsedPolicy,
};
use crate::{
    cluster::{
        Change, ClusterState, EndpointSliceInfo, NamespaceInfo, NodeInfo, ObjectKind, ObjectRef,
        PodInfo, PodRef, PolicyRef, Problem, ServiceInfo, ServiceRef, normalized_ranges,
        unready_local_pods,
    },
    identity::{IdentityAllocator, IdentityError},
    mapstate::{MapOp, MapState, RuleOrigin, diff, identity_name},
};

pub use self::budget::{Budget, Refusal};

/// How to compile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompileOptions {
    /// Treat every pod as local (explain, and checks of a whole cluster).
    pub all_pods_local: bool,
    /// How much compiled state policies may hold (default: no limit).
    pub budget: Budget,
}

/// The incremental compiler. It owns its inputs (the cluster state as the
/// sources described it, policies parsed), the identity and selection
/// indexes, and the compiled map content.
#[derive(Clone, Debug, Default)]
pub struct Compiler {
    options: CompileOptions,
    node_name: String,
    node_ips: BTreeSet<IpAddr>,
    namespaces: BTreeMap<String, NamespaceInfo>,
    pods: BTreeMap<PodRef, PodInfo>,
    policies: BTreeMap<PolicyRef, PolicyState>,
    /// ClusterNetworkPolicies, validated, by name.
    cluster_policies: BTreeMap<String, ParsedClusterPolicy>,
    /// Every Node of the cluster (`nodes` peers).
    nodes: BTreeMap<String, NodeInfo>,
    /// ClusterNetworkPolicies past the per-policy budget (failing closed),
    /// with the entries they would take.
    tier_overflow: BTreeMap<String, u64>,
    /// Every ClusterNetworkPolicy rule's name, by the key its tier slots
    /// are named by (see [`rule_names`]).
    tier_rule_names: BTreeMap<RuleKey, RuleName>,
    services: BTreeMap<ServiceRef, ServiceInfo>,
    endpoint_slices: BTreeMap<ObjectRef, EndpointSliceInfo>,
    /// The cluster's Service ranges: frontends as a whole.
    service_ranges: BTreeSet<IpNet>,
    /// The node's pod ranges (None: not known yet). Not compiled: handed
    /// to the datapath, which keeps the guard it holds until they are.
    pod_ranges: Option<Vec<IpNet>>,

    carving: Carving,
    classes: Classes,
    index: IdentityIndex,
    claims: AddressClaims,
    /// Endpoint identities whose isolation flags must be recomputed.
    flags_dirty: BTreeSet<u32>,
    local_pods: BTreeMap<PodRef, Vec<IpAddr>>,
    identity_errors: Vec<IdentityError>,
    out: Output,
    /// Set during [`Compiler::apply`] once a change needs a full rebuild.
    rebuild_pending: bool,
    /// Whether the inputs were ever compiled (the first apply rebuilds).
    built: bool,
    /// Entries the admitted policies hold (see [`budget`]).
    admitted: u64,
    /// The next apply compiles in full (refused policies looked at again).
    recompile: bool,
    /// Local pods a staged policy would judge where no enforced one does:
    /// their entries carry `ENDPOINT_STAGED` (see [`Compiler::track_staged`]).
    staged_tracked: BTreeSet<PodRef>,
}

fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

impl Compiler {
    /// An empty compiler: its first [`Compiler::apply`] compiles in full.
    pub fn new(options: CompileOptions) -> Self {
        Self {
            options,
            ..Self::default()
        }
    }

    /// Compiles `state` from scratch (one identity generation).
    pub fn build(
        state: &ClusterState,
        ids: &mut IdentityAllocator,
        options: CompileOptions,
    ) -> Self {
        let mut c = Self::new(options);
        c.node_name = state.node_name.clone();
        c.node_ips = state.node_ips.iter().copied().collect();
        c.namespaces = state.namespaces.clone();
        c.pods = state.pods.clone();
        c.services = state.services.clone();
        c.endpoint_slices = state.endpoint_slices.clone();
        c.service_ranges = state.service_ranges.iter().map(IpNet::trunc).collect();
        c.pod_ranges = state.pod_ranges.clone().map(normalized_ranges);
        for (name, np) in &state.policies {
            let parsed = ParsedPolicy::parse(name, np);
            c.policies
                .insert(name.clone(), PolicyState::unmatched(parsed));
        }
        c.nodes = state.nodes.clone();
        c.cluster_policies = state
            .cluster_policies
            .iter()
            .map(|(name, cnp)| (name.clone(), ParsedClusterPolicy::parse(cnp)))
            .collect();
        c.rebuild(ids);
        ids.end_generation();
        c
    }

    /// Recomputes everything from the stored inputs, keeping identity
    /// numbers of keys still in use.
    fn rebuild(&mut self, ids: &mut IdentityAllocator) {
        let parsed: Vec<ParsedPolicy> = std::mem::take(&mut self.policies)
            .into_values()
            .map(|p| p.parsed)
            .collect();
        let inputs = (
            std::mem::take(&mut self.node_name),
            std::mem::take(&mut self.node_ips),
            std::mem::take(&mut self.namespaces),
            std::mem::take(&mut self.pods),
        );
        let cluster_policies = std::mem::take(&mut self.cluster_policies);
        let nodes = std::mem::take(&mut self.nodes);
        let staged_tracked = std::mem::take(&mut self.staged_tracked);
        let services = (
            std::mem::take(&mut self.services),
            std::mem::take(&mut self.endpoint_slices),
            std::mem::take(&mut self.service_ranges),
            self.pod_ranges.take(),
        );
        *self = Self::new(self.options);
        (self.node_name, self.node_ips, self.namespaces, self.pods) = inputs;
        (
            self.services,
            self.endpoint_slices,
            self.service_ranges,
            self.pod_ranges,
        ) = services;
        self.cluster_policies = cluster_policies;
        self.nodes = nodes;
        self.staged_tracked = staged_tracked;
        self.built = true;

        self.carve(&parsed, ids);
        // Identities and endpoints first, then each policy counted against
        // them before it is built (see `admission`).
        let all: BTreeSet<PodRef> = self.pods.keys().cloned().collect();
        self.sync_pods(all, ids);
        for p in parsed {
            self.add_policy_state(p);
        }
        self.admit_smallest_first();
        self.sync_tiers();
        let dirty = std::mem::take(&mut self.flags_dirty);
        self.refresh_endpoints(dirty);
        self.sync_frontends();

        let idents = &self.index.idents;
        let classes: BTreeSet<u32> = self.classes.prefixes().values().copied().collect();
        ids.release_unless(|id, k, _| match k {
            kind::LABELS => idents.contains_key(&id),
            kind::CIDR => classes.contains(&id),
            _ => false,
        });
        self.sync_rule_names();
        self.out.maps.finalize();
    }

    /// The address classes of every prefix valid policies carve, numbered
    /// in canonical order, with their ipcache entries; the reserved
    /// identities and the node's addresses.
    fn carve(&mut self, parsed: &[ParsedPolicy], ids: &mut IdentityAllocator) {
        let carved: BTreeSet<IpNet> = parsed
            .iter()
            .filter(|p| p.is_valid())
            .flat_map(ParsedPolicy::prefixes)
            .chain(
                self.cluster_policies
                    .values()
                    .flat_map(ParsedClusterPolicy::prefixes),
            )
            .chain(self.node_peer_addresses().into_iter().map(host_net))
            .collect();
        let mut by_name: Vec<(String, IpNet)> =
            carved.iter().map(|n| (n.to_string(), *n)).collect();
        by_name.sort();
        let mut class_ids = BTreeMap::new();
        for (name, net) in by_name {
            match ids.allocate(kind::CIDR, &name) {
                Ok(id) => {
                    class_ids.insert(net, id);
                    self.out
                        .set_identity(id, Some(identity_name(kind::CIDR, &name)));
                }
                Err(e) => self.identity_errors.push(e),
            }
        }
        self.classes = Classes::new(class_ids);
        self.out
            .set_identity(NODE, Some(identity_name(kind::RESERVED, "reserved:node")));
        self.out
            .set_identity(WORLD, Some(identity_name(kind::RESERVED, "reserved:world")));
        let carved: Vec<IpNet> = self.classes.prefixes().keys().copied().collect();
        for net in carved {
            let entry = self.ipcache_net_entry(net);
            self.out.set_ipcache(net, entry);
        }
        let node_ips: Vec<IpAddr> = self.node_ips.iter().copied().collect();
        for ip in node_ips {
            let entry = self.ipcache_entry(ip);
            self.out.set_ipcache(host_net(ip), entry);
        }
    }

    /// Applies `changes` as one identity generation and returns the ordered
    /// map writes from the previous content to the new one (exactly
    /// [`crate::mapstate::diff`] of the two).
    ///
    /// Pod, namespace and node-address changes, and policy changes that
    /// carve no new address prefix and drop none, are incremental; others
    /// (a new node name, and the first apply of an empty compiler)
    /// recompile in full and diff.
    pub fn apply(
        &mut self,
        changes: impl IntoIterator<Item = Change>,
        ids: &mut IdentityAllocator,
    ) -> Vec<MapOp<PodRef>> {
        self.out.start_journal();
        self.rebuild_pending = !self.built || std::mem::take(&mut self.recompile);
        for change in changes {
            self.apply_one(change, ids);
        }
        if !self.rebuild_pending
            && (!self.cluster_policies.is_empty() || !self.out.tiers().is_empty())
        {
            // Identities may have come or gone: the tier layer follows.
            self.sync_tiers();
            let dirty = std::mem::take(&mut self.flags_dirty);
            self.refresh_endpoints(dirty);
        }
        let ops = if self.rebuild_pending {
            let before: MapState<PodRef> = self.out.journal_start_state();
            self.out.stop_journal();
            self.rebuild(ids);
            self.rebuild_pending = false;
            diff(&before, &self.out.maps)
        } else {
            self.sync_rule_names();
            self.out.take_ops()
        };
        ids.end_generation();
        debug_assert_eq!(
            self.admitted,
            self.policies
                .values()
                .filter(|p| p.refused.is_none())
                .map(selection::PolicyState::entries)
                .sum::<u64>(),
            "entries of the admitted policies"
        );
        ops
    }

    /// Makes the next apply compile in full if a policy is refused for a
    /// budget, so it comes back by itself once it fits (the periodic
    /// resync calls this).
    pub fn recompile_if_refused(&mut self) {
        if self.has_refusals() {
            self.recompile = true;
        }
    }

    /// Marks `pods` (local pods a staged policy would judge where no
    /// enforced one does) with `ENDPOINT_STAGED`, and every other pod
    /// without it; returns the endpoint writes that takes. Verdicts do
    /// not change: the flag only has the pod's flows tracked.
    pub fn track_staged(&mut self, pods: BTreeSet<PodRef>) -> Vec<MapOp<PodRef>> {
        if pods == self.staged_tracked {
            return Vec::new();
        }
        self.out.start_journal();
        let changed: Vec<PodRef> = pods
            .symmetric_difference(&self.staged_tracked)
            .cloned()
            .collect();
        self.staged_tracked = pods;
        for pod in changed {
            if let Some(mut info) = self.out.maps.endpoints.get(&pod).copied() {
                info.flags &= !ENDPOINT_STAGED;
                if self.staged_tracked.contains(&pod) {
                    info.flags |= ENDPOINT_STAGED;
                }
                self.out.set_endpoint(&pod, Some(info));
            }
        }
        self.out.take_ops()
    }

    /// A pod as the compiler last saw it.
    pub fn pod(&self, pod: &PodRef) -> Option<&PodInfo> {
        self.pods.get(pod)
    }

    /// The compiled map content.
    pub fn maps(&self) -> &MapState<PodRef> {
        &self.out.maps
    }

    /// The addresses of each local endpoint pod.
    pub fn local_pods(&self) -> &BTreeMap<PodRef, Vec<IpAddr>> {
        &self.local_pods
    }

    /// The node's pod ranges, once known (sorted, host bits clear).
    pub fn pod_ranges(&self) -> Option<&[IpNet]> {
        self.pod_ranges.as_deref()
    }

    /// Every policy problem found, policies in name order: invalid fields,
    /// and policies refused for a budget (on `spec`).
    pub fn errors(&self) -> Vec<PolicyError> {
        self.policies
            .values()
            .flat_map(|p| {
                let refused = p
                    .refused
                    .map(|r| PolicyError::new(&p.parsed.name, "spec", PolicyErrorKind::Refused(r)));
                p.parsed.errors.iter().cloned().chain(refused)
            })
            .collect()
    }

    /// Everything not enforced as written: invalid policies, identity
    /// numbers exhausted, local pods without an address yet, Service and
    /// EndpointSlice fields that do not read.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out: Vec<Problem> = self.errors().iter().map(PolicyError::problem).collect();
        out.extend(
            self.cluster_policies
                .values()
                .flat_map(|p| p.errors.iter().map(|e| e.problem())),
        );
        out.extend(self.tier_overflow.keys().filter_map(|name| {
            let reason = self.tier_overflow_reason(name)?;
            Some(Problem::object(
                ObjectKind::ClusterNetworkPolicy,
                ObjectRef::new("", name.clone()),
                reason,
            ))
        }));
        out.extend(
            self.identity_errors
                .iter()
                .map(|e| Problem::node(format!("identity allocation failed: {e}"))),
        );
        out.extend(unready_local_pods(&self.node_name, &self.pods));
        for (name, svc) in &self.services {
            out.extend(svc.problems(name));
        }
        for (name, slice) in &self.endpoint_slices {
            out.extend(slice.problems(name));
        }
        out
    }

    /// `rule_ref` → the rule, for every rule that can produce entries (on a
    /// hash collision the smallest origin is kept).
    pub fn rules(&self) -> BTreeMap<u32, RuleOrigin> {
        let mut out: BTreeMap<u32, RuleOrigin> = BTreeMap::new();
        for ps in self.policies.values() {
            for r in &ps.parsed.rules {
                let origin = RuleOrigin {
                    policy: ps.parsed.name.clone(),
                    direction: r.direction,
                    rule_index: r.index,
                };
                out.entry(r.rule_ref)
                    .and_modify(|o| {
                        if origin < *o {
                            *o = origin.clone();
                        }
                    })
                    .or_insert(origin);
            }
        }
        out
    }

    /// Approximate bytes of the compiled content and its bookkeeping.
    pub fn approx_bytes(&self) -> usize {
        self.out.approx_bytes()
    }

    pub fn into_compiled(self) -> Compiled {
        let rules = self.rules();
        let errors = self.errors();
        Compiled {
            maps: self.out.maps,
            local_pods: self.local_pods,
            rules,
            errors,
            identity_errors: self.identity_errors,
        }
    }
}
