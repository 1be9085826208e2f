//! `policy-agent demo`: the example manifests enforced on a simulated
//! two-node cluster (one agent per node, each with its own `--node`, and a
//! kube-proxy stand-in per node generated from the same manifests), with
//! the connectivity before and after: the pod-to-pod matrix across both
//! nodes, and connections through each Service's ClusterIPs with the
//! backend each one landed on.
use std::{path::PathBuf, process::ExitCode};

#[cfg(feature = "sim")]
mod services;
#[cfg(feature = "sim")]
mod simulated;

#[derive(clap::Args)]
pub struct Args {
    /// Manifests: the pods (with spec.nodeName "node-1" or "node-2" and
    /// status.podIPs from 10.244.1.0/24 resp. 10.244.2.0/24), Services
    /// with their EndpointSlices, and the policies to enforce.
    #[arg(long, default_value = "examples")]
    pub manifests: PathBuf,
    /// Keep the simulated cluster and the enforcement in place (remove
    /// them later with `policy-agent demo --cleanup`).
    #[arg(long)]
    pub keep: bool,
    /// Remove what an earlier `--keep` (or an interrupted run) left.
    #[arg(long)]
    pub cleanup: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    #[cfg(feature = "sim")]
    return simulated::run(args);
    #[cfg(not(feature = "sim"))]
    {
        let _ = args;
        anyhow::bail!(
            "this build has no simulated node; build with `--features sim` (as `cargo xtask demo` does)"
        )
    }
}
