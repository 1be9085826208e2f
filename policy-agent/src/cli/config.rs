//! `policy-agent config`: run-time switches of the pinned classifier.
use std::process::ExitCode;

use anyhow::Context as _;
use clap::ValueEnum;
use policy_agent::datapath::bpf::maps::BpfMaps;
use policy_common::config::{CONFIG_DEBUG_LOG, CONFIG_NO_DROP_EVENTS};

use super::common::PinArgs;

#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum Switch {
    On,
    Off,
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub pins: PinArgs,
    /// Kernel-side debug logging (aya-log), read by `run` and `events --kernel-log`.
    #[arg(long, value_enum)]
    pub debug_log: Option<Switch>,
    /// Drop events on the ring buffer (counters count either way).
    #[arg(long, value_enum)]
    pub drop_events: Option<Switch>,
}

fn set(flags: &mut u32, bit: u32, on: bool) {
    if on {
        *flags |= bit;
    } else {
        *flags &= !bit;
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let layout = args.pins.layout();
    let mut maps = BpfMaps::from_pins(&layout)
        .with_context(|| format!("opening the maps under {}", layout.versioned().display()))?;
    let mut config = maps.config()?;
    if let Some(s) = args.debug_log {
        set(&mut config.flags, CONFIG_DEBUG_LOG, matches!(s, Switch::On));
    }
    if let Some(s) = args.drop_events {
        set(
            &mut config.flags,
            CONFIG_NO_DROP_EVENTS,
            matches!(s, Switch::Off),
        );
    }
    maps.set_config(config)?;
    println!(
        "debug-log: {}\ndrop-events: {}",
        if config.flags & CONFIG_DEBUG_LOG != 0 {
            "on"
        } else {
            "off"
        },
        if config.flags & CONFIG_NO_DROP_EVENTS != 0 {
            "off"
        } else {
            "on"
        }
    );
    Ok(ExitCode::SUCCESS)
}
