//! What follows a pod change: claims settle, pods move between
//! identities, identities are born or gone, and only the keys and entries
//! involving those are rewritten.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use policy_common::identity::kind;

use super::{
    Compiler,
    admission::refuse,
    claims::eligible,
    keys::{Keys, Plan, write_member, write_rule},
    selection::member_bits,
};
use crate::{
    cluster::{PodRef, PolicyRef},
    identity::{IdentityAllocator, LabelKey},
    mapstate::identity_name,
};

/// What one touched pod is now.
struct PodNow {
    pod: PodRef,
    /// Its identity key (None: not eligible, no identity).
    key: Option<LabelKey>,
    /// The addresses it holds.
    held: BTreeSet<IpAddr>,
    local: bool,
}

/// What moving the touched pods did to the identities.
#[derive(Default)]
struct Moves {
    /// Identities that lost or gained a pod.
    touched: BTreeSet<u32>,
    /// Identities that lost or gained an address.
    addresses_moved: BTreeSet<u32>,
    /// Addresses whose ipcache entry may have changed.
    addresses: BTreeSet<IpAddr>,
    /// Pods that are no longer endpoints.
    not_endpoints: Vec<PodRef>,
}

/// How an identity changed, for [`Compiler::restate_identity`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IdentityChange {
    /// New: policies may select it, rules may reach it.
    Born,
    /// Its addresses moved: rules whose named ports depend on the
    /// addresses (ipBlock peers) may reach it or not.
    AddressesMoved,
    /// Its last pod went: nothing selects or reaches it any more.
    Gone,
}

impl Compiler {
    /// Brings everything that depends on `affected` pods up to date; their
    /// entries in `self.pods` and `self.namespaces` are already the new ones.
    pub(super) fn sync_pods(&mut self, affected: BTreeSet<PodRef>, ids: &mut IdentityAllocator) {
        // 1. Address claims, and who holds each touched address now.
        let claimed = affected.iter().map(|p| (p, self.pods.get(p)));
        let ips_touched = self.claims.reclaim(claimed, &self.node_ips);
        let mut touched = affected;
        touched.extend(self.claims.settle(&ips_touched));
        // 2. What each touched pod is now, and the identities first seen.
        let now = self.describe(&touched);
        let born = self.allocate_identities(&now, ids);
        // 3. Pods move between identities.
        let mut moves = self.move_pods(now);
        moves.addresses.extend(ips_touched);
        let gone: Vec<u32> = moves
            .touched
            .iter()
            .copied()
            .filter(|id| self.index.is_empty(*id))
            .collect();
        let (ep_gone, ep_born) = self.endpoint_transitions(&moves.touched);
        // 4. Keys: endpoint identities that lost their last local pod, then
        // identities gone as peers, those whose addresses moved, the new
        // ones (keys for existing endpoints), and last the new endpoint
        // identities (all their keys).
        for e in ep_gone {
            self.forget_endpoint(e);
            self.out.remove_endpoint_identity(e);
            self.index.endpoint_ids.remove(&e);
        }
        for x in &gone {
            self.restate_identity(*x, IdentityChange::Gone);
            self.index.remove(*x);
            ids.release(*x);
            self.out.set_identity(*x, None);
        }
        for x in moves
            .addresses_moved
            .iter()
            .filter(|x| !gone.contains(x) && !born.contains(x))
        {
            self.restate_identity(*x, IdentityChange::AddressesMoved);
        }
        for x in &born {
            self.restate_identity(*x, IdentityChange::Born);
        }
        for e in ep_born {
            // Written before it counts as an endpoint: a policy refused
            // meanwhile removes only the keys it wrote.
            self.write_endpoint_keys(e);
            self.index.endpoint_ids.insert(e);
        }
        // 5. Endpoint entries, then addresses.
        for pod in &moves.not_endpoints {
            self.out.set_endpoint(pod, None);
        }
        let mut refresh = std::mem::take(&mut moves.touched);
        refresh.append(&mut self.flags_dirty);
        self.refresh_endpoints(refresh);
        self.refresh_addresses(moves.addresses);
    }

