//! `policy-agent flows`: follow named flows live, from the daemon (or the
//! ring itself when no daemon serves these pins).
use std::{io::Write as _, process::ExitCode};

use anyhow::Context as _;
use clap::ValueEnum;
use policy_agent::datapath::bpf::flows::{filter::FlowFilter, record::Verdict, source::FlowSource};

use super::common::PinArgs;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerdictArg {
    Allow,
    Drop,
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub pins: PinArgs,
    /// JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// Stop after this many flows (those the filters keep).
    #[arg(long)]
    pub count: Option<usize>,
    /// Only flows of this pod ("namespace/name"), at either end.
    #[arg(long, value_name = "NS/NAME")]
    pub pod: Option<String>,
    /// Only flows of pods in this namespace, at either end.
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Only allowed or only dropped flows.
    #[arg(long, value_enum)]
    pub verdict: Option<VerdictArg>,
    /// Only flows this policy decided (or would, staged): "[namespace/]name".
    #[arg(long, value_name = "[NS/]NAME")]
    pub policy: Option<String>,
    /// Only flows whose verdict the staged policies would change.
    #[arg(long)]
    pub staged: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let layout = args.pins.layout();
    let filter = FlowFilter {
        pod: args.pod,
        namespace: args.namespace,
        verdict: args.verdict.map(|v| match v {
            VerdictArg::Allow => Verdict::Allow,
            VerdictArg::Drop => Verdict::Drop,
        }),
        policy: args.policy,
        staged: args.staged,
    };
    let mut source = FlowSource::open(&layout)
        .context("reading flows (from the agent, or its ring buffer: is it installed?)")?;
    let mut seen = 0usize;
    let mut out = std::io::stdout().lock();
    while args.count.is_none_or(|c| seen < c) {
        let event = source.next_flow()?;
        if !filter.matches(&event.flow) {
            continue;
        }
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&event.flow)?)?;
        } else {
            writeln!(out, "{}", event.flow)?;
        }
        out.flush()?;
        seen += 1;
    }
    Ok(ExitCode::SUCCESS)
}
