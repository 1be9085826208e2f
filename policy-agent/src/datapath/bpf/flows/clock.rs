//! Record timestamps (CLOCK_MONOTONIC, what `bpf_ktime_get_coarse_ns` reads, to a tick) as
//! wall-clock time.

/// The offset between the wall clock and the monotonic clock, read once:
/// a later step of the wall clock does not move records already named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WallClock {
    offset_ns: i128,
}

fn now_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write into; both clocks always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// CLOCK_MONOTONIC now, in ns: what records are stamped with.
pub fn monotonic_ns() -> u64 {
    u64::try_from(now_ns(libc::CLOCK_MONOTONIC)).unwrap_or(0)
}

impl WallClock {
    pub fn now() -> Self {
        let mono = now_ns(libc::CLOCK_MONOTONIC);
        let real = now_ns(libc::CLOCK_REALTIME);
        Self {
            offset_ns: real - mono,
        }
    }

    /// A clock with a given offset (tests).
    pub const fn with_offset(offset_ns: i128) -> Self {
        Self { offset_ns }
    }

    /// `monotonic_ns` as RFC 3339 UTC, to the microsecond.
    pub fn rfc3339(&self, monotonic_ns: u64) -> String {
        rfc3339(i128::from(monotonic_ns) + self.offset_ns)
    }
}

/// Nanoseconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub fn rfc3339(unix_ns: i128) -> String {
    let secs = unix_ns.div_euclid(1_000_000_000);
    let micros = unix_ns.rem_euclid(1_000_000_000) / 1000;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(z: i128) -> (i128, i128, i128) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000000Z");
        // 2024-02-29T12:34:56.789012Z
        let ns = 1_709_210_096_789_012_345_i128;
        assert_eq!(rfc3339(ns), "2024-02-29T12:34:56.789012Z");
        let clock = WallClock::with_offset(1_000_000_000);
        assert_eq!(clock.rfc3339(500), "1970-01-01T00:00:01.000000Z");
    }
}
