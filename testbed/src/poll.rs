//! One `poll(2)` for the simulated servers and probes: which of the
//! given descriptors are ready.
use std::os::fd::RawFd;

/// Waits up to `timeout_ms` for any of `watch` (descriptor, `POLLIN` or
/// `POLLOUT`); returns, in `watch`'s order, whether each one is ready
/// (all false on a timeout or an interrupted call).
pub(crate) fn ready(watch: &[(RawFd, i16)], timeout_ms: i32) -> Vec<bool> {
    let mut fds: Vec<libc::pollfd> = watch
        .iter()
        .map(|(fd, events)| libc::pollfd {
            fd: *fd,
            events: *events,
            revents: 0,
        })
        .collect();
    // SAFETY: fds is a valid array of pollfd for the call's duration.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    fds.iter().map(|p| n > 0 && p.revents != 0).collect()
}

/// [`ready`] for reading: the descriptors of `fds` that are readable.
pub(crate) fn readable(fds: impl IntoIterator<Item = RawFd>, timeout_ms: i32) -> Vec<RawFd> {
    let watch: Vec<(RawFd, i16)> = fds.into_iter().map(|fd| (fd, libc::POLLIN)).collect();
    watch
        .iter()
        .zip(ready(&watch, timeout_ms))
        .filter(|(_, r)| *r)
        .map(|((fd, _), _)| *fd)
        .collect()
}
