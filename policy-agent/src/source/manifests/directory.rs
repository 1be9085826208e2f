//! The directory as a merged cluster state, kept file by file: each
//! file's objects are kept converted (as the compiler reads them), only
//! files whose size or mtime moved are read again, and the changes are the
//! keyed difference of the objects those files held before and hold now.
//! An object defined in several files comes from the first file by name
//! (the others are reported), as `apply` does.
//!
//! Bad input is not a deletion. A file that cannot be read, has a YAML
//! syntax error (the documents after it are lost) or holds a document of a
//! supported kind that does not decode keeps every object it held before
//! and no longer yields, until it reads cleanly: a deletion made in the same
//! edit lands once the file is fixed. A NetworkPolicy that stops decoding
//! keeps its last good version; a new one is a fail-closed stand-in (see
//! `load.rs`). Each case is reported on the file or the document. A
//! directory that cannot be listed changes nothing.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use tracing::warn;

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::load::{Fallback, LoadedManifests, ManifestError, is_manifest, load_file};
use crate::cluster::{
    Change, ClusterNetworkPolicy, ClusterState, EndpointSliceInfo, Keyed, NamespaceInfo, NodeInfo,
    ObjectRef, PodInfo, Problem, ServiceInfo, Subject, keyed_changes,
};

type Stamp = (u64, Option<SystemTime>);

/// One file's objects, converted.
#[derive(Default)]
struct FileContent {
    /// None: read again on every refresh (it could not be read).
    stamp: Option<Stamp>,
    namespaces: BTreeMap<String, NamespaceInfo>,
    pods: BTreeMap<ObjectRef, PodInfo>,
    policies: BTreeMap<ObjectRef, Arc<NetworkPolicy>>,
    cluster_policies: BTreeMap<String, Arc<ClusterNetworkPolicy>>,
    nodes: BTreeMap<String, NodeInfo>,
    services: BTreeMap<ObjectRef, ServiceInfo>,
    slices: BTreeMap<ObjectRef, EndpointSliceInfo>,
    /// Policies held as fail-closed stand-ins: no version of them decoded.
    stand_ins: BTreeSet<ObjectRef>,
    problems: Vec<Problem>,
}

impl FileContent {
    /// Takes over from `old` what this (unsettled) read no longer yields,
    /// and the last good version of every policy this read only has a
    /// stand-in for. Returns what was kept, by kind and name.
    fn keep_from(&mut self, old: &FileContent) -> Vec<(&'static str, ObjectRef)> {
        let mut kept = Vec::new();
        let replaceable: Vec<ObjectRef> = self
            .stand_ins
            .iter()
            .filter(|k| old.policies.contains_key(*k) && !old.stand_ins.contains(*k))
            .cloned()
            .collect();
        for key in replaceable {
            if let Some(p) = old.policies.get(&key) {
                self.policies.insert(key.clone(), p.clone());
                self.stand_ins.remove(&key);
                kept.push(("NetworkPolicy", key));
            }
        }
        for (name, ns) in &old.namespaces {
            if !self.namespaces.contains_key(name) {
                self.namespaces.insert(name.clone(), ns.clone());
                kept.push(("Namespace", ObjectRef::new("", name.clone())));
            }
        }
        for (key, pod) in &old.pods {
            if !self.pods.contains_key(key) {
                self.pods.insert(key.clone(), pod.clone());
                kept.push(("Pod", key.clone()));
            }
        }
        for (name, node) in &old.nodes {
            if !self.nodes.contains_key(name) {
                self.nodes.insert(name.clone(), node.clone());
                kept.push(("Node", ObjectRef::new("", name.clone())));
            }
        }
        for (name, cnp) in &old.cluster_policies {
            if !self.cluster_policies.contains_key(name) {
                self.cluster_policies.insert(name.clone(), cnp.clone());
                kept.push(("ClusterNetworkPolicy", ObjectRef::new("", name.clone())));
            }
        }
        keep_missing(&mut self.services, &old.services, "Service", &mut kept);
        keep_missing(&mut self.slices, &old.slices, "EndpointSlice", &mut kept);
        for (key, policy) in &old.policies {
            if !self.policies.contains_key(key) {
                self.policies.insert(key.clone(), policy.clone());
                if old.stand_ins.contains(key) {
                    self.stand_ins.insert(key.clone());
                }
                kept.push(("NetworkPolicy", key.clone()));
            }
        }
        kept
    }
}

