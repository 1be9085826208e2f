//! Pod label sets, shared. Every copy of a pod the agent keeps (the
//! source's, the merged state's, the hand-off's, the compiler's) holds its
//! labels by one pointer, and pods with the same labels (the pods of one
//! workload) hold one map: a cluster of 10,000 pods carries a few hundred
//! distinct label sets.
use std::{
    collections::HashSet,
    sync::{Arc, LazyLock, Mutex},
};

use super::Labels;

/// A pod's labels (see the module).
pub type PodLabels = Arc<Labels>;

/// The label sets handed out, each held once. A set no pod holds any more
/// is dropped at the next sweep, which runs once the table has doubled
/// since the last one (so sweeping costs O(1) per set handed out).
#[derive(Default)]
struct Table {
    sets: HashSet<PodLabels>,
    swept_at: usize,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

/// The shared set equal to `labels`.
pub fn pod_labels(labels: Labels) -> PodLabels {
    // A panic elsewhere while holding the lock leaves the table whole
    // (every step below keeps it a valid set): keep using it.
    let mut table = TABLE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(shared) = table.sets.get(&labels) {
        return Arc::clone(shared);
    }
    if table.sets.len() >= 2 * table.swept_at.max(512) {
        table.sets.retain(|set| Arc::strong_count(set) > 1);
        table.swept_at = table.sets.len();
    }
    let shared = Arc::new(labels);
    table.sets.insert(Arc::clone(&shared));
    shared
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
    fn a_set_no_pod_holds_is_swept() {
        // Enough distinct sets to pass a sweep, none of them kept.
        for i in 0..3000 {
            let _ = pod_labels(labels(&[("swept", &i.to_string())]));
        }
        let table = TABLE.lock().unwrap();
        let left = table
            .sets
            .iter()
            .filter(|s| s.contains_key("swept"))
            .count();
        assert!(left < 3000, "{left} of 3000 unused sets kept");
    }
}
