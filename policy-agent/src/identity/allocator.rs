//! Stable identity numbers.
//!
//! Rules:
//! - a key keeps its number while it is in use;
//! - new keys of one generation are allocated in sorted canonical order,
//!   each the lowest free number of its range, so the same input gives the
//!   same numbers;
//! - a released number is quarantined: released during generation `g`, it
//!   is free again only from generation `g + 2`. It was in the state of
//!   `g - 1`, is in neither `g` nor `g + 1`, so even if applying `g` failed
//!   half-way no map can still hold it when it means something else. If
//!   its own key comes back while it is quarantined, the key gets it back;
//! - numbers adopted from a previous run count as released at generation 0.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use policy_common::identity::{FIRST_CIDR, FIRST_LABEL, IdentityName, kind};

use crate::mapstate::identity_name;

/// Label identities end where address classes begin.
const LABEL_END: u32 = FIRST_CIDR;
/// Address classes use the rest of the 32-bit space.
const CIDR_END: u32 = u32::MAX;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("no free {} identity number left", kind_name(*.kind))]
    Exhausted { kind: u32 },
    #[error("identity kind {kind} cannot be allocated")]
    BadKind { kind: u32 },
}

fn kind_name(k: u32) -> &'static str {
    match k {
        kind::LABELS => "label",
        kind::CIDR => "address-class",
        _ => "reserved",
    }
}

/// A key as the allocator sees it: kind and canonical name (one string
/// shared by the live and by-number maps).
type Key = (u32, std::sync::Arc<str>);

#[derive(Clone, Debug)]
struct Quarantined {
    /// Generation during which the number was released.
    since: u64,
    /// The key it belonged to, when known (adopted numbers only know a hash).
    key: Option<Key>,
    /// (kind, name hash) for numbers adopted from pinned maps.
    adopted: Option<(u32, u64)>,
}

#[derive(Clone, Debug)]
struct Range {
    start: u32,
    end: u32,
    /// Every number at or above this one is free.
    next: u32,
    /// Free numbers below `next`.
    free: BTreeSet<u32>,
}

impl Range {
    fn new(start: u32, end: u32) -> Self {
        Self {
            start,
            end,
            next: start,
            free: BTreeSet::new(),
        }
    }

    fn contains(&self, n: u32) -> bool {
        (self.start..self.end).contains(&n)
    }

    fn take_lowest(&mut self) -> Option<u32> {
        if let Some(n) = self.free.pop_first() {
            return Some(n);
        }
        if self.next < self.end {
            let n = self.next;
            self.next += 1;
            return Some(n);
        }
        None
    }

    /// Marks `n` as not free (it is in use or quarantined).
    fn reserve(&mut self, n: u32) {
        if !self.contains(n) {
            return;
        }
        if n >= self.next {
            self.free.extend(self.next..n);
            self.next = n + 1;
        } else {
            self.free.remove(&n);
        }
    }

    fn give_back(&mut self, n: u32) {
        if self.contains(n) && n < self.next {
            self.free.insert(n);
        }
    }
}

/// Hands out label and address-class identity numbers.
#[derive(Clone, Debug)]
pub struct IdentityAllocator {
    live: HashMap<Key, u32>,
    by_id: BTreeMap<u32, Key>,
    quarantine: BTreeMap<u32, Quarantined>,
    /// Quarantined numbers by the key they belonged to.
    released: HashMap<Key, u32>,
    /// Unclaimed adopted numbers by (kind, name hash).
    adopted: HashMap<(u32, u64), u32>,
    labels: Range,
    cidrs: Range,
    generation: u64,
}

impl Default for IdentityAllocator {
    fn default() -> Self {
        Self::new()
    }
}

impl IdentityAllocator {
    pub fn new() -> Self {
        Self {
            live: HashMap::new(),
            by_id: BTreeMap::new(),
            quarantine: BTreeMap::new(),
            released: HashMap::new(),
            adopted: HashMap::new(),
            labels: Range::new(FIRST_LABEL, LABEL_END),
            cidrs: Range::new(FIRST_CIDR, CIDR_END),
            generation: 0,
        }
    }