/// Takes over from `old` the objects `new` no longer has.
fn keep_missing<V: Clone>(
    new: &mut BTreeMap<ObjectRef, V>,
    old: &BTreeMap<ObjectRef, V>,
    kind: &'static str,
    kept: &mut Vec<(&'static str, ObjectRef)>,
) {
    for (key, v) in old {
        if !new.contains_key(key) {
            new.insert(key.clone(), v.clone());
            kept.push((kind, key.clone()));
        }
    }
}

/// Reads `files` (path, stamp, what it held), in order. Many files (a
/// start, a restart) are parsed on every CPU: parsing is most of a
/// restart's time at 10,000 pods, and the files are independent.
fn read_files(files: &[(&PathBuf, Option<Stamp>, FileContent)]) -> Vec<FileContent> {
    let one =
        |(path, stamp, old): &(&PathBuf, Option<Stamp>, FileContent)| read_file(path, *stamp, old);
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(files.len() / PARSE_FILES_PER_THREAD);
    if threads < 2 {
        return files.iter().map(one).collect();
    }
    let chunk = files.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let workers: Vec<_> = files
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(one).collect::<Vec<_>>()))
            .collect();
        workers
            .into_iter()
            .flat_map(|w| match w.join() {
                Ok(read) => read,
                // A parser that panicked: the panic goes on, as it would
                // have in this thread.
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

/// Files below which one more parsing thread is not worth starting.
const PARSE_FILES_PER_THREAD: usize = 4;

/// Reads `path` (listed with `stamp`) after it held `old`.
fn read_file(path: &Path, stamp: Option<Stamp>, old: &FileContent) -> FileContent {
    let mut loaded = LoadedManifests::default();
    load_file(path, &mut loaded);
    // Conversion (and duplicates within the file) as `apply` does it.
    let state = loaded.cluster_state("", Vec::new());
    let explicit: BTreeSet<String> = loaded
        .namespaces
        .iter()
        .filter_map(|(_, n)| n.metadata.name.clone())
        .collect();
    let unreadable = loaded
        .errors
        .iter()
        .any(|e| matches!(e, ManifestError::Read { .. }));
    let mut content = FileContent {
        // An unreadable file is tried again next time: making it readable
        // (chmod) moves neither its size nor its mtime.
        stamp: stamp.filter(|_| !unreadable),
        // Only namespaces the file defines: implied ones are not objects.
        namespaces: state
            .namespaces
            .into_iter()
            .filter(|(k, _)| explicit.contains(k))
            .collect(),
        pods: state.pods,
        policies: state.policies,
        cluster_policies: state.cluster_policies,
        nodes: state.nodes,
        services: state.services,
        slices: state.endpoint_slices,
        stand_ins: std::mem::take(&mut loaded.standing_in),
        problems: Vec::new(),
    };
    let mut problems = Vec::new();
    if loaded.errors.iter().any(ManifestError::unsettles_file) {
        let kept = content.keep_from(old);
        for e in &mut loaded.errors {
            if let ManifestError::Invalid {
                kind,
                key: Some(key),
                fallback,
                ..
            } = e
                && kept.iter().any(|(k, n)| k == kind && n == key)
            {
                *fallback = Fallback::LastGood;
            }
        }
        if !kept.is_empty() {
            problems.push(kept_problem(path, &kept));
        }
    }
    problems.splice(0..0, loaded.errors.iter().map(ManifestError::problem));
    content.problems = problems;
    content
}

/// The file-level report of objects kept as last read.
fn kept_problem(path: &Path, kept: &[(&'static str, ObjectRef)]) -> Problem {
    const SHOWN: usize = 8;
    let mut names: Vec<String> = kept
        .iter()
        .take(SHOWN)
        .map(|(kind, key)| {
            if key.namespace.is_empty() {
                format!("{kind} {}", key.name)
            } else {
                format!("{kind} {key}")
            }
        })
        .collect();
    if kept.len() > SHOWN {
        names.push(format!("and {} more", kept.len() - SHOWN));
    }
    Problem::new(
        Subject::Document {
            file: path.to_path_buf(),
            document: None,
        },
        format!(
            "not understood to its end: until it reads cleanly, {} object(s) it held before stay enforced as last read (nothing it held is deleted): {}",
            kept.len(),
            names.join(", ")
        ),
    )
}

/// The manifest files of `dir` and their stamps (None: listed but its
/// metadata cannot be read). Symlinks are followed, as `apply` does (a
/// ConfigMap volume is a directory of symlinks).
fn manifest_files(dir: &Path) -> std::io::Result<BTreeMap<PathBuf, Option<Stamp>>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if !is_manifest(&path) {
            continue;
        }
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => {
                out.insert(path, Some((m.len(), m.modified().ok())));
            }
            Ok(_) => {}
            // Listed but unreadable (a dangling link): not a deletion.
            Err(_) => {
                out.insert(path, None);
            }
        }
    }
    Ok(out)
}

/// The directory as a merged cluster state, updated file by file (the
/// watcher's state; public so tests can drive it edit by edit).
#[derive(Default)]
pub struct Directory {
    files: BTreeMap<PathBuf, FileContent>,
    merged: ClusterState,
    /// Set while the directory itself cannot be listed.
    listing: Option<Problem>,
    /// The problems last published.
    reported: Vec<Problem>,
}

/// The changes of one kind of object after `touched` files changed (each
/// with its old content): for every key those files held before or hold
/// now, its winner before (in `merged`) against its winner now.
/// A problem on each file that defines an object of `kind` a file before
/// it (in name order) already defined; `distinct` is how many different
/// objects of the kind the files hold.
fn duplicates<K: std::hash::Hash + Eq + std::fmt::Display, V>(
    files: &BTreeMap<PathBuf, FileContent>,
    kind: &str,
    field: impl Fn(&FileContent) -> &BTreeMap<K, V>,
    distinct: usize,
    out: &mut Vec<Problem>,
) {
    if files.values().map(|f| field(f).len()).sum::<usize>() == distinct {
        return;
    }
    let mut seen: std::collections::HashMap<&K, &Path> = std::collections::HashMap::new();
    for (path, f) in files {
        for key in field(f).keys() {
            match seen.entry(key) {
                std::collections::hash_map::Entry::Occupied(first) => out.push(Problem::new(
                    Subject::Document {
                        file: path.clone(),
                        document: None,
                    },
                    format!(
                        "{kind} {key} is defined again (first in {}); the first definition is used",
                        first.get().display()
                    ),
                )),
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(path);
                }
            }
        }
    }
}

