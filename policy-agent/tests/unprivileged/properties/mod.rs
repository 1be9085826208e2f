//! Property tests over random clusters and policies.
mod fuzz;
mod incremental;
mod semantics;

/// The number of random cases: `default`, or `POLICY_PROPTEST_CASES` for
/// a longer soak (CI keeps the default).
pub fn cases(default: u32) -> u32 {
    std::env::var("POLICY_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
