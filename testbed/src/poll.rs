//! One `poll(2)` for the simulated servers and probes: which of the
//! given descriptors are ready.
use std::{os::fd::RawFd, time::Instant};

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

/// Drives many sockets at once until each is done or `deadline` passes:
/// every round polls what `wanted` names for each item still waiting
/// (its descriptor and `POLLIN` or `POLLOUT`; None: done), and `step`
/// moves each ready item on, taking it by value (`placeholder` stands in
/// meanwhile).
pub(crate) fn drive<S>(
    state: &mut [S],
    deadline: Instant,
    placeholder: impl Fn() -> S,
    wanted: impl Fn(&S) -> Option<(RawFd, i16)>,
    mut step: impl FnMut(S) -> S,
) {
    loop {
        let waiting: Vec<(usize, RawFd, i16)> = state
            .iter()
            .enumerate()
            .filter_map(|(i, s)| wanted(s).map(|(fd, ev)| (i, fd, ev)))
            .collect();
        let now = Instant::now();
        if waiting.is_empty() || now >= deadline {
            return;
        }
        let watch: Vec<(RawFd, i16)> = waiting.iter().map(|(_, fd, ev)| (*fd, *ev)).collect();
        let ms = (deadline - now).as_millis().clamp(1, 1000) as i32;
        for ((i, _, _), ready) in waiting.iter().zip(ready(&watch, ms)) {
            if ready {
                let item = std::mem::replace(&mut state[*i], placeholder());
                state[*i] = step(item);
            }
        }
    }
}