fn merge_keys<V: Keyed>(
    files: &BTreeMap<PathBuf, FileContent>,
    touched: &[(PathBuf, FileContent)],
    field: impl Fn(&FileContent) -> &BTreeMap<V::Key, V>,
    merged: &BTreeMap<V::Key, V>,
    out: &mut Vec<Change>,
) {
    let keys: BTreeSet<&V::Key> = touched
        .iter()
        .flat_map(|(path, old)| {
            field(old)
                .keys()
                .chain(files.get(path).into_iter().flat_map(|f| field(f).keys()))
        })
        .collect();
    let before: BTreeMap<V::Key, V> = keys
        .iter()
        .filter_map(|k| merged.get(*k).map(|v| ((*k).clone(), v.clone())))
        .collect();
    // Files iterate in name order: the first definition wins. Each key
    // looked up in every file, or every object visited once, whichever
    // is less work: a first read touches every key, where looking each up
    // in 200 files was most of the time after the parse.
    let objects: usize = files.values().map(|f| field(f).len()).sum();
    let mut after: BTreeMap<V::Key, V> = BTreeMap::new();
    if keys.len().saturating_mul(files.len()) <= objects {
        for k in &keys {
            if let Some(v) = files.values().find_map(|f| field(f).get(*k)) {
                after.insert((*k).clone(), v.clone());
            }
        }
    } else {
        for (k, v) in files.values().flat_map(|f| field(f).iter()) {
            if keys.contains(k) && !after.contains_key(k) {
                after.insert(k.clone(), v.clone());
            }
        }
    }
    keyed_changes(&before, &after, out);
}

