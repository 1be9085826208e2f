//! Developer switches that rewrite what a test compares with
//! (UPDATE_GOLDEN) or narrow what it checks (DIFF_SEED) are for local
//! runs only: under CI they fail the test instead of making it pass.

/// Whether this is a CI run: CI systems set `CI` (GitHub Actions, GitLab,
/// Buildkite, ...); `cargo xtask test` refuses the switches itself.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// The value of a developer switch; panics if it is set under CI.
pub fn local_switch(name: &str) -> Option<String> {
    let value = std::env::var(name).ok()?;
    assert!(
        !under_ci(),
        "{name} is set under CI: it would rewrite or narrow what this test checks"
    );
    Some(value)
}