    fn describe(&self, touched: &BTreeSet<PodRef>) -> Vec<PodNow> {
        touched
            .iter()
            .map(|pod| {
                let info = self.pods.get(pod).filter(|i| eligible(i));
                PodNow {
                    pod: pod.clone(),
                    key: info.map(|i| {
                        LabelKey::of_pod(&pod.namespace, &self.namespace_labels(&pod.namespace), i)
                    }),
                    held: self.claims.holding(pod),
                    local: info.is_some_and(|i| self.is_local(i)),
                }
            })
            .collect()
    }

    /// Numbers for identity keys not in use yet, in canonical order.
    fn allocate_identities(&mut self, now: &[PodNow], ids: &mut IdentityAllocator) -> Vec<u32> {
        let mut fresh: BTreeMap<String, LabelKey> = BTreeMap::new();
        for p in now {
            if let Some(k) = p.key.as_ref().filter(|k| self.index.id_of(k).is_none()) {
                fresh.entry(k.canonical()).or_insert_with(|| k.clone());
            }
        }
        let mut born = Vec::new();
        for (canonical, key) in fresh {
            match ids.allocate(kind::LABELS, &canonical) {
                Ok(id) => {
                    self.out
                        .set_identity(id, Some(identity_name(kind::LABELS, &canonical)));
                    self.index.insert(id, key);
                    born.push(id);
                }
                Err(e) => self.identity_errors.push(e),
            }
        }
        born
    }

    fn move_pods(&mut self, now: Vec<PodNow>) -> Moves {
        let mut moves = Moves::default();
        for p in now {
            let joined = p.key.as_ref().and_then(|k| self.index.id_of(k));
            let endpoint = joined.is_some() && p.local && !p.held.is_empty();
            let old_held = self.claims.record_held(&p.pod, p.held.clone());
            let m = self
                .index
                .move_pod(&p.pod, joined, endpoint, &old_held, &p.held);
            for (id, addresses_moved) in
                [(m.left, m.left_lost_ips), (m.joined, m.joined_gained_ips)]
            {
                if let Some(id) = id {
                    moves.touched.insert(id);
                    if addresses_moved {
                        moves.addresses_moved.insert(id);
                    }
                }
            }
            moves.addresses.extend(old_held);
            moves.addresses.extend(p.held.iter().copied());
            if endpoint {
                self.local_pods
                    .insert(p.pod.clone(), p.held.iter().copied().collect());
            } else {
                self.local_pods.remove(&p.pod);
                moves.not_endpoints.push(p.pod);
            }
        }
        moves
    }

    /// Of the `touched` identities, those that stopped and those that
    /// started having local endpoint pods.
    fn endpoint_transitions(&self, touched: &BTreeSet<u32>) -> (Vec<u32>, Vec<u32>) {
        let (mut gone, mut born) = (Vec::new(), Vec::new());
        for id in touched {
            let was = self.index.endpoint_ids.contains(id);
            let now = self.index.has_endpoints(*id);
            if was && !now {
                gone.push(*id);
            } else if now && !was {
                born.push(*id);
            }
        }
        (gone, born)
    }

