//! `policy-agent events`: follow drops live (the flows of `flows`, drops
//! only, in the older line format).
use std::process::ExitCode;

use anyhow::Context as _;
use policy_agent::datapath::bpf::{
    events::DropRecord, flows::source::FlowSource, kernel_log::follow_kernel_log,
    loader::Classifiers, pins::Hook,
};

use super::common::PinArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub pins: PinArgs,
    /// JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// Stop after this many events.
    #[arg(long)]
    pub count: Option<usize>,
    /// Also print the classifier's debug log (switch it on with
    /// `policy-agent config --debug-log on`).
    #[arg(long)]
    pub kernel_log: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let layout = args.pins.layout();
    let mut source = FlowSource::open(&layout)
        .context("reading flows (from the agent, or its ring buffer: is it installed?)")?;
    if args.kernel_log {
        let programs = Classifiers::open_pinned(&layout).context("opening the pinned programs")?;
        if let Some(id) = programs.id(Hook::Ingress) {
            follow_kernel_log(id).context("following the kernel log")?;
        }
    }
    let mut seen = 0usize;
    loop {
        let Some(record) = DropRecord::of(&source.next_flow()?) else {
            continue;
        };
        if args.json {
            println!("{}", serde_json::to_string(&record)?);
        } else {
            println!("{record}");
        }
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) {
            return Ok(ExitCode::SUCCESS);
        }
    }
}
