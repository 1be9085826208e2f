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
//! What each policy key means, per rule r of a policy selecting endpoint
//! identity E (in a direction the policy isolates):
//! - `from`/`to` absent: peer ANY, ports of r;
//! - each address class c an ipBlock of r matches: peer c, ports of r;
//! - each label identity X a selector peer of r matches: peer X, ports of r.
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
use std::{
    borrow::Cow,
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED, EndpointInfo},
    identity::{ANY, NODE, WORLD, kind},
    ipcache::IpcacheEntry,
    policy::PolicyKey,
};

use super::{
    Compiled, RuleOrigin,
    classes::Classes,
    error::PolicyError,
    output::Output,
    parse::{ParsedPolicy, Peers, Rule},
    ports::{PortKey, port_keys},
};
use crate::{
    cluster::{ClusterState, Labels, NamespaceInfo, PodInfo, PodRef, PolicyRef},
    identity::{IdentityAllocator, LabelKey, default_namespace_labels},
    mapstate::{MapOp, MapState, diff, identity_name},
};

/// How to compile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompileOptions {
    /// Treat every pod as local (explain, and checks of a whole cluster).
    pub all_pods_local: bool,
}

/// One change of the cluster state, for [`Compiler::apply`].
#[derive(Clone, Debug)]
pub enum Change {
    UpsertPod(PodRef, PodInfo),
    DeletePod(PodRef),
    UpsertNamespace(String, NamespaceInfo),
    DeleteNamespace(String),
    UpsertPolicy(PolicyRef, Box<NetworkPolicy>),
    DeletePolicy(PolicyRef),
    /// The node's name or addresses changed.
    Node {
        name: String,
        ips: Vec<IpAddr>,
    },
}

/// `members` bit: a selector peer of the rule matches the identity.
const SEL: u8 = 1;
/// `members` bit: the rule's egress named ports resolve on the identity.
const NAMED: u8 = 2;

/// A label identity in use.
#[derive(Clone, Debug)]
struct Ident {
    key: LabelKey,
    /// Live pods with this identity.
    pods: BTreeSet<PodRef>,
    /// Of those, the local endpoints.
    endpoints: BTreeSet<PodRef>,
    /// Addresses these pods hold.
    ips: BTreeSet<IpAddr>,
}

#[derive(Clone, Debug, Default)]
struct RuleState {
    /// Address classes the rule's ipBlocks match.
    classes: Vec<u32>,
    /// Label identities the rule reaches, with SEL/NAMED bits.
    members: BTreeMap<u32, u8>,
    /// Egress with named ports: NAMED applies.
    named_egress: bool,
    /// NAMED depends on the identity's addresses (ipBlock peers).
    ip_sensitive: bool,
}

#[derive(Clone, Debug)]
struct PolicyState {
    parsed: ParsedPolicy,
    /// Label identities the policy selects (its namespace's).
    selected: BTreeSet<u32>,
    /// Parallel to `parsed.rules`.
    rules: Vec<RuleState>,
}

/// A pod's claim on an address: the newest pod holds it, ties by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Claim {
    newest: Reverse<i64>,
    pod: PodRef,
}

/// The incremental compiler. Keeps the inputs it was given, the identity
/// and selection indexes, and the compiled map content.
#[derive(Clone, Debug, Default)]
pub struct Compiler {
    options: CompileOptions,
    node_name: String,
    node_ips: BTreeSet<IpAddr>,
    namespaces: BTreeMap<String, NamespaceInfo>,
    pods: BTreeMap<PodRef, PodInfo>,
    policies: BTreeMap<PolicyRef, PolicyState>,

    carve_refs: BTreeMap<IpNet, usize>,
    classes: Classes,

