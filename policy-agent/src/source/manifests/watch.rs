//! The manifest-directory source: inotify wakes it when a file is written,
//! moved in or removed (with a slow poll as a safety net); once the
//! directory has been quiet for the settle time it re-reads only the files
//! that changed and publishes what changed in the cluster.
use std::{
    os::fd::{AsRawFd, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

use super::directory::Directory;
use crate::source::{Sink, SourceId, SourceUpdate};

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
/// settled burst of file events, until `sink` is closed.
pub async fn watch(dir: PathBuf, settle: Duration, poll: Duration, sink: Sink) {
    let mut directory = Directory::default();
    // None: an empty directory, still the source's first word.
    let (changes, problems) = directory.refresh(&dir).unwrap_or_default();
    let first = SourceUpdate {
        source: SourceId::Manifests,
        changes,
        problems,
    };
    if !sink.send(first) {
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
        if let Some((changes, problems)) = directory.refresh(&dir) {
            let (count, read_us) = (changes.len(), t.elapsed().as_micros() as u64);
            let sent = sink.send(SourceUpdate {
                source: SourceId::Manifests,
                changes,
                problems,
            });
            // Logged once sent: a sync that began after this line has it.
            info!(dir = %dir.display(), changes = count, read_us, "manifests changed");
            if !sent {
                return;
            }
        }
    }
}
