//! `policy-agent reset`: remove what the agent installed, nothing else.
use std::process::ExitCode;

use policy_agent::datapath::{bpf::reset::reset, iptables::Executor};

use super::common::{IptablesChoice, PinArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub pins: PinArgs,
    /// The iptables flavour whose chains and sets to remove.
    #[arg(long, value_enum, default_value = "auto")]
    pub iptables_backend: IptablesChoice,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let layout = args.pins.layout();
    let mut ok = true;
    match reset(&layout) {
        Ok(report) => match &report.removed {
            Some(dir) => println!(
                "bpf: removed {} and the attachments on {} interface(s)",
                dir.display(),
                report.interfaces.len()
            ),
            None => println!("bpf: nothing installed under {}", layout.root().display()),
        },
        Err(errors) => {
            ok = false;
            for e in errors {
                eprintln!("error: {e}");
            }
        }
    }
    let exec = Executor::new(args.iptables_backend.into());
    if exec.check().is_ok() {
        match exec.reset() {
            Ok(r) => println!(
                "iptables: removed {} chain(s) and {} set(s)",
                r.chains, r.sets
            ),
            Err(e) => {
                ok = false;
                eprintln!("error: {e}");
            }
        }
    }
    // The names the iptables fallback's flow records are read with.
    let names = policy_agent::datapath::iptables::flow_log::names_path(layout.root());
    if let Err(e) = policy_agent::datapath::iptables::flow_log::remove_names(&names) {
        ok = false;
        eprintln!("error: {e}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
