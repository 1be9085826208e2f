//! `policy-agent render`: print the ipsets and chains the iptables
//! datapath would install, for review.
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use policy_agent::{
    datapath::{
        Desired,
        iptables::{Backend, IptablesDriver},
    },
    identity::IdentityAllocator,
    netlink,
    policy::{CompileOptions, Compiler},
    source,
};

use super::common::{DatapathChoice, ManifestsArg, NodeArg, print_problems};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub manifests: ManifestsArg,
    #[command(flatten)]
    pub node: NodeArg,
    #[arg(long, value_enum, default_value = "iptables")]
    pub datapath: DatapathChoice,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.datapath != DatapathChoice::Iptables {
        bail!(
            "render prints the iptables datapath's rules; for BPF, see `policy-agent dump` and `explain`"
        );
    }
    let mut loaded = source::manifests::load_dir(&args.manifests.manifests);
    let node_ips = netlink::local_addresses().context("reading this node's addresses")?;
    let state = loaded.cluster_state(&args.node.node, node_ips);
    for e in &loaded.errors {
        eprintln!("warning: {e}");
    }
    let compiler = Compiler::build(
        &state,
        &mut IdentityAllocator::new(),
        CompileOptions::default(),
    );
    let rules = compiler.rules();
    let desired = Desired {
        maps: compiler.maps(),
        local_pods: compiler.local_pods(),
        rules: &rules,
    };
    // Rendering needs no iptables tools: nothing is applied.
    let (ruleset, mut problems, _) = IptablesDriver::unchecked(Backend::Auto).ruleset(&desired);
    problems.splice(0..0, compiler.problems());
    print!("{}", ruleset.render_text());
    print_problems(&problems);
    Ok(ExitCode::SUCCESS)
}
