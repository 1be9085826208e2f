//! `policy-agent apply`: enforce a directory of manifests once.
use std::{path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use policy_agent::{
    datapath::bpf::LoadOptions,
    enforce::{BpfEnforcer, Problem, unready_local_pods},
    k8s, netlink,
};

use super::common::{DatapathChoice, PinArgs, print_problems};

#[derive(clap::Args)]
pub struct Args {
    /// Directory of *.yaml / *.yml manifests (Namespaces, Pods, NetworkPolicies).
    #[arg(long)]
    pub manifests: PathBuf,
    /// This node's name: pods with this spec.nodeName are enforced here.
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    #[arg(long, value_enum, default_value = "auto")]
    pub datapath: DatapathChoice,
    #[command(flatten)]
    pub pins: PinArgs,
    /// Attach with netlink clsact filters even where TCX is available.
    #[arg(long)]
    pub force_netlink: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut loaded = k8s::load_dir(&args.manifests);
    let node_ips = netlink::local_addresses().context("reading this node's addresses")?;
    let state = loaded.cluster_state(&args.node, node_ips);
    let mut problems: Vec<Problem> = loaded
        .errors
        .iter()
        .map(|e| Problem {
            object: "manifest".into(),
            reason: e.to_string(),
        })
        .collect();
    problems.extend(unready_local_pods(&state));

    if args.datapath == DatapathChoice::Iptables {
        anyhow::bail!("the iptables datapath is not available in this build");
    }
    let opts = LoadOptions {
        force_netlink: args.force_netlink,
        ..Default::default()
    };
    let mut enforcer =
        BpfEnforcer::open(&args.pins.layout(), &opts).context("opening the BPF datapath")?;
    let report = enforcer.sync(&state).context("enforcing")?;
    problems.extend(report.problems.iter().cloned());
    println!(
        "enforcing {} local endpoint(s) on node {}: {} map write(s){}{}",
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
