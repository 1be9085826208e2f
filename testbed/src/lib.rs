//! The simulated cluster the agent is tested, benchmarked and
//! demonstrated on. Not part of the agent a cluster runs: the
//! `policy-agent` binary has none of this crate.
//!
//! A simulated node is a node network namespace and pods in their own
//! namespaces behind routed veths, as Calico wires them (a /32 and /128
//! route per pod interface, proxy ARP for the pods' 169.254.1.1 gateway).
//! It only ever creates, and sends traffic between, namespaces it made
//! itself.
//!
//! - the cluster: [`SimNode`], [`SimCluster`] (two linked nodes),
//!   [`kube_proxy`] (a kube-proxy stand-in per node, iptables, nftables or
//!   IPVS mode), [`dns`] (a kube-dns stand-in and a resolver),
//!   [`cni_runtime`] (a container runtime's CNI driver, for the real
//!   plugins), [`manifests`] (Pods, Services and their EndpointSlices as
//!   YAML, one source of truth for the agent and the stand-in);
//! - traffic: [`serve`] (servers with a capture of what arrived),
//!   [`backend`] (servers that answer with their pod's name, and a client
//!   counting who answered), [`connectivity`] (probes, many at once),
//!   [`matrix`] (who reaches whom), [`packet`] (crafted frames for
//!   BPF_PROG_TEST_RUN);
//! - [`fixtures`]: what the privileged tests and the benchmarks share
//!   (the BPF_PROG_TEST_RUN harness, the conformance fixture, the fake API
//!   server, ...);
//! - [`workspace_bins`]: the `policy-agent` and `policy-cni` binaries the
//!   testbed runs.
pub mod backend;
mod cluster;
pub mod cni_runtime;
pub mod connectivity;
pub mod dns;
pub mod fixtures;
pub mod kube_proxy;
pub mod manifests;
mod matrix;
mod netns;
mod node;
pub mod packet;
mod poll;
mod serve;
mod through;
pub mod tunnel;
pub mod workspace_bins;

pub use self::{
    cluster::{
        CLUSTER_CIDR_V4, CLUSTER_CIDR_V6, ClusterNode, KubeProxies, SERVICE_CIDR_V4,
        SERVICE_CIDR_V6, SimCluster, UPLINK, node_ips, pod_cidrs, pod_ips,
    },
    connectivity::{Outcome, Probe, Sent, Transport, connect, echo, matrix, run_probes},
    matrix::{Cell, Matrix, NODE_ROW, Target, Verdict, Via},
    netns::{NetNs, run},
    node::{NODE_V4, NODE_V6, PodNet, SimNode, SimPod, cleanup_prefix, pods_from_manifests},
    serve::{Arrival, Arrivals, Servers},
    through::{Landed, through},
};

/// Errors of the simulated node.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Command(#[from] policy_agent::exec::CommandError),
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