impl Directory {
    /// Re-reads what changed; returns the cluster changes and the current
    /// problems, or None when neither moved.
    pub fn refresh(&mut self, dir: &Path) -> Option<(Vec<Change>, Vec<Problem>)> {
        let now = match manifest_files(dir) {
            Ok(now) => {
                self.listing = None;
                now
            }
            Err(e) => {
                // Every file would look deleted: keep what was read.
                self.listing = Some(Problem::new(
                    Subject::Document {
                        file: dir.to_path_buf(),
                        document: None,
                    },
                    format!(
                        "cannot list the directory ({e}): everything read from it before stays enforced"
                    ),
                ));
                return self.publish(Vec::new());
            }
        };
        let mut touched: Vec<(PathBuf, FileContent)> = Vec::new();
        for path in self
            .files
            .keys()
            .filter(|k| !now.contains_key(*k))
            .cloned()
            .collect::<Vec<_>>()
        {
            if let Some(old) = self.files.remove(&path) {
                touched.push((path, old));
            }
        }
        let mut to_read: Vec<(&PathBuf, Option<Stamp>, FileContent)> = Vec::new();
        for (path, stamp) in &now {
            if stamp.is_some() && self.files.get(path).is_some_and(|f| f.stamp == *stamp) {
                continue;
            }
            let old = self.files.remove(path).unwrap_or_default();
            to_read.push((path, *stamp, old));
        }
        let t = std::time::Instant::now();
        let read = read_files(&to_read);
        if !to_read.is_empty() {
            tracing::debug!(
                files = to_read.len(),
                took_us = t.elapsed().as_micros() as u64,
                "manifest files read"
            );
        }
        for ((path, _, old), content) in to_read.into_iter().zip(read) {
            self.files.insert(path.clone(), content);
            touched.push((path.clone(), old));
        }
        let mut changes = Vec::new();
        let m = &self.merged;
        merge_keys(
            &self.files,
            &touched,
            |f| &f.namespaces,
            &m.namespaces,
            &mut changes,
        );
        merge_keys(&self.files, &touched, |f| &f.pods, &m.pods, &mut changes);
        merge_keys(
            &self.files,
            &touched,
            |f| &f.policies,
            &m.policies,
            &mut changes,
        );
        merge_keys(
            &self.files,
            &touched,
            |f| &f.cluster_policies,
            &m.cluster_policies,
            &mut changes,
        );
        merge_keys(&self.files, &touched, |f| &f.nodes, &m.nodes, &mut changes);
        merge_keys(
            &self.files,
            &touched,
            |f| &f.services,
            &m.services,
            &mut changes,
        );
        merge_keys(
            &self.files,
            &touched,
            |f| &f.slices,
            &m.endpoint_slices,
            &mut changes,
        );
        for change in &changes {
            self.merged.apply(change);
        }
        self.publish(changes)
    }

    /// The merged objects (node name and addresses unset).
    pub fn state(&self) -> &ClusterState {
        &self.merged
    }

    /// `changes` and the problems, unless both are as last published.
    fn publish(&mut self, changes: Vec<Change>) -> Option<(Vec<Change>, Vec<Problem>)> {
        let problems = self.problems();
        if changes.is_empty() && problems == self.reported {
            return None;
        }
        if problems != self.reported {
            for p in problems.iter().filter(|p| !self.reported.contains(p)) {
                warn!(problem = %p, "manifest");
            }
            self.reported = problems.clone();
        }
        Some((changes, problems))
    }

