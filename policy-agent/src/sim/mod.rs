//! A simulated node: a node network namespace and pods in their own
//! namespaces behind routed veths, as Calico wires them (a /32 and /128
//! route per pod interface, proxy ARP for the pods' 169.254.1.1 gateway).
//!
//! Used by the demo, the kernel end-to-end tests and the benchmarks (with
//! [`packet`], crafted frames for BPF_PROG_TEST_RUN); built only with the
//! `sim` feature, so it is no part of the agent a cluster runs. It only
//! ever creates, and sends traffic between, namespaces it made itself.
mod matrix;
mod netns;
mod node;
pub mod packet;
mod probe;
mod serve;

pub use self::{
    matrix::{Matrix, NODE_ROW, Target},
    netns::{NetNs, run},
    node::{NODE_V4, NODE_V6, PodNet, SimNode, SimPod, cleanup_prefix, pods_from_manifests},
    probe::{Outcome, Probe, Transport, connect, echo, matrix},
    serve::Servers,
};

/// Errors of the simulated node.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Command(#[from] crate::exec::CommandError),
    #[error("starting a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("entering network namespace {name}: {source}")]
    Enter {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sysctl {key} in {netns}: {source}")]
    Sysctl {
        netns: String,
        key: String,
        #[source]
        source: std::io::Error,
    },
    #[error("socket in {netns}: {source}")]
    Socket {
        netns: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}
