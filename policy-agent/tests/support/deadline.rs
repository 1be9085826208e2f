//! Deadlines that stretch on a slow machine.
//!
//! `POLICY_AGENT_TEST_TIME_SCALE` (a multiplier, default 1) lengthens every
//! deadline a test waits on: `cargo xtask test` sets it for the emulated
//! 6.1 guest, where everything runs 15–35 times slower than on the host.
//! Only how long a test waits changes, never what it asserts: a cell
//! expected closed is still one whose reply never came, now within a
//! longer wait.
use std::time::Duration;

/// The variable `cargo xtask test` sets in its guest.
pub const TIME_SCALE_VAR: &str = "POLICY_AGENT_TEST_TIME_SCALE";

/// The multiplier (at least 1; an unreadable value is an error, not 1).
pub fn time_scale() -> f64 {
    match std::env::var(TIME_SCALE_VAR) {
        Err(_) => 1.0,
        Ok(s) => {
            let f: f64 = s
                .parse()
                .unwrap_or_else(|_| panic!("{TIME_SCALE_VAR}={s}: expected a number"));
            assert!(f >= 1.0, "{TIME_SCALE_VAR}={s}: must be at least 1");
            f
        }
    }
}

/// `d` on this machine: `d` times [`time_scale`].
pub fn scaled(d: Duration) -> Duration {
    d.mul_f64(time_scale())
}
