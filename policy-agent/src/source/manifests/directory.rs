//! The directory as a merged cluster state, kept file by file: each
//! file's objects are kept converted (as the compiler reads them), only
//! files whose size or mtime moved are read again, and the changes are the
//! keyed difference of the objects those files held before and hold now.
//! An object defined in several files comes from the first file by name
//! (the others are reported), as `apply` does.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    time::SystemTime,
};

use tracing::warn;

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::load::{LoadedManifests, is_manifest, load_file};
use crate::cluster::{
    Change, ClusterState, Keyed, NamespaceInfo, ObjectRef, PodInfo, Problem, Subject, keyed_changes,
};

type Stamp = (u64, Option<SystemTime>);

/// One file's objects, converted.
#[derive(Default)]
struct FileContent {
    stamp: Option<Stamp>,
    namespaces: BTreeMap<String, NamespaceInfo>,
    pods: BTreeMap<ObjectRef, PodInfo>,
    policies: BTreeMap<ObjectRef, NetworkPolicy>,
    problems: Vec<Problem>,
}

fn read_file(path: &Path, stamp: Stamp) -> FileContent {
    let mut loaded = LoadedManifests::default();
    load_file(path, &mut loaded);
    // Conversion (and duplicates within the file) as `apply` does it.
    let state = loaded.cluster_state("", Vec::new());
    let explicit: BTreeSet<String> = loaded
        .namespaces
        .iter()
        .filter_map(|(_, n)| n.metadata.name.clone())
        .collect();
    FileContent {
        stamp: Some(stamp),
        // Only namespaces the file defines: implied ones are not objects.
        namespaces: state
            .namespaces
            .into_iter()
            .filter(|(k, _)| explicit.contains(k))
            .collect(),
        pods: state.pods,
        policies: state.policies,
        problems: loaded.errors.iter().map(|e| e.problem()).collect(),
    }
}

fn manifest_files(dir: &Path) -> BTreeMap<PathBuf, Stamp> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| is_manifest(&e.path()))
                .filter_map(|e| {
                    e.metadata()
                        .ok()
                        .filter(|m| m.is_file())
                        .map(|m| (e.path(), (m.len(), m.modified().ok())))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The directory as a merged cluster state, updated file by file.
#[derive(Default)]
pub(super) struct Directory {
    files: BTreeMap<PathBuf, FileContent>,
    merged: ClusterState,
}

/// The changes of one kind of object after `touched` files changed (each
/// with its old content): for every key those files held before or hold
/// now, its winner before (in `merged`) against its winner now.
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
    // Files iterate in name order: the first definition wins.
    let after: BTreeMap<V::Key, V> = keys
        .iter()
        .filter_map(|k| {
            files
                .values()
                .find_map(|f| field(f).get(*k))
                .map(|v| ((*k).clone(), v.clone()))
        })
        .collect();
    keyed_changes(&before, &after, out);
}

impl Directory {
    /// Re-reads what changed; returns the cluster changes (None when no
    /// file changed).
    pub(super) fn refresh(&mut self, dir: &Path) -> Option<Vec<Change>> {
        let now = manifest_files(dir);
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
        for (path, stamp) in &now {
            if self
                .files
                .get(path)
                .is_some_and(|f| f.stamp == Some(*stamp))
            {
                continue;
            }
            let content = read_file(path, *stamp);
            let old = self.files.insert(path.clone(), content).unwrap_or_default();
            touched.push((path.clone(), old));
        }
        if touched.is_empty() {
            return None;
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
        for change in &changes {
            self.merged.apply(change);
        }
        Some(changes)
    }

    pub(super) fn problems(&self) -> Vec<Problem> {
        let mut out: Vec<Problem> = self
            .files
            .values()
            .flat_map(|f| f.problems.iter().cloned())
            .collect();
        // Objects defined in more than one file.
        let mut seen: BTreeMap<String, &Path> = BTreeMap::new();
        for (path, f) in &self.files {
            let keys = f
                .namespaces
                .keys()
                .map(|k| format!("Namespace {k}"))
                .chain(f.pods.keys().map(|k| format!("Pod {k}")))
                .chain(f.policies.keys().map(|k| format!("NetworkPolicy {k}")));
            for key in keys {
                match seen.get(&key) {
                    Some(first) => out.push(Problem::new(
                        Subject::Document {
                            file: path.clone(),
                            document: None,
                        },
                        format!(
                            "{key} is defined again (first in {}); the first definition is used",
                            first.display()
                        ),
                    )),
                    None => {
                        seen.insert(key, path);
                    }
                }
            }
        }
        for p in &out {
            warn!(problem = %p, "manifest");
        }
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
        let first = d.refresh(&dir).unwrap();
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
        let changes = d.refresh(&dir).unwrap();
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert_eq!(
            d.merged.pods[&ObjectRef::new("d", "p2")].labels["app"],
            "shadowed"
        );
        std::fs::remove_file(dir.join("b.yaml")).unwrap();
        let changes = d.refresh(&dir).unwrap();
        assert!(
            matches!(&changes[..], [Change::DeletePod(p)] if p.name == "p2"),
            "{changes:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