    /// An allocator for an agent that finds `existing` (the pinned
    /// `IDENTITY_NAMES` content) and `in_use` (every number the pinned rows
    /// key or hold, [`crate::mapstate::MapState::identities_in_use`]) from
    /// an earlier run: a key whose name hash and kind match an entry gets
    /// that number back; every other number found stays quarantined, as if
    /// released now. A number in use without a name (names go first when
    /// the maps are full) is quarantined too: its rows survive until late
    /// in the first sync's write order, and a new key given it meanwhile
    /// would inherit their allows.
    pub fn adopt<N: std::borrow::Borrow<IdentityName>>(
        existing: &BTreeMap<u32, N>,
        in_use: &BTreeSet<u32>,
    ) -> Self {
        let mut a = Self::new();
        let unnamed = in_use.iter().filter(|id| !existing.contains_key(id));
        for &id in unnamed {
            if a.reserve_quarantined(id) {
                a.quarantine.insert(
                    id,
                    Quarantined {
                        since: 0,
                        key: None,
                        adopted: None,
                    },
                );
            }
        }
        for (&id, name) in existing {
            let name: &IdentityName = name.borrow();
            let range_ok = match name.kind {
                kind::LABELS => a.labels.contains(id),
                kind::CIDR => a.cidrs.contains(id),
                _ => false,
            };
            if !a.reserve_quarantined(id) {
                continue;
            }
            let hash_key = (name.kind, name.name_hash);
            let claimable = range_ok && !a.adopted.contains_key(&hash_key);
            if claimable {
                a.adopted.insert(hash_key, id);
            }
            a.quarantine.insert(
                id,
                Quarantined {
                    since: 0,
                    key: None,
                    adopted: claimable.then_some(hash_key),
                },
            );
        }
        a
    }

    /// Takes `id` out of the free numbers; false for a reserved number
    /// (never allocated anyway).
    fn reserve_quarantined(&mut self, id: u32) -> bool {
        if !self.labels.contains(id) && !self.cidrs.contains(id) {
            return false;
        }
        self.labels.reserve(id);
        self.cidrs.reserve(id);
        true
    }

    /// The number of `canonical` of `kind`, allocating one if the key is not
    /// in use: its own quarantined or adopted number if there is one, else
    /// the lowest free number of the kind's range.
    pub fn allocate(&mut self, kind: u32, canonical: &str) -> Result<u32, IdentityError> {
        let key: Key = (kind, canonical.into());
        if let Some(&id) = self.live.get(&key) {
            return Ok(id);
        }
        let range = match kind {
            kind::LABELS => &mut self.labels,
            kind::CIDR => &mut self.cidrs,
            _ => return Err(IdentityError::BadKind { kind }),
        };
        let id = if let Some(id) = self.released.remove(&key) {
            self.quarantine.remove(&id);
            id
        } else if let Some(id) = self
            .adopted
            .remove(&(kind, identity_name(kind, canonical).name_hash))
        {
            self.quarantine.remove(&id);
            id
        } else {
            range
                .take_lowest()
                .ok_or(IdentityError::Exhausted { kind })?
        };
        self.live.insert(key.clone(), id);
        self.by_id.insert(id, key);
        Ok(id)
    }

    /// Stops using `id`; it stays quarantined until two generations later.
    pub fn release(&mut self, id: u32) {
        let Some(key) = self.by_id.remove(&id) else {
            return;
        };
        self.live.remove(&key);
        self.released.insert(key.clone(), id);
        self.quarantine.insert(
            id,
            Quarantined {
                since: self.generation,
                key: Some(key),
                adopted: None,
            },
        );
    }

    /// Releases every number in use whose key `keep` rejects.
    pub fn release_unless(&mut self, mut keep: impl FnMut(u32, u32, &str) -> bool) {
        let drop: Vec<u32> = self
            .by_id
            .iter()
            .filter(|(id, (k, n))| !keep(**id, *k, n))
            .map(|(id, _)| *id)
            .collect();
        for id in drop {
            self.release(id);
        }
    }

