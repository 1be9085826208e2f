//! The classifier's clock: `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC to
//! a tick), read at most once per tick on each CPU.
//!
//! The coarse clock moves only when a tick updates the timekeeper, and a
//! tick moves `jiffies` first. `jiffies` is one load (the verifier inlines
//! `bpf_jiffies64`); the clock is a helper call that takes the
//! timekeeper's sequence lock, a twentieth of an established packet's
//! cost. So each CPU keeps its last reading with the `jiffies` it was
//! taken at, and reads again when `jiffies` has moved.
//!
//! A reading can be a tick behind (taken between a tick's `jiffies` and
//! its timekeeper update), never ahead: a flow's stamp is a tick older at
//! most, and a stamp another CPU wrote after it reads as live
//! (`CtEntry::is_live`).
use aya_ebpf::helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns};

/// One CPU's last reading (in its scratch).
#[repr(C)]
pub struct ClockCache {
    jiffies: u64,
    coarse_ns: u64,
}

/// Now, on the coarse clock.
#[inline(always)]
pub(super) fn coarse_now(cache: &mut ClockCache) -> u64 {
    // SAFETY: helpers without preconditions.
    let jiffies = unsafe { bpf_jiffies64() };
    if jiffies == cache.jiffies && cache.coarse_ns != 0 {
        return cache.coarse_ns;
    }
    // SAFETY: as above.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    cache.jiffies = jiffies;
    cache.coarse_ns = now;
    now
}
