//! From cluster state to an enforcing datapath: compile, find the pods'
//! interfaces, write the minimal ordered diff, attach and detach.
mod bpf;
mod interfaces;
mod report;

pub use self::{
    bpf::BpfEnforcer,
    interfaces::{Interface, resolve_interfaces},
    report::{Problem, SyncReport, unready_local_pods},
};
