//! `policy-agent render`: print the ipsets and chains the iptables
//! datapath would install, for review.
use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context as _, bail};
use policy_agent::{
    datapath::iptables::Backend,
    enforce::{Input, IptablesEnforcer},
    k8s, netlink,
};

use super::common::{DatapathChoice, print_problems};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub manifests: PathBuf,
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    #[arg(long, value_enum, default_value = "iptables")]
    pub datapath: DatapathChoice,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.datapath != DatapathChoice::Iptables {
        bail!(
            "render prints the iptables datapath's rules; for BPF, see `policy-agent dump` and `explain`"
        );
    }
    let mut loaded = k8s::load_dir(&args.manifests);
    let node_ips = netlink::local_addresses().context("reading this node's addresses")?;
    let state = loaded.cluster_state(&args.node, node_ips);
    for e in &loaded.errors {
        eprintln!("warning: {e}");
    }
    // Rendering needs no iptables tools: nothing is applied.
    let mut enforcer = IptablesEnforcer::unchecked(Backend::Auto);
    let (ruleset, problems, _) = enforcer.ruleset(Input::State(&state));
    print!("{}", ruleset.render_text());
    print_problems(&problems);
    Ok(ExitCode::SUCCESS)
}
