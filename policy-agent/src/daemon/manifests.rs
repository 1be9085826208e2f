//! The manifest-directory source: polls for changes, waits until the files
//! stop changing, then publishes the new state.
use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use super::SourceState;
use crate::{enforce::Problem, k8s};

/// Names, sizes and mtimes of the manifest files: a change to any of them
/// is a change of the state.
fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| {
                    matches!(
                        e.path().extension().and_then(|x| x.to_str()),
                        Some("yaml" | "yml")
                    )
                })
                .filter_map(|e| {
                    e.metadata()
                        .ok()
                        .map(|m| (e.path(), m.len(), m.modified().ok()))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn load(dir: &Path, node: &str) -> SourceState {
    let mut loaded = k8s::load_dir(dir);
    let state = loaded.cluster_state(node, Vec::new());
    let problems: Vec<Problem> = loaded
        .errors
        .iter()
        .map(|e| Problem {
            object: "manifest".into(),
            reason: e.to_string(),
        })
        .collect();
    for p in &problems {
        warn!(problem = %p, "manifest");
    }
    SourceState { state, problems }
}

pub async fn watch(dir: PathBuf, node: String, poll: Duration, tx: UnboundedSender<SourceState>) {
    let mut published = fingerprint(&dir);
    if tx.send(load(&dir, &node)).is_err() {
        return;
    }
    let mut previous = published.clone();
    loop {
        tokio::time::sleep(poll).await;
        let now = fingerprint(&dir);
        // Publish once the directory stayed the same for one poll: an
        // editor's half-written file is never read.
        if now != published && now == previous {
            info!(dir = %dir.display(), "manifests changed");
            published = now.clone();
            if tx.send(load(&dir, &node)).is_err() {
                return;
            }
        }
        previous = now;
    }
}
