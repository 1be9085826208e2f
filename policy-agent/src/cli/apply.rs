//! `policy-agent apply`: enforce a directory of manifests once.
use std::process::ExitCode;

use anyhow::Context as _;
use policy_agent::{
    cluster::{ClusterState, changes_between},
    worker::Enforcer,
};

use super::common::{EnforceArgs, ManifestsArg, NodeArg, print_problems};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub manifests: ManifestsArg,
    #[command(flatten)]
    pub node: NodeArg,
    #[command(flatten)]
    pub enforce: EnforceArgs,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let node = &args.node.node;
    let (mut state, mut problems) = args.manifests.load_for(&args.node)?;
    state.service_ranges = args.enforce.service_ranges().unwrap_or_default();
    state.pod_ranges = Some(args.enforce.datapath.pod_cidrs.clone());

    let mut enforcer = Enforcer::open(&args.enforce.open_options(), args.enforce.compile_options())
        .context("opening the datapath")?;
    let report = enforcer
        .enforce(changes_between(&ClusterState::default(), &state))
        .context("enforcing")?;
    problems.extend(report.problems.iter().cloned());
    println!(
        "{}: enforcing {} local endpoint(s) on node {node}: {} write(s){}{}",
        enforcer.datapath().name(),
        report.endpoints,
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