    fn problems(&self) -> Vec<Problem> {
        let mut out: Vec<Problem> = self.listing.iter().cloned().collect();
        out.extend(self.files.values().flat_map(|f| f.problems.iter().cloned()));
        // Objects defined in more than one file, kind by kind. This runs
        // on every re-read: a kind whose files hold as many objects as the
        // merge (which has each key once) has none, and is not scanned.
        let (files, m) = (&self.files, &self.merged);
        duplicates(
            files,
            "Namespace",
            |f| &f.namespaces,
            m.namespaces.len(),
            &mut out,
        );
        duplicates(files, "Pod", |f| &f.pods, m.pods.len(), &mut out);
        duplicates(
            files,
            "NetworkPolicy",
            |f| &f.policies,
            m.policies.len(),
            &mut out,
        );
        duplicates(
            files,
            "ClusterNetworkPolicy",
            |f| &f.cluster_policies,
            m.cluster_policies.len(),
            &mut out,
        );
        duplicates(files, "Node", |f| &f.nodes, m.nodes.len(), &mut out);
        duplicates(
            files,
            "Service",
            |f| &f.services,
            m.services.len(),
            &mut out,
        );
        duplicates(
            files,
            "EndpointSlice",
            |f| &f.slices,
            m.endpoint_slices.len(),
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn pod(name: &str, app: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: d, labels: {{app: {app}}}}}\nspec: {{containers: []}}\n---\n"
        )
    }

    #[test]
    fn only_the_changed_objects_become_changes_and_the_first_file_wins() {
        let dir =
            std::env::temp_dir().join(format!("policy-agent-manifests-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.yaml"), pod("p1", "x") + &pod("p2", "x")).unwrap();
        std::fs::write(dir.join("b.yaml"), pod("p2", "shadowed")).unwrap();
        let mut d = Directory::default();
        let (first, _) = d.refresh(&dir).unwrap();
        assert_eq!(first.len(), 2, "{first:?}");
        assert_eq!(d.merged.pods[&ObjectRef::new("d", "p2")].labels["app"], "x");
        assert!(
            d.problems()
                .iter()
                .any(|p| p.reason.contains("defined again"))
        );
        assert!(d.refresh(&dir).is_none(), "nothing changed");
        // p1 relabelled in a.yaml: one change; p2 leaves a.yaml: b.yaml's copy takes over.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.join("a.yaml"), pod("p1", "y") + "\n").unwrap();
        let (changes, _) = d.refresh(&dir).unwrap();
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert_eq!(
            d.merged.pods[&ObjectRef::new("d", "p2")].labels["app"],
            "shadowed"
        );
        assert!(
            !d.problems()
                .iter()
                .any(|p| p.reason.contains("defined again")),
            "each pod in one file again: no duplicate"
        );
        std::fs::remove_file(dir.join("b.yaml")).unwrap();
        let (changes, _) = d.refresh(&dir).unwrap();
        assert!(
            matches!(&changes[..], [Change::DeletePod(p)] if &*p.name == "p2"),
            "{changes:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The merge finds each key's first definition by visiting every
    /// object (a first read) or by looking the touched keys up file by file
    /// (a file rewritten among many): both keep the first file's.
    #[test]
    fn the_first_file_wins_whichever_way_the_merge_looks() {
        let dir = std::env::temp_dir().join(format!(
            "policy-agent-manifests-merge-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.yaml"), pod("p2", "x")).unwrap();
        std::fs::write(dir.join("b.yaml"), pod("p2", "shadowed")).unwrap();
        let many: String = (3..20).map(|i| pod(&format!("p{i}"), "m")).collect();
        std::fs::write(dir.join("c.yaml"), many).unwrap();
        let mut d = Directory::default();
        let (first, _) = d.refresh(&dir).unwrap();
        assert_eq!(first.len(), 18, "{first:?}");
        let p2 = ObjectRef::new("d", "p2");
        assert_eq!(d.merged.pods[&p2].labels["app"], "x");
        // b.yaml alone rewritten: p2 is the one key touched.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.join("b.yaml"), pod("p2", "shadowed-again")).unwrap();
        assert!(d.refresh(&dir).is_none_or(|(c, _)| c.is_empty()));
        assert_eq!(d.merged.pods[&p2].labels["app"], "x");
        // a.yaml's copy gone: b.yaml's takes over.
        std::fs::write(dir.join("a.yaml"), "\n").unwrap();
        let (changes, _) = d.refresh(&dir).unwrap();
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(d.merged.pods[&p2].labels["app"], "shadowed-again");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn symlinked_files_are_read_as_apply_reads_them() {
        // A ConfigMap volume: every file a symlink into `..data`.
        let dir = std::env::temp_dir().join(format!(
            "policy-agent-manifests-links-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("..data")).unwrap();
        std::fs::write(dir.join("..data/pods.yaml"), pod("p1", "x")).unwrap();
        std::os::unix::fs::symlink("..data/pods.yaml", dir.join("pods.yaml")).unwrap();
        let mut d = Directory::default();
        let changes = d.refresh(&dir).map(|(c, _)| c).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(changes.len(), 1, "{changes:?}");
    }
}
