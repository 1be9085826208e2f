//! The manifest-directory source: inotify wakes it when a file is written,
//! moved in or removed (with a slow poll as a safety net); once the
//! directory has been quiet for the settle time it re-reads only the files
//! that changed and publishes what changed in the cluster as a delta.
//!
//! Each file's objects are kept converted (as the compiler reads them); an
//! object defined in several files comes from the first file by name (the
//! others are reported), as `apply` does.
use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsRawFd, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use tokio::{io::unix::AsyncFd, sync::mpsc::UnboundedSender};
use tracing::{info, warn};

use super::SourceUpdate;
use crate::{
    cluster::{ClusterState, NamespaceInfo, ObjectRef, PodInfo},
    enforce::Problem,
    k8s::manifests::{LoadedManifests, is_manifest, load_file},
    policy::Change,
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
        problems: loaded
            .errors
            .iter()
            .map(|e| Problem::manifest(e.to_string()))
            .collect(),
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
struct Directory {
    files: BTreeMap<PathBuf, FileContent>,
    merged: ClusterState,
}

/// Recomputes the winner of each key a changed file held before or holds
/// now (`touched`: each changed file with its old content).
fn merge_keys<K: Ord + Clone, V: Clone + PartialEq>(
    files: &BTreeMap<PathBuf, FileContent>,
    touched: &[(PathBuf, FileContent)],
    field: impl Fn(&FileContent) -> &BTreeMap<K, V>,
    merged: &mut BTreeMap<K, V>,
    upsert: impl Fn(K, V) -> Change,
    delete: impl Fn(K) -> Change,
    out: &mut Vec<Change>,
) {
    let keys: BTreeSet<K> = touched
        .iter()
        .flat_map(|(path, old)| {
            field(old)
                .keys()
                .chain(files.get(path).into_iter().flat_map(|f| field(f).keys()))
        })
        .cloned()
        .collect();
    for key in keys {
        // Files iterate in name order: the first definition wins.
        let winner = files.values().find_map(|f| field(f).get(&key));
        match (winner, merged.get(&key)) {
            (Some(v), Some(cur)) if v == cur => {}
            (Some(v), _) => {
                merged.insert(key.clone(), v.clone());
                out.push(upsert(key, v.clone()));
            }
            (None, Some(_)) => {
                merged.remove(&key);
                out.push(delete(key));
            }
            (None, None) => {}
        }
    }
}

impl Directory {
    /// Re-reads what changed; returns the cluster changes (None when no
    /// file changed).
    fn refresh(&mut self, dir: &Path) -> Option<Vec<Change>> {
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
        merge_keys(
            &self.files,
            &touched,
            |f| &f.namespaces,
            &mut self.merged.namespaces,
            Change::UpsertNamespace,
            Change::DeleteNamespace,
            &mut changes,
        );
        merge_keys(
            &self.files,
            &touched,
            |f| &f.pods,
            &mut self.merged.pods,
            Change::UpsertPod,
            Change::DeletePod,
            &mut changes,
        );
        merge_keys(
            &self.files,
            &touched,
            |f| &f.policies,
            &mut self.merged.policies,
            |k, v| Change::UpsertPolicy(k, Box::new(v)),
            Change::DeletePolicy,
            &mut changes,
        );
        Some(changes)
    }

    fn problems(&self) -> Vec<Problem> {
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
                    Some(first) => out.push(Problem::manifest(format!(
                        "{}: {key} is defined again (first in {}); the first definition is used",
                        path.display(),
                        first.display()
                    ))),
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

/// An inotify instance watching `dir`, or None where inotify is missing.
fn inotify(dir: &Path) -> Option<AsyncFd<OwnedFd>> {
    // SAFETY: plain syscalls; the fd is owned right away.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    let mask = libc::IN_CLOSE_WRITE
        | libc::IN_MOVED_TO
        | libc::IN_MOVED_FROM
        | libc::IN_DELETE
        | libc::IN_CREATE
        | libc::IN_MODIFY
        | libc::IN_ATTRIB;
    // SAFETY: valid fd and NUL-terminated path.
    if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) } < 0 {
        return None;
    }
    // SAFETY: the fd is an inotify instance this function owns and hands
    // to the AsyncFd; nothing else reads or closes it.
    unsafe { AsyncFd::register(fd) }.ok()
}

/// Waits for the next inotify event (draining what is queued).
async fn next_event(fd: &AsyncFd<OwnedFd>) {
    loop {
        let Ok(mut guard) = fd.readable().await else {
            return;
        };
        let mut buf = [0u8; 4096];
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::read(fd.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            return;
        }
        guard.clear_ready();
    }
}

/// Publishes the directory's state at start and its changes after every
/// settled burst of file events.
pub async fn watch(
    dir: PathBuf,
    node: String,
    settle: Duration,
    poll: Duration,
    tx: UnboundedSender<SourceUpdate>,
) {
    let mut directory = Directory::default();
    directory.refresh(&dir);
    let mut state = directory.merged.clone();
    state.node_name = node.clone();
    if tx
        .send(SourceUpdate::Snapshot {
            state,
            problems: directory.problems(),
        })
        .is_err()
    {
        return;
    }
    let notify = inotify(&dir);
    if notify.is_none() {
        warn!(dir = %dir.display(), "inotify unavailable; polling for changes");
    }
    // Without inotify the poll is the only trigger.
    let safety_net = if notify.is_some() {
        poll.max(Duration::from_secs(2))
    } else {
        poll
    };
    loop {
        match &notify {
            Some(fd) => {
                tokio::select! {
                    () = next_event(fd) => {
                        // Let a burst of writes (an editor, a `cp` of many
                        // files) settle, so a half-written file is never read.
                        while tokio::time::timeout(settle, next_event(fd)).await.is_ok() {}
                    }
                    () = tokio::time::sleep(safety_net) => {}
                }
            }
            None => tokio::time::sleep(safety_net).await,
        }
        let t = std::time::Instant::now();
        if let Some(changes) = directory.refresh(&dir) {
            info!(dir = %dir.display(), changes = changes.len(), read_us = t.elapsed().as_micros() as u64, "manifests changed");
            if tx
                .send(SourceUpdate::Delta {
                    changes,
                    problems: directory.problems(),
                })
                .is_err()
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
