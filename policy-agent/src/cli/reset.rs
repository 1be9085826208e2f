//! `policy-agent reset`: remove what the agent installed, nothing else.
use std::process::ExitCode;

use policy_agent::datapath::bpf::reset;

use super::common::PinArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub pins: PinArgs,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let layout = args.pins.layout();
    match reset(&layout) {
        Ok(report) => {
            match &report.removed {
                Some(dir) => println!(
                    "removed {} and the attachments on {} interface(s)",
                    dir.display(),
                    report.interfaces.len()
                ),
                None => println!("nothing installed under {}", layout.root().display()),
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(errors) => {
            for e in errors {
                eprintln!("error: {e}");
            }
            Ok(ExitCode::FAILURE)
        }
    }
}
