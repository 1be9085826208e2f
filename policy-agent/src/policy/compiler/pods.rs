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
    claims::eligible,
    keys::{Write, write_member, write_rule},
    selection::{member_bits, policies_selecting},
};
use crate::{
    cluster::PodRef,
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
            self.index.endpoint_ids.insert(e);
            self.write_endpoint_keys(e);
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
    /// policy selects are rewritten.
    fn restate_identity(&mut self, x: u32, change: IdentityChange) {
        let Self {
            policies,
            index,
            out,
            ..
        } = self;
        let ident = index.idents.get(&x);
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
            for (rule, rs) in ps.parsed.rules.iter().zip(ps.rules.iter_mut()) {
                if change == IdentityChange::AddressesMoved && !rs.ip_sensitive {
                    continue;
                }
                let old = rs.members.get(&x).copied().unwrap_or(0);
                let new = match (change, ident) {
                    (IdentityChange::Gone, _) | (_, None) => 0,
                    (_, Some(i)) => member_bits(rule, rs, i),
                };
                if new == old {
                    continue;
                }
                for e in ps
                    .selected
                    .iter()
                    .filter(|e| index.endpoint_ids.contains(e))
                {
                    if old != 0 {
                        write_member(out, &index.idents, rule, None, *e, x, old, Write::Remove);
                    }
                    if new != 0 {
                        write_member(out, &index.idents, rule, None, *e, x, new, Write::Add);
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

    /// Every key of a new endpoint identity, from each policy selecting it.
    fn write_endpoint_keys(&mut self, e: u32) {
        let Some(ident) = self.index.idents.get(&e) else {
            return;
        };
        for ps in policies_selecting(&self.policies, &ident.key.namespace, e) {
            for (rule, rs) in ps.rules() {
                write_rule(&mut self.out, &self.index.idents, rule, rs, e, Write::Add);
            }
        }
    }
}
