//! What the watchers know, kept as the compiler's plain values, and the
//! changes each watch event makes to it.
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use kube::{ResourceExt as _, runtime::watcher::Event};

use crate::cluster::{
    Change, ConvertError, Keyed, ObjectKind, ObjectRef, PodInfo, Problem, keyed_changes, pod_info,
};

/// A watched kind's objects, with the buffer of a re-list in progress.
pub(super) struct Store<V: Keyed> {
    live: BTreeMap<V::Key, V>,
    relist: Option<BTreeMap<V::Key, V>>,
    synced: bool,
}

impl<V: Keyed> Default for Store<V> {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            relist: None,
            synced: false,
        }
    }
}

impl<V: Keyed> Store<V> {
    /// Whether the first list has completed.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Applies one watch event, appending the changes it makes; true when
    /// a (re-)list completed.
    pub fn apply<K>(
        &mut self,
        event: Event<K>,
        mut convert: impl FnMut(&K) -> Option<(V::Key, V)>,
        out: &mut Vec<Change>,
    ) -> bool {
        match event {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(obj) => {
                if let (Some(buf), Some((k, v))) = (self.relist.as_mut(), convert(&obj)) {
                    buf.insert(k, v);
                }
                false
            }
            Event::InitDone => {
                if let Some(buf) = self.relist.take() {
                    keyed_changes(&self.live, &buf, out);
                    self.live = buf;
                }
                self.synced = true;
                true
            }
            Event::Apply(obj) => {
                // Status churn of objects whose policy-relevant part stayed
                // is no change.
                if let Some((k, v)) = convert(&obj)
                    && self.live.get(&k) != Some(&v)
                {
                    self.live.insert(k.clone(), v.clone());
                    out.push(V::upsert(k, v));
                }
                false
            }
            Event::Delete(obj) => {
                if let Some((k, _)) = convert(&obj)
                    && self.live.remove(&k).is_some()
                {
                    out.push(V::delete(k));
                }
                false
            }
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.live.len()
    }
}

fn object_ref<K: kube::Resource>(o: &K) -> ObjectRef {
    ObjectRef::new(o.namespace().unwrap_or_default(), o.name_any())
}

/// The conversion of one kind of object into the compiler's value.
pub(super) type Convert<K, V> = fn(&K) -> Result<(ObjectRef, V), ConvertError>;

/// Objects of a kind that can fail to convert (pods, Services, slices),
/// and a problem for each one that does. A problem lasts until the object
/// converts, is deleted, or is missing from a re-list.
pub(super) struct Converted<K, V: Keyed<Key = ObjectRef>> {
    pub store: Store<V>,
    kind: ObjectKind,
    convert: Convert<K, V>,
    problems: BTreeMap<ObjectRef, Problem>,
    /// Every object of the re-list in progress, convertible or not.
    relisted: BTreeSet<ObjectRef>,
}

impl<K: kube::Resource, V: Keyed<Key = ObjectRef>> Converted<K, V> {
    pub fn new(kind: ObjectKind, convert: Convert<K, V>) -> Self {
        Self {
            store: Store::default(),
            kind,
            convert,
            problems: BTreeMap::new(),
            relisted: BTreeSet::new(),
        }
    }

    /// As [`Store::apply`], keeping the conversion problems.
    pub fn apply(&mut self, event: Event<K>, out: &mut Vec<Change>) -> bool {
        let mut deleted = None;
        match &event {
            Event::Init => self.relisted.clear(),
            Event::InitApply(o) => {
                self.relisted.insert(object_ref(o));
            }
            Event::Delete(o) => deleted = Some(object_ref(o)),
            Event::InitDone | Event::Apply(_) => {}
        }
        let relist_done = matches!(event, Event::InitDone);
        let (problems, kind, convert) = (&mut self.problems, self.kind, self.convert);
        let relisted = self.store.apply(
            event,
            |o| match convert(o) {
                Ok((k, v)) => {
                    problems.remove(&k);
                    Some((k, v))
                }
                Err(err) => {
                    let k = object_ref(o);
                    problems.insert(k.clone(), Problem::object(kind, k, err.to_string()));
                    None
                }
            },
            out,
        );
        // After the store, whose conversion of a deleted object may report it.
        if let Some(k) = deleted {
            self.problems.remove(&k);
        }
        if relist_done {
            let listed = std::mem::take(&mut self.relisted);
            self.problems.retain(|k, _| listed.contains(k));
        }
        relisted
    }

