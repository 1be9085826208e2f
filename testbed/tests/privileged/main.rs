//! Every test that needs root and a kernel: BPF programs loaded and run,
//! network namespaces, real traffic, iptables, the CNI plugins. One test
//! binary, a module per concern; the fixtures they share are in
//! `policy_testbed::fixtures`.
//!
//! Run by `cargo xtask test` on the host and, module by module, in the
//! Debian 12 6.1 guest (`xtask/src/test/guest.rs` lists which). Tests run
//! in parallel: each names its own namespaces, interfaces and pin
//! directory.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic with context, keeping the backtrace"
)]

mod attacker;
mod bad_input_daemon;
mod cluster_mode;
mod cluster_policy;
mod cluster_policy_kube;
mod cni;
mod conformance;
mod flow_audit;
mod flows;
mod full_maps;
mod http_limits;
mod identity_adoption;
mod iptables;
mod iptables_flow_log;
mod iptables_hardening;
mod kernel;
mod netns;
mod node_addresses;
mod pod_range_guard_netns;
mod policy_budget;
mod restart_verifies;
mod sctp;
mod services;
mod staged;
mod upgrade;
