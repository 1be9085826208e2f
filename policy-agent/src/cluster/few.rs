//! [`Few`]: a list that is almost always one value long, held in place.
//!
//! A pod's addresses and an address's claims are one value in all but a
//! dual-stack or handover moment; a vector of one cost an allocation (32
//! bytes) besides its own 24.
use std::{fmt, hash::Hash, ops::Deref};

/// Zero, one (in place) or more values; reads as a slice.
#[derive(Clone, Default)]
pub enum Few<T> {
    #[default]
    Empty,
    One(T),
    Many(Box<[T]>),
}

impl<T> Few<T> {
    /// The values in their order; one alone is held in place.
    pub fn from_vec(mut values: Vec<T>) -> Self {
        match values.len() {
            0 => Self::Empty,
            1 => values.pop().map_or(Self::Empty, Self::One),
            _ => Self::Many(values.into_boxed_slice()),
        }
    }

    pub fn as_slice(&self) -> &[T] {
        match self {
            Self::Empty => &[],
            Self::One(value) => std::slice::from_ref(value),
            Self::Many(values) => values,
        }
    }
}

impl<T: Ord + Clone> Few<T> {
    /// Adds `value` to a sorted `Few`, keeping it sorted and once each.
    pub fn insert_sorted(&mut self, value: T) {
        if let Err(at) = self.as_slice().binary_search(&value) {
            let mut values = self.as_slice().to_vec();
            values.insert(at, value);
            *self = Self::from_vec(values);
        }
    }

    /// Removes `value` from a sorted `Few`.
    pub fn remove_sorted(&mut self, value: &T) {
        if let Ok(at) = self.as_slice().binary_search(value) {
            let mut values = self.as_slice().to_vec();
            values.remove(at);
            *self = Self::from_vec(values);
        }
    }
}

impl<T> Deref for Few<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T> From<Vec<T>> for Few<T> {
    fn from(values: Vec<T>) -> Self {
        Self::from_vec(values)
    }
}

impl<T> FromIterator<T> for Few<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Self::from_vec(iter.into_iter().collect())
    }
}

impl<'a, T> IntoIterator for &'a Few<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// Equal when the values are (one in place equals a boxed list of one).
impl<T: PartialEq> PartialEq for Few<T> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: Eq> Eq for Few<T> {}

impl<T: Hash> Hash for Few<T> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

/// Printed as the list it is.
impl<T: fmt::Debug> fmt::Debug for Few<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::Few;

    #[test]
    fn a_few_values_stay_sorted_and_once_each_whichever_way_they_are_held() {
        let mut few = Few::default();
        assert!(few.is_empty());
        few.insert_sorted(3);
        assert!(matches!(few, Few::One(3)));
        few.insert_sorted(1);
        few.insert_sorted(3);
        few.insert_sorted(2);
        assert_eq!(few.as_slice(), &[1, 2, 3]);
        few.remove_sorted(&2);
        few.remove_sorted(&7);
        assert_eq!(few.as_slice(), &[1, 3]);
        few.remove_sorted(&1);
        assert!(matches!(few, Few::One(3)));
        few.remove_sorted(&3);
        assert!(few.is_empty());
        assert!(matches!(Few::from_vec(vec![5]), Few::One(5)));
        assert!(Few::<u8>::from_vec(vec![]).is_empty());
    }

    #[test]
    fn a_list_keeps_its_order_and_equals_the_same_values_held_either_way() {
        assert_eq!(Few::from_vec(vec![2, 1]).as_slice(), &[2, 1]);
        assert_eq!(Few::One(4), Few::Many(vec![4].into_boxed_slice()));
        assert_ne!(Few::One(4), Few::Empty);
        assert_eq!(format!("{:?}", Few::from_vec(vec![1, 2])), "[1, 2]");
    }
}
