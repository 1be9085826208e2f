//! Handing freed heap back to the system after a large sync.
//!
//! A first sync (and any sync that rewrites much of the maps) builds its
//! write plan, the re-keyed state and, at a start, the sources' parsed
//! objects, then frees them. glibc keeps freed memory resident for reuse;
//! at 10,000 pods that is some 7 MB the agent would hold for good, a
//! node's memory every other process could use. `malloc_trim` gives the
//! free pages back (about a millisecond at that size), so the resident
//! size after a start is what the agent keeps, not its peak.

/// Writes at or above which a sync counts as large.
const LARGE_SYNC_WRITES: usize = 1_000;

/// Whether a sync is worth a trim afterwards: the first one (a start,
/// whatever it wrote: a restart reads the maps back and diffs them), a
/// full pass over maps read back, or one that wrote many entries.
pub(super) fn worth_trimming(first: bool, full_pass: bool, writes: usize) -> bool {
    first || full_pass || writes >= LARGE_SYNC_WRITES
}

/// Returns free heap pages to the system (glibc only; elsewhere the
/// allocator keeps its own policy).
pub(super) fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let t = std::time::Instant::now();
        // SAFETY: malloc_trim only walks the allocator's own free lists;
        // no pointer of ours is involved.
        let released = unsafe { libc::malloc_trim(0) };
        tracing::debug!(
            released = released != 0,
            took_us = t.elapsed().as_micros() as u64,
            "freed heap returned to the system"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_large_syncs_are_trimmed() {
        assert!(worth_trimming(true, false, 0), "a start");
        assert!(
            worth_trimming(false, true, 0),
            "a full pass over maps read back"
        );
        assert!(worth_trimming(false, false, LARGE_SYNC_WRITES));
        assert!(!worth_trimming(false, false, LARGE_SYNC_WRITES - 1));
        assert!(!worth_trimming(false, false, 0));
    }
}
