//! The identity index: the label identities in use, the pods and local
//! endpoints behind each, and the addresses they hold.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use crate::{cluster::PodRef, identity::LabelKey};

/// A label identity in use.
#[derive(Clone, Debug)]
pub(super) struct Ident {
    pub key: LabelKey,
    /// Live pods with this identity.
    pub pods: BTreeSet<PodRef>,
    /// Of those, the local endpoints.
    pub endpoints: BTreeSet<PodRef>,
    /// Addresses these pods hold.
    pub ips: BTreeSet<IpAddr>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct IdentityIndex {
    pub idents: BTreeMap<u32, Ident>,
    key_ids: HashMap<LabelKey, u32>,
    by_namespace: BTreeMap<Arc<str>, BTreeSet<u32>>,
    pod_ident: BTreeMap<PodRef, u32>,
    /// Label identities with at least one local endpoint pod (whose keys
    /// are in the policy map).
    pub endpoint_ids: BTreeSet<u32>,
}

/// What moving one pod to its identity changed.
pub(super) struct PodMove {
    /// The identity the pod left, if any.
    pub left: Option<u32>,
    /// Whether that identity lost addresses.
    pub left_lost_ips: bool,
    /// The identity the pod joined, if any.
    pub joined: Option<u32>,
    /// Whether that identity gained addresses.
    pub joined_gained_ips: bool,
}

impl IdentityIndex {
    /// The identity of `key`, if one is in use.
    pub fn id_of(&self, key: &LabelKey) -> Option<u32> {
        self.key_ids.get(key).copied()
    }

    /// The identity `pod` has.
    pub fn of_pod(&self, pod: &PodRef) -> Option<u32> {
        self.pod_ident.get(pod).copied()
    }

    /// The label identities of pods in `namespace`.
    pub fn in_namespace(&self, namespace: &str) -> impl Iterator<Item = u32> + '_ {
        self.by_namespace
            .get(namespace)
            .into_iter()
            .flatten()
            .copied()
    }

    /// Registers a new identity (no pods yet).
    pub fn insert(&mut self, id: u32, key: LabelKey) {
        self.by_namespace
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
    }

    /// Removes an identity that has no pods left.
    pub fn remove(&mut self, id: u32) {
        let Some(ident) = self.idents.remove(&id) else {
            return;
        };
        self.key_ids.remove(&ident.key);
        if let Some(set) = self.by_namespace.get_mut(&*ident.key.namespace) {
            set.remove(&id);
            if set.is_empty() {
                self.by_namespace.remove(&*ident.key.namespace);
            }
        }
    }

    /// Moves `pod` from its identity to `joined` (None: it has none now),
    /// as an endpoint or not, holding `held` where it held `old_held`.
    pub fn move_pod(
        &mut self,
        pod: &PodRef,
        joined: Option<u32>,
        endpoint: bool,
        old_held: &BTreeSet<IpAddr>,
        held: &BTreeSet<IpAddr>,
    ) -> PodMove {
        let mut out = PodMove {
            left: None,
            left_lost_ips: false,
            joined: None,
            joined_gained_ips: false,
        };
        if let Some(old) = self.pod_ident.remove(pod)
            && let Some(ident) = self.idents.get_mut(&old)
        {
            ident.pods.remove(pod);
            ident.endpoints.remove(pod);
            for ip in old_held {
                out.left_lost_ips |= ident.ips.remove(ip);
            }
            out.left = Some(old);
        }
        if let Some(id) = joined
            && let Some(ident) = self.idents.get_mut(&id)
        {
            ident.pods.insert(pod.clone());
            if endpoint {
                ident.endpoints.insert(pod.clone());
            }
            for ip in held {
                out.joined_gained_ips |= ident.ips.insert(*ip);
            }
            self.pod_ident.insert(pod.clone(), id);
            out.joined = Some(id);
        }
        out
    }

    /// Whether identity `id` has local endpoint pods now.
    pub fn has_endpoints(&self, id: u32) -> bool {
        self.idents
            .get(&id)
            .is_some_and(|i| !i.endpoints.is_empty())
    }

    /// Whether identity `id` has no pods left (or is unknown).
    pub fn is_empty(&self, id: u32) -> bool {
        self.idents.get(&id).is_none_or(|i| i.pods.is_empty())
    }
}