    idents: BTreeMap<u32, Ident>,
    key_ids: HashMap<LabelKey, u32>,
    ns_idents: BTreeMap<String, BTreeSet<u32>>,
    pod_ident: BTreeMap<PodRef, u32>,
    /// The addresses each live pod claims (and the creation time it used).
    pod_claims: BTreeMap<PodRef, (i64, Vec<IpAddr>)>,
    claims: BTreeMap<IpAddr, BTreeSet<Claim>>,
    holders: BTreeMap<IpAddr, PodRef>,
    pod_held: BTreeMap<PodRef, BTreeSet<IpAddr>>,
    /// Label identities with at least one local endpoint pod.
    endpoint_ids: BTreeSet<u32>,
    /// Endpoint identities whose isolation flags must be recomputed.
    flags_dirty: BTreeSet<u32>,
    local_pods: BTreeMap<PodRef, Vec<IpAddr>>,
    identity_errors: Vec<PolicyError>,
    out: Output,
    /// Set during [`Compiler::apply`] once a change needs a full rebuild.
    rebuild_pending: bool,
}

/// A pod that owns addresses and has an identity: live and not hostNetwork
/// (hostNetwork pods use the node's addresses and are never peers).
fn eligible(info: &PodInfo) -> bool {
    !info.terminal && !info.host_network && !info.ips.is_empty()
}

fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

fn base_ports(rule: &Rule, e_key: &LabelKey) -> Vec<PortKey> {
    if rule.direction == direction::INGRESS {
        // Ingress: named ports resolve on the protected pod, E.
        port_keys(&rule.ports, Some(e_key), true, true)
    } else {
        // Egress: numeric only; named ports go with each peer identity.
        port_keys(&rule.ports, None, true, false)
    }
}

fn write_keys(
    out: &mut Output,
    e: u32,
    dir: u8,
    peer: u32,
    ports: &[PortKey],
    rule_ref: u32,
    add: bool,
) {
    for &(protocol, len, port) in ports {
        let key = PolicyKey::new(e, dir, peer, protocol, len, port);
        if add {
            out.add_policy(key, rule_ref);
        } else {
            out.remove_policy(key, rule_ref);
        }
    }
}

/// The keys rule `rule` gives endpoint `e` for member `x` with `bits`.
#[allow(clippy::too_many_arguments)]
fn write_member(
    out: &mut Output,
    idents: &BTreeMap<u32, Ident>,
    rule: &Rule,
    base: Option<&[PortKey]>,
    e: u32,
    x: u32,
    bits: u8,
    add: bool,
) {
    let Some(e_ident) = idents.get(&e) else {
        return;
    };
    let mut ports: Vec<PortKey> = Vec::new();
    if bits & SEL != 0 {
        match base {
            Some(b) => ports.extend_from_slice(b),
            None => ports = base_ports(rule, &e_ident.key),
        }
    }
    if bits & NAMED != 0
        && let Some(x_ident) = idents.get(&x)
    {
        ports.extend(port_keys(&rule.ports, Some(&x_ident.key), false, true));
        ports.sort_unstable();
        ports.dedup();
    }
    write_keys(out, e, rule.direction, x, &ports, rule.rule_ref, add);
}

/// Every key rule `rule` gives endpoint `e`.
fn write_rule(
    out: &mut Output,
    idents: &BTreeMap<u32, Ident>,
    rule: &Rule,
    rs: &RuleState,
    e: u32,
    add: bool,
) {
    let Some(e_ident) = idents.get(&e) else {
        return;
    };
    let base = base_ports(rule, &e_ident.key);
    if matches!(rule.peers, Peers::All) {
        write_keys(out, e, rule.direction, ANY, &base, rule.rule_ref, add);
    }
    for c in &rs.classes {
        write_keys(out, e, rule.direction, *c, &base, rule.rule_ref, add);
    }
    for (x, bits) in &rs.members {
        write_member(out, idents, rule, Some(&base), e, *x, *bits, add);
    }
}

/// The policies of `namespace` that select endpoint identity `e` (only a
/// policy of its own namespace can), in name order.
fn policies_selecting<'a>(
    policies: &'a BTreeMap<PolicyRef, PolicyState>,
    namespace: &'a str,
    e: u32,
) -> impl Iterator<Item = &'a PolicyState> {
    policies
        .range(PolicyRef::new(namespace, "")..)
        .take_while(move |(k, _)| k.namespace == namespace)
        .map(|(_, ps)| ps)
        .filter(move |ps| ps.selected.contains(&e))
}

