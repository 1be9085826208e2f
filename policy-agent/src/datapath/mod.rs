//! Datapaths: where compiled policy is enforced.
pub mod bpf;
pub mod iptables;
