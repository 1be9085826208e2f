//! `policy-agent dump`: the pinned maps, named.
use std::process::ExitCode;

use anyhow::Context as _;
use policy_agent::inspect::dump;

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
    let d = dump(&layout).with_context(|| {
        format!(
            "reading the maps pinned under {}",
            layout.versioned().display()
        )
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{d}");
    }
    Ok(ExitCode::SUCCESS)
}
