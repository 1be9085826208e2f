//! `policy-demo`: the example manifests enforced on a simulated two-node
//! cluster (one `policy-agent` per node, each with its own `--node`, and a
//! kube-proxy stand-in per node generated from the same manifests), with
//! the connectivity before and after: the pod-to-pod matrix across both
//! nodes, and connections through each Service's ClusterIPs with the
//! backend each one landed on.
//!
//! It runs the `policy-agent` binary beside it (`--agent` to choose
//! another), so the agent it shows is the one a cluster runs.
mod services;
mod simulated;

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "policy-demo",
    about = "Enforce manifests on a simulated two-node cluster (one policy-agent per node, \
             kube-proxy's rules for the Services) and show the connectivity, pod to pod and \
             through the Services, before and after. Needs root; creates and removes network \
             namespaces of its own."
)]
pub struct Args {
    /// Manifests: the pods (with spec.nodeName "node-1" or "node-2" and
    /// status.podIPs from 10.244.1.0/24 resp. 10.244.2.0/24), Services
    /// with their EndpointSlices, and the policies to enforce.
    #[arg(long, default_value = "examples")]
    pub manifests: PathBuf,
    /// Keep the simulated cluster and the enforcement in place (remove
    /// them later with `policy-demo --cleanup`).
    #[arg(long)]
    pub keep: bool,
    /// Remove what an earlier `--keep` (or an interrupted run) left.
    #[arg(long)]
    pub cleanup: bool,
    /// The agent binary each node runs (default: `policy-agent` beside
    /// this binary).
    #[arg(long, env = "POLICY_AGENT_BIN")]
    pub agent: Option<PathBuf>,
}

fn main() -> ExitCode {
    match simulated::run(Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
