//! `policy-agent apply`: enforce a directory of manifests once.
use std::{path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use policy_agent::{
    datapath::bpf::LoadOptions,
    enforce::{self, Input, Problem},
    k8s, netlink,
};

use super::common::{DatapathArgs, PinArgs, print_problems};

#[derive(clap::Args)]
pub struct Args {
    /// Directory of *.yaml / *.yml manifests (Namespaces, Pods, NetworkPolicies).
    #[arg(long)]
    pub manifests: PathBuf,
    /// This node's name: pods with this spec.nodeName are enforced here.
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    #[command(flatten)]
    pub datapath: DatapathArgs,
    #[command(flatten)]
    pub pins: PinArgs,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut loaded = k8s::load_dir(&args.manifests);
    let node_ips = netlink::local_addresses().context("reading this node's addresses")?;
    let state = loaded.cluster_state(&args.node, node_ips);
    let mut problems: Vec<Problem> = loaded
        .errors
        .iter()
        .map(|e| Problem::manifest(e.to_string()))
        .collect();

    let opts = LoadOptions {
        force_netlink: args.datapath.force_netlink,
        ..Default::default()
    };
    let mut enforcer = enforce::open(
        args.datapath.datapath.into(),
        &args.pins.layout(),
        &opts,
        args.datapath.iptables_backend.into(),
    )
    .context("opening the datapath")?;
    let report = enforcer.sync(Input::State(&state)).context("enforcing")?;
    problems.extend(report.problems.iter().cloned());
    println!(
        "{}: enforcing {} local endpoint(s) on node {}: {} write(s){}{}",
        enforcer.name(),
        report.endpoints,
        args.node,
        report.writes,
        if report.attached.is_empty() {
            String::new()
        } else {
            format!(", attached {}", report.attached.join(" "))
        },
        if report.detached.is_empty() {
            String::new()
        } else {
            format!(", detached {}", report.detached.join(" "))
        },
    );
    print_problems(&problems);
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
