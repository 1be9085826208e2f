//! A simulated node: a node network namespace and pods in their own
//! namespaces behind routed veths, as Calico wires them (a /32 and /128
//! route per pod interface, proxy ARP for the pods' 169.254.1.1 gateway).
//!
//! Used by the demo, the kernel end-to-end tests and the benchmarks (with
//! [`packet`], crafted frames for BPF_PROG_TEST_RUN); built only with the
//! `sim` feature, so it is no part of the agent a cluster runs. It only
//! ever creates, and sends traffic between, namespaces it made itself.
//!
//! For Services: [`SimCluster`] (two linked nodes), [`kube_proxy`] (a
//! kube-proxy stand-in per node, iptables or nftables mode),
//! [`manifests`] (Pods, Services and their EndpointSlices as YAML, one
//! source of truth for the agent and the stand-in), [`backend`] (servers
//! that answer with their pod's name, and a client counting who answered)
//! and [`dns`] (a kube-dns stand-in and a resolver).
pub mod backend;
mod cluster;
pub mod cni;
pub mod dns;
pub mod kube_proxy;
pub mod manifests;
mod matrix;
mod netns;
mod node;
pub mod packet;
mod poll;
mod probe;
mod serve;
mod through;

pub use self::{
    cluster::{
        CLUSTER_CIDR_V4, CLUSTER_CIDR_V6, ClusterNode, KubeProxies, SERVICE_CIDR_V4,
        SERVICE_CIDR_V6, SimCluster, UPLINK, node_ips, pod_cidrs, pod_ips,
    },
    matrix::{Cell, Matrix, NODE_ROW, Target, Verdict, Via},
    netns::{NetNs, run},
    node::{NODE_V4, NODE_V6, PodNet, SimNode, SimPod, cleanup_prefix, pods_from_manifests},
    probe::{Outcome, Probe, Sent, Transport, connect, echo, matrix, run_probes},
    serve::{Arrival, Arrivals, Servers},
    through::{Landed, through},
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
