//! Every test that runs anywhere, without privileges: the semantics of
//! the compiler and `explain`, property tests against an evaluator
//! written from the API text, the fuzzer, bad input, the iptables
//! renderings and the deploy manifests. One test binary, a module per
//! concern, the helpers in `support`. Run by plain `cargo test`.
//!
//! What needs root and a kernel is the testbed's `privileged` suite.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic with context, keeping the backtrace"
)]

mod bad_input;
mod cluster_policy;
mod deploy;
mod flows;
mod iptables_golden;
mod properties;
mod semantics;
mod services;
mod staged;
mod support;