/// Which of SEL/NAMED rule `rule` has for identity `x`.
fn member_bits(rule: &Rule, rs: &RuleState, x: &Ident) -> u8 {
    let sel = rule.selects_pod(&x.key);
    let mut bits = if sel { SEL } else { 0 };
    if rs.named_egress {
        let covered = || {
            rule.blocks().next().is_some()
                && !x.ips.is_empty()
                && x.ips
                    .iter()
                    .all(|ip| rule.blocks().any(|b| b.contains(*ip)))
        };
        if sel || matches!(rule.peers, Peers::All) || covered() {
            bits |= NAMED;
        }
    }
    bits
}

impl Compiler {
    fn empty(options: CompileOptions) -> Self {
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
        let mut c = Self::empty(options);
        c.node_name = state.node_name.clone();
        c.node_ips = state.node_ips.iter().copied().collect();
        c.namespaces = state.namespaces.clone();
        c.pods = state.pods.clone();
        for (name, np) in &state.policies {
            let parsed = ParsedPolicy::parse(name, np);
            c.policies.insert(
                name.clone(),
                PolicyState {
                    parsed,
                    selected: BTreeSet::new(),
                    rules: Vec::new(),
                },
            );
        }
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
        let fresh = Self::empty(self.options);
        let inputs = (
            std::mem::take(&mut self.node_name),
            std::mem::take(&mut self.node_ips),
            std::mem::take(&mut self.namespaces),
            std::mem::take(&mut self.pods),
        );
        *self = fresh;
        (self.node_name, self.node_ips, self.namespaces, self.pods) = inputs;

        // Address classes, allocated in canonical order.
        // (add_policy_state counts the references, below.)
        let carved: BTreeSet<IpNet> = parsed
            .iter()
            .filter(|p| p.is_valid())
            .flat_map(ParsedPolicy::prefixes)
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
                Err(e) => self.identity_errors.push(e.into()),
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

        for p in parsed {
            self.add_policy_state(p);
        }
        let all: BTreeSet<PodRef> = self.pods.keys().cloned().collect();
        self.sync_pods(all, ids);

        let idents = &self.idents;
        let classes: BTreeSet<u32> = self.classes.prefixes().values().copied().collect();
        ids.release_unless(|id, k, _| match k {
            kind::LABELS => idents.contains_key(&id),
            kind::CIDR => classes.contains(&id),
            _ => false,
        });
        self.out.maps.finalize();
    }

    /// Applies `changes` as one identity generation and returns the ordered
    /// map writes from the previous content to the new one (exactly
    /// [`crate::mapstate::diff`] of the two).
    ///
    /// Pod and namespace changes, and policy changes that carve no new
    /// address prefix and drop none, are incremental; others (and node
    /// changes) recompile in full and diff.
    pub fn apply(
        &mut self,
        changes: impl IntoIterator<Item = Change>,
        ids: &mut IdentityAllocator,
    ) -> Vec<MapOp<PodRef>> {
        self.out.start_journal();
        self.rebuild_pending = false;
        for change in changes {
            self.apply_one(change, ids);
        }
        let ops = if self.rebuild_pending {
            let before: MapState<PodRef> = self.out.journal_start_state();
            self.out.stop_journal();
            self.rebuild(ids);
            self.rebuild_pending = false;
            diff(&before, &self.out.maps)
        } else {
            self.out.take_ops()
        };
        ids.end_generation();
        ops
    }

