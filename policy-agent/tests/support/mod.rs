//! Shared helpers for the kernel tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod ci;
pub mod conformance;
pub mod conformance_svc;
pub mod deadline;
pub mod fake_apiserver;
pub mod harness;
pub mod map_reset;
pub mod netfilter;
pub mod raw;
pub mod services;
pub mod tcx;
pub mod testns;
