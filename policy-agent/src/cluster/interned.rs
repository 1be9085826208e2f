//! Pod label sets and namespace names, shared. Every copy of a pod the
//! agent keeps (the source's, the merged state's, the hand-off's, the
//! compiler's) holds its labels by one pointer, and pods with the same
//! labels (the pods of one workload) hold one map: a cluster of 10,000
//! pods carries a few hundred distinct label sets. Every name of an object
//! in one namespace holds one string for the namespace; the pods of one
//! node, one for the node's name; the container ports of one name, one
//! for it; the pods of one workload, one list of container ports.
use std::{
    borrow::Borrow,
    collections::HashSet,
    hash::Hash,
    sync::{Arc, LazyLock, Mutex},
};

use super::{ContainerPort, Labels};

/// A pod's labels (see the module).
pub type PodLabels = Arc<Labels>;

/// A pod's container ports, sorted (see the module).
pub type PodPorts = Arc<[ContainerPort]>;

/// The values handed out, each held once. A value nothing holds any more
/// is dropped at the next sweep, which runs once the table has doubled
/// since the last one (so sweeping costs O(1) per value handed out).
struct Table<T: ?Sized> {
    values: HashSet<Arc<T>>,
    swept_at: usize,
}

impl<T: ?Sized + Hash + Eq> Table<T> {
    fn new() -> Self {
        Self {
            values: HashSet::new(),
            swept_at: 0,
        }
    }

    /// The shared value equal to `value`, made by `make` if there is none.
    fn share<Q>(&mut self, value: &Q, make: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        if let Some(shared) = self.values.get(value) {
            return Arc::clone(shared);
        }
        if self.values.len() >= 2 * self.swept_at.max(512) {
            self.values.retain(|v| Arc::strong_count(v) > 1);
            self.swept_at = self.values.len();
        }
        let shared = make();
        self.values.insert(Arc::clone(&shared));
        shared
    }
}

/// A table behind its lock, for a static.
pub struct Interner<T: ?Sized + Hash + Eq>(Mutex<Table<T>>);

impl<T: ?Sized + Hash + Eq> Default for Interner<T> {
    fn default() -> Self {
        Self(Mutex::new(Table::new()))
    }
}

impl<T: ?Sized + Hash + Eq> Interner<T> {
    /// The shared value equal to `value`, made by `make` if there is none.
    pub fn share<Q>(&self, value: &Q, make: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        // A panic elsewhere while holding the lock leaves the table whole
        // (every step of `Table::share` keeps it a valid set): keep using it.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .share(value, make)
    }
}

static LABEL_SETS: LazyLock<Interner<Labels>> = LazyLock::new(Interner::default);
static NAMESPACES: LazyLock<Interner<str>> = LazyLock::new(Interner::default);
static SHORT_NAMES: LazyLock<Interner<str>> = LazyLock::new(Interner::default);
static PORT_LISTS: LazyLock<Interner<[ContainerPort]>> = LazyLock::new(Interner::default);

/// The shared set equal to `labels`.
pub fn pod_labels(labels: Labels) -> PodLabels {
    label_set(&labels)
}

/// The shared set equal to `labels`, cloned only if there is none yet.
pub fn label_set(labels: &Labels) -> Arc<Labels> {
    LABEL_SETS.share(labels, || Arc::new(labels.clone()))
}

/// The shared string equal to `namespace`.
pub fn namespace_name(namespace: &str) -> Arc<str> {
    NAMESPACES.share(namespace, || Arc::from(namespace))
}

/// The shared list equal to `ports`.
pub fn pod_ports(ports: Vec<ContainerPort>) -> PodPorts {
    PORT_LISTS.share(ports.as_slice(), || Arc::from(ports.as_slice()))
}

/// The shared string equal to `name` (a node's, a container port's).
pub fn short_name(name: &str) -> Arc<str> {
    SHORT_NAMES.share(name, || Arc::from(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> Labels {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn equal_label_sets_share_one_map() {
        let a = pod_labels(labels(&[("app", "interned-web"), ("tier", "front")]));
        let b = pod_labels(labels(&[("tier", "front"), ("app", "interned-web")]));
        let c = pod_labels(labels(&[("app", "interned-db")]));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(a.get("app").map(String::as_str), Some("interned-web"));
    }

    #[test]
    fn equal_port_lists_share_one_list() {
        let port = |name: &str, port| ContainerPort {
            name: Some(short_name(name)),
            port,
            protocol: 6,
        };
        let a = pod_ports(vec![port("interned-http", 80), port("interned-m", 9100)]);
        let b = pod_ports(vec![port("interned-http", 80), port("interned-m", 9100)]);
        let c = pod_ports(vec![port("interned-http", 81)]);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(a[1].port, 9100);
    }

    #[test]
    fn equal_namespace_names_share_one_string() {
        let a = namespace_name("interned-shop");
        let b = namespace_name(&String::from("interned-shop"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "interned-shop");
    }

    #[test]
    fn a_value_nothing_holds_is_swept() {
        // Enough distinct values to pass a sweep, none of them kept.
        for i in 0..3000 {
            let _ = pod_labels(labels(&[("swept", &i.to_string())]));
            let _ = namespace_name(&format!("swept-{i}"));
        }
        let sets = LABEL_SETS.0.lock().unwrap();
        let left = sets
            .values
            .iter()
            .filter(|s| s.contains_key("swept"))
            .count();
        assert!(left < 3000, "{left} of 3000 unused sets kept");
        let names = NAMESPACES.0.lock().unwrap();
        let left = names
            .values
            .iter()
            .filter(|s| s.starts_with("swept-"))
            .count();
        assert!(left < 3000, "{left} of 3000 unused names kept");
    }
}