    fn apply_one(&mut self, change: Change, ids: &mut IdentityAllocator) {
        match change {
            Change::UpsertPod(pod, info) => {
                self.pods.insert(pod.clone(), info);
                if !self.rebuild_pending {
                    self.sync_pods(BTreeSet::from([pod]), ids);
                }
            }
            Change::DeletePod(pod) => {
                self.pods.remove(&pod);
                if !self.rebuild_pending {
                    self.sync_pods(BTreeSet::from([pod]), ids);
                }
            }
            Change::UpsertNamespace(ns, info) => {
                self.namespaces.insert(ns.clone(), info);
                self.namespace_changed(&ns, ids);
            }
            Change::DeleteNamespace(ns) => {
                self.namespaces.remove(&ns);
                self.namespace_changed(&ns, ids);
            }
            Change::UpsertPolicy(name, np) => {
                let parsed = ParsedPolicy::parse(&name, &np);
                self.replace_policy(&name, Some(parsed));
            }
            Change::DeletePolicy(name) => self.replace_policy(&name, None),
            Change::Node { name, ips } => {
                self.node_name = name;
                self.node_ips = ips.into_iter().collect();
                self.rebuild_pending = true;
            }
        }
    }

    fn namespace_changed(&mut self, ns: &str, ids: &mut IdentityAllocator) {
        if self.rebuild_pending {
            return;
        }
        let start = PodRef::new(ns, "");
        let affected: BTreeSet<PodRef> = self
            .pods
            .range(start..)
            .map(|(k, _)| k)
            .take_while(|k| k.namespace == ns)
            .cloned()
            .collect();
        self.sync_pods(affected, ids);
    }

    /// Whether replacing `old` by `new` changes the set of carved prefixes.
    fn carving_changes(&self, old: Option<&ParsedPolicy>, new: Option<&ParsedPolicy>) -> bool {
        let prefixes = |p: Option<&ParsedPolicy>| {
            p.filter(|p| p.is_valid())
                .map(ParsedPolicy::prefixes)
                .unwrap_or_default()
        };
        let (old, new) = (prefixes(old), prefixes(new));
        new.iter().any(|n| !self.carve_refs.contains_key(n))
            || old
                .iter()
                .any(|n| !new.contains(n) && self.carve_refs.get(n).is_some_and(|c| *c <= 1))
    }

    fn replace_policy(&mut self, name: &PolicyRef, new: Option<ParsedPolicy>) {
        let old = self.policies.get(name).map(|p| &p.parsed);
        if !self.rebuild_pending && self.carving_changes(old, new.as_ref()) {
            self.rebuild_pending = true;
        }
        if self.rebuild_pending {
            match new {
                Some(parsed) => self.policies.insert(
                    name.clone(),
                    PolicyState {
                        parsed,
                        selected: BTreeSet::new(),
                        rules: Vec::new(),
                    },
                ),
                None => self.policies.remove(name),
            };
            return;
        }
        self.remove_policy_state(name);
        if let Some(parsed) = new {
            self.add_policy_state(parsed);
        }
        let dirty = std::mem::take(&mut self.flags_dirty);
        self.refresh_endpoints(dirty);
    }

    fn remove_policy_state(&mut self, name: &PolicyRef) {
        let Some(ps) = self.policies.remove(name) else {
            return;
        };
        for e in ps.selected.iter().filter(|e| self.endpoint_ids.contains(e)) {
            for (rule, rs) in ps.parsed.rules.iter().zip(&ps.rules) {
                write_rule(&mut self.out, &self.idents, rule, rs, *e, false);
            }
            self.flags_dirty.insert(*e);
        }
        if ps.parsed.is_valid() {
            for net in ps.parsed.prefixes() {
                if let Some(c) = self.carve_refs.get_mut(&net) {
                    *c -= 1;
                    if *c == 0 {
                        self.carve_refs.remove(&net);
                    }
                }
            }
        }
    }

    fn rule_state(&self, rule: &Rule) -> RuleState {
        let mut rs = RuleState {
            named_egress: rule.direction == direction::EGRESS && rule.has_named_ports(),
            ..RuleState::default()
        };
        rs.ip_sensitive =
            rs.named_egress && !matches!(rule.peers, Peers::All) && rule.blocks().next().is_some();
        let mut classes: BTreeSet<u32> = BTreeSet::new();
        for b in rule.blocks() {
            classes.extend(self.classes.allowed(b));
        }
        rs.classes = classes.into_iter().collect();
        if rs.named_egress || rule.selector_peers().next().is_some() {
            for (x, ident) in &self.idents {
                let bits = member_bits(rule, &rs, ident);
                if bits != 0 {
                    rs.members.insert(*x, bits);
                }
            }
        }
        rs
    }

