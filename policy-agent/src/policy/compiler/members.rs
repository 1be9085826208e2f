//! The label identities one rule reaches, with their `SEL`/`NAMED` bits.
//!
//! Every rule of every policy holds one, so its size counts: two sorted
//! vectors side by side take 5 bytes an entry, where a `BTreeMap<u32, u8>`
//! built in key order took about 12 (half-full nodes). Lookups are a
//! binary search; an insert or removal moves the tail, at most a few
//! thousand identities.
use std::{iter::Zip, slice};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Members {
    ids: Vec<u32>,
    bits: Vec<u8>,
}

impl Members {
    pub fn get(&self, id: &u32) -> Option<&u8> {
        let at = self.ids.binary_search(id).ok()?;
        self.bits.get(at)
    }

    /// Sets `id`'s bits; returns what it had.
    pub fn insert(&mut self, id: u32, bits: u8) -> Option<u8> {
        match self.ids.binary_search(&id) {
            Ok(at) => Some(std::mem::replace(&mut self.bits[at], bits)),
            Err(at) => {
                self.ids.insert(at, id);
                self.bits.insert(at, bits);
                None
            }
        }
    }

    pub fn remove(&mut self, id: &u32) -> Option<u8> {
        let at = self.ids.binary_search(id).ok()?;
        self.ids.remove(at);
        Some(self.bits.remove(at))
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Gives back the room a build in one go left over.
    pub fn shrink_to_fit(&mut self) {
        self.ids.shrink_to_fit();
        self.bits.shrink_to_fit();
    }
}

impl<'a> IntoIterator for &'a Members {
    type Item = (&'a u32, &'a u8);
    type IntoIter = Zip<slice::Iter<'a, u32>, slice::Iter<'a, u8>>;

    /// In identity order.
    fn into_iter(self) -> Self::IntoIter {
        self.ids.iter().zip(self.bits.iter())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any sequence of inserts and removals leaves what a BTreeMap
        /// would hold, in the same order, with the same answers.
        #[test]
        fn behaves_as_a_sorted_map(ops in proptest::collection::vec((any::<bool>(), 0u32..64, any::<u8>()), 0..200)) {
            let mut members = Members::default();
            let mut model = BTreeMap::new();
            for (insert, id, bits) in ops {
                if insert {
                    prop_assert_eq!(members.insert(id, bits), model.insert(id, bits));
                } else {
                    prop_assert_eq!(members.remove(&id), model.remove(&id));
                }
                prop_assert_eq!(members.get(&id), model.get(&id));
                prop_assert_eq!(members.len(), model.len());
            }
            members.shrink_to_fit();
            let got: Vec<(u32, u8)> = members.into_iter().map(|(k, v)| (*k, *v)).collect();
            let want: Vec<(u32, u8)> = model.into_iter().collect();
            prop_assert_eq!(got, want);
        }
    }
}