    /// Ends a generation: numbers released two generations ago become free.
    pub fn end_generation(&mut self) {
        self.generation += 1;
        let now = self.generation;
        let expired: Vec<u32> = self
            .quarantine
            .iter()
            .filter(|(_, q)| q.since + 2 <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let Some(q) = self.quarantine.remove(&id) else {
                continue;
            };
            if let Some(key) = q.key {
                self.released.remove(&key);
            }
            if let Some(hash_key) = q.adopted {
                self.adopted.remove(&hash_key);
            }
            self.labels.give_back(id);
            self.cidrs.give_back(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_keys_same_numbers_and_lowest_first() {
        let mut a = IdentityAllocator::new();
        assert_eq!(a.allocate(kind::LABELS, "a").unwrap(), FIRST_LABEL);
        assert_eq!(a.allocate(kind::LABELS, "b").unwrap(), FIRST_LABEL + 1);
        assert_eq!(a.allocate(kind::LABELS, "a").unwrap(), FIRST_LABEL);
        assert_eq!(a.allocate(kind::CIDR, "10.0.0.0/8").unwrap(), FIRST_CIDR);
        assert!(a.allocate(kind::RESERVED, "x").is_err());
    }

    #[test]
    fn released_number_is_not_reused_for_two_generations() {
        let mut a = IdentityAllocator::new();
        let x = a.allocate(kind::LABELS, "x").unwrap();
        a.end_generation();
        a.release(x);
        let y = a.allocate(kind::LABELS, "y").unwrap();
        assert_ne!(x, y);
        a.end_generation();
        let z = a.allocate(kind::LABELS, "z").unwrap();
        assert_ne!(x, z);
        a.end_generation();
        // Two generations after its release the number is free again.
        assert_eq!(a.allocate(kind::LABELS, "w").unwrap(), x);
    }

    #[test]
    fn a_key_that_comes_back_gets_its_quarantined_number() {
        let mut a = IdentityAllocator::new();
        let x = a.allocate(kind::LABELS, "x").unwrap();
        a.release(x);
        a.end_generation();
        assert_eq!(a.allocate(kind::LABELS, "x").unwrap(), x);
    }

    #[test]
    fn adopt_matches_by_hash_and_quarantines_the_rest() {
        let mut pinned = BTreeMap::new();
        pinned.insert(FIRST_LABEL + 7, identity_name(kind::LABELS, "web"));
        pinned.insert(FIRST_LABEL, identity_name(kind::LABELS, "gone"));
        pinned.insert(FIRST_CIDR + 3, identity_name(kind::CIDR, "10.0.0.0/8"));
        let mut a = IdentityAllocator::adopt(&pinned, &BTreeSet::new());
        assert_eq!(a.allocate(kind::LABELS, "web").unwrap(), FIRST_LABEL + 7);
        assert_eq!(
            a.allocate(kind::CIDR, "10.0.0.0/8").unwrap(),
            FIRST_CIDR + 3
        );
        // "gone"'s number stays quarantined: a new key gets a fresh one.
        let n = a.allocate(kind::LABELS, "new").unwrap();
        assert!(n != FIRST_LABEL && n != FIRST_LABEL + 7);
        a.end_generation();
        a.end_generation();
        assert_eq!(a.allocate(kind::LABELS, "later").unwrap(), FIRST_LABEL);
    }

    #[test]
    fn adopted_name_of_the_wrong_kind_is_not_claimed() {
        let mut pinned = BTreeMap::new();
        pinned.insert(FIRST_LABEL + 1, identity_name(kind::CIDR, "10.0.0.0/8"));
        let mut a = IdentityAllocator::adopt(&pinned, &BTreeSet::new());
        assert_eq!(a.allocate(kind::CIDR, "10.0.0.0/8").unwrap(), FIRST_CIDR);
        assert_eq!(a.allocate(kind::LABELS, "x").unwrap(), FIRST_LABEL);
        assert_eq!(a.allocate(kind::LABELS, "y").unwrap(), FIRST_LABEL + 2);
    }

    #[test]
    fn a_number_still_in_the_maps_without_a_name_is_not_handed_out() {
        // 256 and 258 are named; 257's name was dropped (a full map) while
        // a POLICY row still keys it, and the class 2^24 + 1 survives only
        // in an ipcache value.
        let mut pinned = BTreeMap::new();
        pinned.insert(FIRST_LABEL, identity_name(kind::LABELS, "db"));
        pinned.insert(FIRST_LABEL + 2, identity_name(kind::LABELS, "api"));
        let in_use = BTreeSet::from([0, FIRST_LABEL, FIRST_LABEL + 1, FIRST_CIDR + 1]);
        let mut a = IdentityAllocator::adopt(&pinned, &in_use);
        assert_eq!(a.allocate(kind::LABELS, "db").unwrap(), FIRST_LABEL);
        let fresh = a.allocate(kind::LABELS, "new").unwrap();
        assert_ne!(fresh, FIRST_LABEL + 1, "a number POLICY still keys");
        assert_eq!(fresh, FIRST_LABEL + 3);
        let class = a.allocate(kind::CIDR, "10.0.0.0/8").unwrap();
        assert_eq!(class, FIRST_CIDR, "the lowest class is free");
        assert_ne!(
            a.allocate(kind::CIDR, "10.1.0.0/16").unwrap(),
            FIRST_CIDR + 1
        );
        // Quarantined like any adopted number: free after two generations.
        a.end_generation();
        a.end_generation();
        assert_eq!(a.allocate(kind::LABELS, "later").unwrap(), FIRST_LABEL + 1);
    }
}