    pub fn problems(&self) -> impl Iterator<Item = &Problem> {
        self.problems.values()
    }
}

/// The pods (every node's: remote pod addresses feed the ipcache).
pub(super) type Pods = Converted<Pod, PodInfo>;

impl Default for Pods {
    fn default() -> Self {
        Self::new(ObjectKind::Pod, pod_info)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use k8s_openapi::{api::core::v1::PodStatus, apimachinery::pkg::apis::meta::v1::ObjectMeta};

    use super::*;

    fn drop_changes(pods: &mut Pods, event: Event<Pod>) {
        changes(pods, event);
    }

    fn pod(name: &str, ip: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("a".into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                pod_ip: Some(ip.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn problem_pods(pods: &Pods) -> Vec<String> {
        pods.problems.keys().map(|k| k.to_string()).collect()
    }

    /// Applies `event` and returns the changes it made.
    fn changes(pods: &mut Pods, event: Event<Pod>) -> Vec<Change> {
        let mut out = Vec::new();
        pods.apply(event, &mut out);
        out
    }

    #[test]
    fn an_unchanged_pod_is_no_change() {
        let mut pods = Pods::default();
        let first = changes(&mut pods, Event::Apply(pod("p", "10.0.0.1")));
        assert!(matches!(&first[..], [Change::UpsertPod(..)]));
        let again = changes(&mut pods, Event::Apply(pod("p", "10.0.0.1")));
        assert!(again.is_empty());
        let moved = changes(&mut pods, Event::Apply(pod("p", "10.0.0.2")));
        assert!(matches!(&moved[..], [Change::UpsertPod(..)]));
    }

    #[test]
    fn a_relist_is_published_as_its_difference() {
        let mut pods = Pods::default();
        for event in [
            Event::Init,
            Event::InitApply(pod("a", "10.0.0.1")),
            Event::InitApply(pod("b", "10.0.0.2")),
        ] {
            assert!(changes(&mut pods, event).is_empty());
        }
        assert_eq!(changes(&mut pods, Event::InitDone).len(), 2);
        for event in [
            Event::Init,
            Event::InitApply(pod("a", "10.0.0.1")),
            Event::InitApply(pod("c", "10.0.0.3")),
        ] {
            assert!(changes(&mut pods, event).is_empty(), "buffered until done");
        }
        let diff = changes(&mut pods, Event::InitDone);
        assert!(
            matches!(&diff[..], [Change::UpsertPod(c, _), Change::DeletePod(b)] if &*c.name == "c" && &*b.name == "b"),
            "{diff:?}"
        );
    }

    #[test]
    fn a_pod_problem_lasts_until_the_pod_converts_or_goes_away() {
        let mut pods = Pods::default();
        drop_changes(&mut pods, Event::Apply(pod("bad", "not-an-ip")));
        assert_eq!(problem_pods(&pods), ["a/bad"]);
        drop_changes(&mut pods, Event::Apply(pod("bad", "10.0.0.9")));
        assert!(problem_pods(&pods).is_empty());

        drop_changes(&mut pods, Event::Apply(pod("bad", "not-an-ip")));
        assert_eq!(problem_pods(&pods), ["a/bad"]);
        drop_changes(&mut pods, Event::Delete(pod("bad", "not-an-ip")));
        assert!(problem_pods(&pods).is_empty());

        // Listed with a problem, then missing from the next re-list.
        for event in [
            Event::Init,
            Event::InitApply(pod("bad", "not-an-ip")),
            Event::InitDone,
        ] {
            drop_changes(&mut pods, event);
        }
        assert_eq!(problem_pods(&pods), ["a/bad"]);
        for event in [
            Event::Init,
            Event::InitApply(pod("good", "10.0.0.1")),
            Event::InitDone,
        ] {
            drop_changes(&mut pods, event);
        }
        assert!(problem_pods(&pods).is_empty());
        assert_eq!(pods.store.len(), 1);
    }
}
