//! `policy-agent render`: print the ipsets and chains the iptables
//! datapath would install, for review.
use std::process::ExitCode;

use anyhow::bail;
use policy_agent::{
    datapath::{
        Desired,
        iptables::{Backend, IptablesDriver},
    },
    identity::IdentityAllocator,
    policy::{CompileOptions, Compiler},
};

use super::common::{BudgetArgs, DatapathChoice, ManifestsArg, NodeArg, print_problems};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub manifests: ManifestsArg,
    #[command(flatten)]
    pub node: NodeArg,
    #[arg(long, value_enum, default_value = "iptables")]
    pub datapath: DatapathChoice,
    /// Pods this node runs at most: sets the default budgets.
    #[arg(long, default_value_t = 110)]
    pub max_pods: u32,
    #[command(flatten)]
    pub budget: BudgetArgs,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.datapath != DatapathChoice::Iptables {
        bail!(
            "render prints the iptables datapath's rules; for BPF, see `policy-agent dump` and `explain`"
        );
    }
    let (state, unreadable) = args.manifests.load_for(&args.node)?;
    for p in &unreadable {
        eprintln!("warning: {p}");
    }
    let staged = state.staged_policies();
    if !staged.is_empty() {
        eprintln!(
            "note: {} staged polic{} not rendered (staged policies are reported, never enforced)",
            staged.len(),
            if staged.len() == 1 { "y is" } else { "ies are" }
        );
    }
    let compiler = Compiler::build(
        &state.enforced(),
        &mut IdentityAllocator::new(),
        CompileOptions {
            budget: args.budget.budget(args.max_pods),
            ..CompileOptions::default()
        },
    );
    let rules = compiler.rules();
    let desired = Desired {
        maps: compiler.maps(),
        local_pods: compiler.local_pods(),
        rules: &rules,
        pod_ranges: compiler.pod_ranges(),
        staged: None,
    };
    // Rendering needs no iptables tools: nothing is applied.
    let (ruleset, mut problems, _) = IptablesDriver::unchecked(Backend::Auto).ruleset(&desired);
    problems.splice(0..0, compiler.problems());
    print!("{}", ruleset.render_text());
    print_problems(&problems);
    Ok(ExitCode::SUCCESS)
}
