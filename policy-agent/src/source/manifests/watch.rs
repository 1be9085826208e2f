//! The manifest-directory source: inotify wakes it when a file is written,
//! moved in or removed (with a slow poll as a safety net). It re-reads only
//! the files that changed and publishes what changed in the cluster: at
//! once when every file the events name is complete (closed after writing,
//! moved in or removed), after the settle time's quiet while one is still
//! open for writing.
use std::{
    collections::BTreeSet,
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

/// Names inotify saw created or modified and not yet closed, moved or
/// removed: files a writer may still be filling.
#[derive(Default)]
struct Writing(BTreeSet<Vec<u8>>);

impl Writing {
    /// Folds one buffer of `struct inotify_event`s in, in order.
    fn fold(&mut self, mut buf: &[u8]) {
        const HEADER: usize = std::mem::size_of::<libc::inotify_event>();
        while buf.len() >= HEADER {
            // SAFETY: at least HEADER bytes; read_unaligned copes with any
            // alignment of the buffer.
            let event: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
            let end = (HEADER + event.len as usize).min(buf.len());
            let name = &buf[HEADER..end];
            let name = name.split(|b| *b == 0).next().unwrap_or_default().to_vec();
            buf = &buf[end..];
            if event.mask & libc::IN_ISDIR != 0 {
                continue;
            }
            if event.mask
                & (libc::IN_CLOSE_WRITE | libc::IN_MOVED_FROM | libc::IN_MOVED_TO | libc::IN_DELETE)
                != 0
            {
                self.0.remove(&name);
            } else if event.mask & (libc::IN_CREATE | libc::IN_MODIFY) != 0 {
                self.0.insert(name);
            }
            // A queue overflow loses names: treat it as a write in progress,
            // so the directory is read once quiet.
            if event.mask & libc::IN_Q_OVERFLOW != 0 {
                self.0.insert(Vec::new());
            }
        }
    }

    fn open(&self) -> bool {
        !self.0.is_empty()
    }
}

/// Waits for inotify events and folds every queued one into `writing`.
async fn next_events(fd: &AsyncFd<OwnedFd>, writing: &mut Writing) {
    loop {
        let Ok(mut guard) = fd.readable().await else {
            return;
        };
        let mut read_any = false;
        loop {
            let mut buf = [0u8; 4096];
            // SAFETY: buf is writable for its length.
            let n =
                unsafe { libc::read(fd.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else { break };
            if n == 0 {
                break;
            }
            writing.fold(&buf[..n]);
            read_any = true;
        }
        guard.clear_ready();
        if read_any {
            return;
        }
    }
}

/// Publishes the directory's state at start and its changes as file events
/// arrive (once no file they name is still open for writing), until
/// `sink` is closed.
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
    let mut writing = Writing::default();
    loop {
        match &notify {
            Some(fd) => {
                tokio::select! {
                    () = next_events(fd, &mut writing) => {
                        // A file still open for writing (an editor, a `cp`
                        // of many files) is read once it is closed or the
                        // directory is quiet, so a half-written file is not
                        // read; complete files are read at once.
                        while writing.open()
                            && tokio::time::timeout(settle, next_events(fd, &mut writing)).await.is_ok()
                        {}
                        writing = Writing::default();
                    }
                    () = tokio::time::sleep(safety_net) => {}
                }
            }
            None => tokio::time::sleep(safety_net).await,
        }
        let t = std::time::Instant::now();
        if let Some((changes, problems)) = directory.refresh(&dir) {
            // Logged before it is sent: the sync worker may take it (and
            // finish) before this thread runs again.
            info!(dir = %dir.display(), changes = changes.len(), read_us = t.elapsed().as_micros() as u64, "manifests changed");
            if !sink.send(SourceUpdate {
                source: SourceId::Manifests,
                changes,
                problems,
            }) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u32, name: &str) -> Vec<u8> {
        // Names are NUL-padded, as the kernel pads them.
        let mut padded = name.as_bytes().to_vec();
        padded.resize(name.len().div_ceil(16).max(1) * 16, 0);
        let header = libc::inotify_event {
            wd: 1,
            mask,
            cookie: 0,
            len: padded.len() as u32,
        };
        // SAFETY: a plain C struct viewed as its bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&header as *const libc::inotify_event).cast::<u8>(),
                std::mem::size_of::<libc::inotify_event>(),
            )
        };
        [bytes, &padded].concat()
    }

    #[test]
    fn a_file_is_open_from_its_creation_until_closed_moved_or_removed() {
        let mut writing = Writing::default();
        writing.fold(
            &[
                event(libc::IN_CREATE, "a.yaml"),
                event(libc::IN_MODIFY, "a.yaml"),
            ]
            .concat(),
        );
        assert!(writing.open(), "created and written, not closed");
        writing.fold(&event(libc::IN_CLOSE_WRITE, "a.yaml"));
        assert!(!writing.open(), "closed after writing");

        // Written to a temporary name and renamed in, as config managers do.
        writing.fold(
            &[
                event(libc::IN_CREATE, "a.tmp"),
                event(libc::IN_MODIFY, "a.tmp"),
                event(libc::IN_CLOSE_WRITE, "a.tmp"),
                event(libc::IN_MOVED_FROM, "a.tmp"),
                event(libc::IN_MOVED_TO, "a.yaml"),
            ]
            .concat(),
        );
        assert!(!writing.open());

        // One file still open among closed ones keeps the read waiting.
        writing.fold(
            &[
                event(libc::IN_MODIFY, "b.yaml"),
                event(libc::IN_CLOSE_WRITE, "c.yaml"),
            ]
            .concat(),
        );
        assert!(writing.open());
        writing.fold(&event(libc::IN_DELETE, "b.yaml"));
        assert!(!writing.open());

        // A directory made never closes; an overflow loses names.
        writing.fold(&event(libc::IN_CREATE | libc::IN_ISDIR, "sub"));
        assert!(!writing.open());
        writing.fold(&event(libc::IN_Q_OVERFLOW, ""));
        assert!(writing.open(), "after an overflow, wait for quiet");
    }
}
