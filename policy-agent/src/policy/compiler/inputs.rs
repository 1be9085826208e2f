//! Changes of the compiler's inputs: each [`Change`] updates the stored
//! input and, unless a full rebuild is pending, what depends on it.
use std::{borrow::Cow, collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;

use super::{
    Compiler,
    keys::{Keys, write_rule},
    rule_names::policy_rule_keys,
    selection::PolicyState,
};
use crate::{
    cluster::{Change, Labels, PodInfo, PodRef, PolicyRef, normalized_ranges},
    identity::{IdentityAllocator, default_namespace_labels},
    policy::parse::ParsedPolicy,
};

impl Compiler {
    pub(super) fn apply_one(&mut self, change: Change, ids: &mut IdentityAllocator) {
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
            // Rare, and they may carve prefixes: compiled in full.
            Change::UpsertClusterPolicy(name, cnp) => {
                self.cluster_policies
                    .insert(name, super::ParsedClusterPolicy::parse(&cnp));
                self.rebuild_pending = true;
            }
            Change::DeleteClusterPolicy(name) => {
                if self.cluster_policies.remove(&name).is_some() {
                    self.rebuild_pending = true;
                }
            }
            // Node addresses carve classes only for `nodes` peers: a
            // change matters (compiled in full) only while one exists.
            Change::UpsertNodeObject(name, info) => {
                if self.nodes.get(&name) != Some(&info) {
                    self.nodes.insert(name, info);
                    self.rebuild_pending |= self.has_node_peers();
                }
            }
            Change::DeleteNodeObject(name) => {
                if self.nodes.remove(&name).is_some() {
                    self.rebuild_pending |= self.has_node_peers();
                }
            }
            Change::UpsertService(name, info) => {
                self.services.insert(name, info);
                if !self.rebuild_pending {
                    self.sync_frontends();
                }
            }
            Change::DeleteService(name) => {
                self.services.remove(&name);
                if !self.rebuild_pending {
                    self.sync_frontends();
                }
            }
            Change::UpsertEndpointSlice(name, info) => {
                self.endpoint_slices.insert(name, info);
            }
            Change::DeleteEndpointSlice(name) => {
                self.endpoint_slices.remove(&name);
            }
            Change::ServiceRanges(ranges) => {
                self.service_ranges = ranges.iter().map(IpNet::trunc).collect();
                if !self.rebuild_pending {
                    self.sync_frontends();
                }
            }
            Change::PodRanges(ranges) => self.pod_ranges = Some(normalized_ranges(ranges)),
            Change::Node { name, ips } => {
                let ips: BTreeSet<IpAddr> = ips.into_iter().collect();
                if name != self.node_name {
                    // Which pods are local changes: everything moves.
                    self.rebuild_pending = true;
                }
                if self.rebuild_pending {
                    self.node_name = name;
                    self.node_ips = ips;
                } else {
                    self.node_addresses_changed(ips, ids);
                }
            }
        }
    }

    /// The node's addresses changed (a CNI plugin putting a gateway address
    /// on each pod's host veth does this at every pod start): only the
    /// moved addresses, the pods claiming them and the NodePort frontends
    /// are restated, not the whole compile.
    fn node_addresses_changed(&mut self, ips: BTreeSet<IpAddr>, ids: &mut IdentityAllocator) {
        let moved: BTreeSet<IpAddr> = self.node_ips.symmetric_difference(&ips).copied().collect();
        if moved.is_empty() {
            return;
        }
        self.node_ips = ips;
        // A node address is never a pod's; one that stops being the node's
        // may go back to the pod claiming it.
        let affected: BTreeSet<PodRef> = self
            .pods
            .iter()
            .filter(|(_, info)| info.ips.iter().any(|ip| moved.contains(ip)))
            .map(|(pod, _)| pod.clone())
            .collect();
        self.sync_pods(affected, ids);
        self.refresh_addresses(moved);
        self.sync_frontends();
    }

    /// Every pod of `ns` may have a new identity (its namespace labels are
    /// part of it).
    fn namespace_changed(&mut self, ns: &str, ids: &mut IdentityAllocator) {
        if self.rebuild_pending {
            return;
        }
        let start = PodRef::new(ns, "");
        let affected: BTreeSet<PodRef> = self
            .pods
            .range(start..)
            .map(|(k, _)| k)
            .take_while(|k| *k.namespace == *ns)
            .cloned()
            .collect();
        self.sync_pods(affected, ids);
    }

    fn replace_policy(&mut self, name: &PolicyRef, new: Option<ParsedPolicy>) {
        let old = self.policies.get(name).map(|p| &p.parsed);
        if !self.rebuild_pending && self.carving.changes(old, new.as_ref()) {
            self.rebuild_pending = true;
        }
        if self.rebuild_pending {
            match new {
                Some(parsed) => self
                    .policies
                    .insert(name.clone(), PolicyState::unmatched(parsed)),
                None => self.policies.remove(name),
            };
            return;
        }
        // Its rules' names may change on a `rule_ref` collision.
        let renamed: Vec<_> = old
            .into_iter()
            .chain(new.as_ref())
            .flat_map(policy_rule_keys)
            .collect();
        self.out.mark_rules_dirty(renamed);
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
        for e in ps
            .selected
            .iter()
            .filter(|e| self.index.endpoint_ids.contains(e))
        {
            for (rule, rs) in ps.rules() {
                write_rule(
                    &mut Keys::Remove(&mut self.out),
                    &self.index.idents,
                    rule,
                    rs,
                    *e,
                );
            }
            self.flags_dirty.insert(*e);
        }
        if ps.refused.is_none() {
            self.admitted = self.admitted.saturating_sub(ps.entries());
        }
        self.carving.remove(&ps.parsed);
    }

    pub(super) fn namespace_labels(&self, ns: &str) -> Cow<'_, Labels> {
        match self.namespaces.get(ns) {
            Some(info) => Cow::Borrowed(&info.labels),
            None => Cow::Owned(default_namespace_labels(ns)),
        }
    }

    pub(super) fn is_local(&self, info: &PodInfo) -> bool {
        self.options.all_pods_local || info.node_name.as_deref() == Some(self.node_name.as_str())
    }
}