    /// The one walk over every rule of every policy when identity `x`
    /// changes: its selection is updated, each rule's member bits for `x`
    /// are recomputed, and where they moved the keys of every endpoint the
    /// policy selects are rewritten; what a policy gains is counted first,
    /// and a policy it would take past the budgets is refused instead.
    fn restate_identity(&mut self, x: u32, change: IdentityChange) {
        let budget = self.options.budget;
        let (policies, index, out, admitted) = self.key_parts();
        let ident = index.idents.get(&x);
        // Buffers reused from policy to policy: most are untouched.
        let mut moved: Vec<(usize, u8, u8)> = Vec::new();
        let mut endpoints: Vec<u32> = Vec::new();
        let mut gains: Vec<(usize, u8)> = Vec::new();
        let mut plan = Plan::new(0);
        for ps in policies.values_mut() {
            match (change, ident) {
                (IdentityChange::Gone, _) => {
                    ps.selected.remove(&x);
                }
                (IdentityChange::Born, Some(i))
                    if ps.parsed.selects(&i.key.namespace, &i.key.labels) =>
                {
                    ps.selected.insert(x);
                }
                _ => {}
            }
            if ps.refused.is_some() {
                continue;
            }
            moved.clear();
            for (i, (rule, rs)) in ps.parsed.rules.iter().zip(&ps.rules).enumerate() {
                if change == IdentityChange::AddressesMoved && !rs.ip_sensitive {
                    continue;
                }
                let old = rs.members.get(&x).copied().unwrap_or(0);
                let new = match (change, ident) {
                    (IdentityChange::Gone, _) | (_, None) => 0,
                    (_, Some(i)) => member_bits(rule, rs, i),
                };
                if new != old {
                    moved.push((i, old, new));
                }
            }
            if moved.is_empty() {
                continue;
            }
            endpoints.clear();
            endpoints.extend(
                ps.selected
                    .iter()
                    .copied()
                    .filter(|e| index.endpoint_ids.contains(e)),
            );
            // Losses at once; gains counted before they are written.
            gains.clear();
            for &(i, old, new) in &moved {
                if old != 0 {
                    for e in &endpoints {
                        let n = write_member(
                            &mut Keys::Remove(out),
                            &index.idents,
                            &ps.parsed.rules[i],
                            None,
                            *e,
                            x,
                            old,
                        );
                        ps.remove_keys(*e, n);
                        *admitted = admitted.saturating_sub(n);
                    }
                    ps.rules[i].members.remove(&x);
                    ps.members = ps.members.saturating_sub(1);
                    *admitted = admitted.saturating_sub(1);
                }
                if new != 0 {
                    gains.push((i, new));
                }
            }
            if gains.is_empty() {
                continue;
            }
            plan.reset(budget.per_policy.saturating_sub(ps.entries()));
            plan.tally.add(gains.len() as u64);
            'plan: for (i, bits) in &gains {
                for e in &endpoints {
                    if plan.tally.over() {
                        break 'plan;
                    }
                    write_member(
                        &mut Keys::Plan(&mut plan),
                        &index.idents,
                        &ps.parsed.rules[*i],
                        None,
                        *e,
                        x,
                        *bits,
                    );
                }
            }
            if let Some(why) = budget.refusal(ps.entries(), &plan.tally, *admitted) {
                let freed = refuse(ps, out, &index.idents, why);
                *admitted = admitted.saturating_sub(freed);
                continue;
            }
            *admitted = admitted.saturating_add(plan.tally.n);
            for &(i, bits) in &gains {
                ps.rules[i].members.insert(x, bits);
                ps.members += 1;
            }
            plan.commit(out, |e, n| ps.add_keys(e, n));
        }
    }

    /// Every key of a new endpoint identity, from each policy selecting it
    /// (counted first: a policy it would take past the budgets is refused).
    fn write_endpoint_keys(&mut self, e: u32) {
        let budget = self.options.budget;
        let (policies, index, out, admitted) = self.key_parts();
        let Some(ident) = index.idents.get(&e) else {
            return;
        };
        let ns = &*ident.key.namespace;
        let selecting = policies
            .range_mut(PolicyRef::new(ns, "")..)
            .take_while(|(k, _)| *k.namespace == *ns)
            .map(|(_, ps)| ps)
            .filter(|ps| ps.selected.contains(&e) && ps.refused.is_none());
        let mut plan = Plan::new(0);
        for ps in selecting {
            plan.reset(budget.per_policy.saturating_sub(ps.entries()));
            for (rule, rs) in ps.rules() {
                if plan.tally.over() {
                    break;
                }
                write_rule(&mut Keys::Plan(&mut plan), &index.idents, rule, rs, e);
            }
            if let Some(why) = budget.refusal(ps.entries(), &plan.tally, *admitted) {
                let freed = refuse(ps, out, &index.idents, why);
                *admitted = admitted.saturating_sub(freed);
                continue;
            }
            *admitted = admitted.saturating_add(plan.tally.n);
            plan.commit(out, |e, n| ps.add_keys(e, n));
        }
    }

    /// Endpoint identity `e` loses its keys at once: the policies that
    /// wrote them stop counting them.
    fn forget_endpoint(&mut self, e: u32) {
        let Some(ident) = self.index.idents.get(&e) else {
            return;
        };
        let ns = &*ident.key.namespace;
        for (_, ps) in self
            .policies
            .range_mut(PolicyRef::new(ns, "")..)
            .take_while(|(k, _)| *k.namespace == *ns)
        {
            let n = ps.forget_endpoint(e);
            if ps.refused.is_none() {
                self.admitted = self.admitted.saturating_sub(n);
            }
        }
    }
}
