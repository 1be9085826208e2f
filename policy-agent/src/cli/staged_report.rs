//! `policy-agent staged-report`: per staged policy, the new flows it would
//! have dropped or admitted since it was staged, from the running agent
//! (it judges every flow record against the staged view).
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use policy_agent::datapath::bpf::flows::source::staged_report;

use super::common::PinArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub pins: PinArgs,
    /// JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let layout = args.pins.layout();
    let Some(report) = staged_report(&layout).context("asking the agent for its staged report")?
    else {
        bail!(
            "no agent serves the pins at {} (the staged report is kept by `policy-agent run`; run this in its network namespace)",
            layout.root().display()
        );
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}