    fn add_policy_state(&mut self, parsed: ParsedPolicy) {
        if parsed.is_valid() {
            for net in parsed.prefixes() {
                *self.carve_refs.entry(net).or_insert(0) += 1;
            }
        }
        let rules: Vec<RuleState> = parsed.rules.iter().map(|r| self.rule_state(r)).collect();
        let ns = parsed.name.namespace.clone();
        let selected: BTreeSet<u32> = self
            .ns_idents
            .get(&ns)
            .into_iter()
            .flatten()
            .filter(|x| {
                self.idents
                    .get(x)
                    .is_some_and(|i| parsed.selects(&i.key.namespace, &i.key.labels))
            })
            .copied()
            .collect();
        for e in selected.iter().filter(|e| self.endpoint_ids.contains(e)) {
            for (rule, rs) in parsed.rules.iter().zip(&rules) {
                write_rule(&mut self.out, &self.idents, rule, rs, *e, true);
            }
            self.flags_dirty.insert(*e);
        }
        self.policies.insert(
            parsed.name.clone(),
            PolicyState {
                parsed,
                selected,
                rules,
            },
        );
    }

    fn namespace_labels(&self, ns: &str) -> Cow<'_, Labels> {
        match self.namespaces.get(ns) {
            Some(info) => Cow::Borrowed(&info.labels),
            None => Cow::Owned(default_namespace_labels(ns)),
        }
    }

    fn is_local(&self, info: &PodInfo) -> bool {
        self.options.all_pods_local || info.node_name.as_deref() == Some(self.node_name.as_str())
    }

    /// The ipcache entry of one address (its host prefix).
    fn ipcache_entry(&self, ip: IpAddr) -> Option<IpcacheEntry> {
        let cidr_identity = self.classes.class_of(ip);
        if self.node_ips.contains(&ip) {
            return Some(IpcacheEntry {
                identity: NODE,
                cidr_identity,
            });
        }
        if let Some(pod) = self.holders.get(&ip) {
            let identity = self.pod_ident.get(pod).copied().unwrap_or(ANY);
            return Some(IpcacheEntry {
                identity,
                cidr_identity,
            });
        }
        self.classes.id_of(&host_net(ip)).map(|c| IpcacheEntry {
            identity: ANY,
            cidr_identity: c,
        })
    }

    fn ipcache_net_entry(&self, net: IpNet) -> Option<IpcacheEntry> {
        if net.prefix_len() == net.max_prefix_len() {
            return self.ipcache_entry(net.addr());
        }
        self.classes.id_of(&net).map(|c| IpcacheEntry {
            identity: ANY,
            cidr_identity: c,
        })
    }

    fn flags_of(&self, e: u32) -> u32 {
        let Some(x) = self.idents.get(&e) else {
            return 0;
        };
        let mut flags = 0;
        for ps in policies_selecting(&self.policies, &x.key.namespace, e) {
            if ps.parsed.ingress {
                flags |= ENDPOINT_INGRESS_ISOLATED;
            }
            if ps.parsed.egress {
                flags |= ENDPOINT_EGRESS_ISOLATED;
            }
        }
        flags
    }

    /// Rewrites the endpoint entries of identities `es` (flags and lookups).
    fn refresh_endpoints(&mut self, es: BTreeSet<u32>) {
        let dirty = std::mem::take(&mut self.out.dirty_lookups);
        for e in es.union(&dirty) {
            if !self.endpoint_ids.contains(e) {
                continue;
            }
            let info = EndpointInfo {
                identity: *e,
                flags: self.flags_of(*e),
                revision: 0,
                ingress_lookups: self.out.lookup_bits(*e, direction::INGRESS),
                egress_lookups: self.out.lookup_bits(*e, direction::EGRESS),
                _reserved: 0,
            };
            let Some(ident) = self.idents.get(e) else {
                continue;
            };
            for pod in &ident.endpoints {
                self.out.set_endpoint(pod, Some(info));
            }
        }
    }

    /// Brings everything that depends on `affected` pods up to date; their
    /// entries in `self.pods` and `self.namespaces` are already the new ones.
    fn sync_pods(&mut self, affected: BTreeSet<PodRef>, ids: &mut IdentityAllocator) {
        // 1. Address claims.
        let mut ips_touched: BTreeSet<IpAddr> = BTreeSet::new();
        for pod in &affected {
            if let Some((created, old)) = self.pod_claims.remove(pod) {
                let claim = Claim {
                    newest: Reverse(created),
                    pod: pod.clone(),
                };
                for ip in old {
                    if let Some(set) = self.claims.get_mut(&ip) {
                        set.remove(&claim);
                        if set.is_empty() {
                            self.claims.remove(&ip);
                        }
                    }
                    ips_touched.insert(ip);
                }
            }
            if let Some(info) = self.pods.get(pod).filter(|i| eligible(i)) {
                let mut ips: Vec<IpAddr> = info
                    .ips
                    .iter()
                    .copied()
                    .filter(|ip| !self.node_ips.contains(ip))
                    .collect();
                ips.sort_unstable();
                ips.dedup();
                let claim = Claim {
                    newest: Reverse(info.created),
                    pod: pod.clone(),
                };
                for ip in &ips {
                    self.claims.entry(*ip).or_default().insert(claim.clone());
                    ips_touched.insert(*ip);
                }
                self.pod_claims.insert(pod.clone(), (info.created, ips));
            }
        }

        // 2. Who holds each touched address now.
        let mut touched = affected;
        for ip in &ips_touched {
            let new = self
                .claims
                .get(ip)
                .and_then(|s| s.first())
                .map(|c| c.pod.clone());
            let old = match &new {
                Some(n) => self.holders.insert(*ip, n.clone()),
                None => self.holders.remove(ip),
            };
            if old != new {
                touched.extend(old);
                touched.extend(new);
            }
        }

        // 3. What each touched pod is now.
        struct Delta {
            pod: PodRef,
            key: Option<LabelKey>,
            held: BTreeSet<IpAddr>,
            local: bool,
        }
        let deltas: Vec<Delta> = touched
            .iter()
            .map(|pod| {
                let info = self.pods.get(pod).filter(|i| eligible(i));
                let key = info.map(|i| {
                    LabelKey::of_pod(&pod.namespace, &self.namespace_labels(&pod.namespace), i)
                });
                let held: BTreeSet<IpAddr> = self
                    .pod_claims
                    .get(pod)
                    .map(|(_, ips)| {
                        ips.iter()
                            .filter(|ip| self.holders.get(ip) == Some(pod))
                            .copied()
                            .collect()
                    })
                    .unwrap_or_default();
                let local = info.is_some_and(|i| self.is_local(i));
                Delta {
                    pod: pod.clone(),
                    key,
                    held,
                    local,
                }
            })
            .collect();

        // 4. New identities, in canonical order.
        let mut fresh: BTreeMap<String, LabelKey> = BTreeMap::new();
        for d in &deltas {
            if let Some(k) = d.key.as_ref().filter(|k| !self.key_ids.contains_key(*k)) {
                fresh.entry(k.canonical()).or_insert_with(|| k.clone());
            }
        }
        let mut born: Vec<u32> = Vec::new();
        for (canonical, key) in fresh {
            match ids.allocate(kind::LABELS, &canonical) {
                Ok(id) => {
                    self.out
                        .set_identity(id, Some(identity_name(kind::LABELS, &canonical)));
                    self.ns_idents
                        .entry(key.namespace.clone())
                        .or_default()
                        .insert(id);
                    self.key_ids.insert(key.clone(), id);
                    self.idents.insert(
                        id,
                        Ident {
                            key,
                            pods: BTreeSet::new(),
                            endpoints: BTreeSet::new(),
                            ips: BTreeSet::new(),
                        },
                    );
                    born.push(id);
                }
                Err(e) => self.identity_errors.push(e.into()),
            }
        }

        // 5. Move pods between identities.
        let mut touched_ids: BTreeSet<u32> = BTreeSet::new();
        let mut ips_changed: BTreeSet<u32> = BTreeSet::new();
        let mut ip_refresh: BTreeSet<IpAddr> = ips_touched;
        let mut now_endpoint: Vec<(PodRef, bool)> = Vec::with_capacity(deltas.len());
        for d in deltas {
            let old_held = self.pod_held.remove(&d.pod).unwrap_or_default();
            if let Some(old) = self.pod_ident.remove(&d.pod)
                && let Some(ident) = self.idents.get_mut(&old)
            {
                ident.pods.remove(&d.pod);
                ident.endpoints.remove(&d.pod);
                for ip in &old_held {
                    if ident.ips.remove(ip) {
                        ips_changed.insert(old);
                    }
                }
                touched_ids.insert(old);
            }
            ip_refresh.extend(old_held.iter().copied());
            ip_refresh.extend(d.held.iter().copied());
            let new_id = d.key.as_ref().and_then(|k| self.key_ids.get(k).copied());
            let endpoint = new_id.is_some() && d.local && !d.held.is_empty();
            if let Some(id) = new_id
                && let Some(ident) = self.idents.get_mut(&id)
            {
                ident.pods.insert(d.pod.clone());
                if endpoint {
                    ident.endpoints.insert(d.pod.clone());
                }
                for ip in &d.held {
                    if ident.ips.insert(*ip) {
                        ips_changed.insert(id);
                    }
                }
                touched_ids.insert(id);
                self.pod_ident.insert(d.pod.clone(), id);
            }
            if endpoint {
                self.local_pods
                    .insert(d.pod.clone(), d.held.iter().copied().collect());
            } else {
                self.local_pods.remove(&d.pod);
            }
            if !d.held.is_empty() {
                self.pod_held.insert(d.pod.clone(), d.held);
            }
            now_endpoint.push((d.pod, endpoint));
        }
        let gone: Vec<u32> = touched_ids
            .iter()
            .copied()
            .filter(|id| self.idents.get(id).is_none_or(|i| i.pods.is_empty()))
            .collect();
        let (mut ep_gone, mut ep_born) = (Vec::new(), Vec::new());
        for id in &touched_ids {
            let was = self.endpoint_ids.contains(id);
            let now = self.idents.get(id).is_some_and(|i| !i.endpoints.is_empty());
            if was && !now {
                ep_gone.push(*id);
            } else if now && !was {
                ep_born.push(*id);
            }
        }

        // 6a. Endpoint identities that lost their last local pod.
        for e in ep_gone {
            self.out.remove_endpoint_identity(e);
            self.endpoint_ids.remove(&e);
        }
        // 6b. Identities that lost their last pod, as peers.
        for x in &gone {
            self.forget_identity(*x, ids);
        }
        // 6c. Identities whose addresses moved: ipBlock-dependent members.
        for x in ips_changed
            .iter()
            .filter(|x| !gone.contains(x) && !born.contains(x))
        {
            self.recheck_member(*x);
        }
        // 6d. New identities: selection and membership; keys for existing
        // endpoints (new endpoints get all their keys in 6e).
        for x in &born {
            self.introduce_identity(*x);
        }
        // 6e. Endpoint identities that gained their first local pod.
        for e in ep_born {
            self.endpoint_ids.insert(e);
            self.write_endpoint_keys(e);
        }

        // 7. Endpoint entries (refresh_endpoints skips non-endpoints; the
        // new endpoint identities are among the touched ones).
        let mut refresh = touched_ids;
        refresh.append(&mut self.flags_dirty);
        for (pod, endpoint) in &now_endpoint {
            if !endpoint {
                self.out.set_endpoint(pod, None);
            }
        }
        self.refresh_endpoints(refresh);

        // 8. Addresses.
        for ip in ip_refresh {
            let entry = self.ipcache_entry(ip);
            self.out.set_ipcache(host_net(ip), entry);
        }
    }

    fn forget_identity(&mut self, x: u32, ids: &mut IdentityAllocator) {
        let Self {
            policies,
            idents,
            out,
            endpoint_ids,
            ..
        } = self;
        for ps in policies.values_mut() {
            ps.selected.remove(&x);
            for (rule, rs) in ps.parsed.rules.iter().zip(ps.rules.iter_mut()) {
                if let Some(bits) = rs.members.remove(&x) {
                    for e in ps.selected.iter().filter(|e| endpoint_ids.contains(e)) {
                        write_member(out, idents, rule, None, *e, x, bits, false);
                    }
                }
            }
        }
        if let Some(ident) = self.idents.remove(&x) {
            self.key_ids.remove(&ident.key);
            if let Some(set) = self.ns_idents.get_mut(&ident.key.namespace) {
                set.remove(&x);
                if set.is_empty() {
                    self.ns_idents.remove(&ident.key.namespace);
                }
            }
        }
        ids.release(x);
        self.out.set_identity(x, None);
    }

    fn recheck_member(&mut self, x: u32) {
        let Self {
            policies,
            idents,
            out,
            endpoint_ids,
            ..
        } = self;
        let Some(ident) = idents.get(&x) else { return };
        for ps in policies.values_mut() {
            for (rule, rs) in ps.parsed.rules.iter().zip(ps.rules.iter_mut()) {
                if !rs.ip_sensitive {
                    continue;
                }
                let new = member_bits(rule, rs, ident);
                let old = rs.members.get(&x).copied().unwrap_or(0);
                if new == old {
                    continue;
                }
                for e in ps.selected.iter().filter(|e| endpoint_ids.contains(e)) {
                    if old != 0 {
                        write_member(out, idents, rule, None, *e, x, old, false);
                    }
                    if new != 0 {
                        write_member(out, idents, rule, None, *e, x, new, true);
                    }
                }
                if new == 0 {
                    rs.members.remove(&x);
                } else {
                    rs.members.insert(x, new);
                }
            }
        }
    }

    fn introduce_identity(&mut self, x: u32) {
        let Self {
            policies,
            idents,
            out,
            endpoint_ids,
            ..
        } = self;
        let Some(ident) = idents.get(&x) else { return };
        for ps in policies.values_mut() {
            if ps.parsed.selects(&ident.key.namespace, &ident.key.labels) {
                ps.selected.insert(x);
            }
            for (rule, rs) in ps.parsed.rules.iter().zip(ps.rules.iter_mut()) {
                let bits = member_bits(rule, rs, ident);
                if bits == 0 {
                    continue;
                }
                rs.members.insert(x, bits);
                for e in ps.selected.iter().filter(|e| endpoint_ids.contains(e)) {
                    write_member(out, idents, rule, None, *e, x, bits, true);
                }
            }
        }
    }

    fn write_endpoint_keys(&mut self, e: u32) {
        let Some(ident) = self.idents.get(&e) else {
            return;
        };
        for ps in policies_selecting(&self.policies, &ident.key.namespace, e) {
            for (rule, rs) in ps.parsed.rules.iter().zip(&ps.rules) {
                write_rule(&mut self.out, &self.idents, rule, rs, e, true);
            }
        }
    }

    /// The compiled map content.
    pub fn maps(&self) -> &MapState<PodRef> {
        &self.out.maps
    }

    /// The addresses of each local endpoint pod.
    pub fn local_pods(&self) -> &BTreeMap<PodRef, Vec<IpAddr>> {
        &self.local_pods
    }

    /// Every problem found, policies in name order.
    pub fn errors(&self) -> Vec<PolicyError> {
        self.policies
            .values()
            .flat_map(|p| p.parsed.errors.iter().cloned())
            .chain(self.identity_errors.iter().cloned())
            .collect()
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
        }
    }
}
