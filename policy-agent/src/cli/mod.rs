//! The command line (a fixed contract: scripts depend on it).
mod apply;
mod common;
mod config;
mod dump;
mod events;
mod explain;
mod flows;
mod render;
mod reset;
mod run;
mod staged_report;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "policy-agent",
    version,
    about = "Kubernetes NetworkPolicy enforcement with eBPF (iptables fallback)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Enforce the state in a directory of manifests once, and exit.
    Apply(apply::Args),
    /// Enforce continuously: watch manifests (or the API server), netlink
    /// link events, and serve /metrics, /healthz and /readyz.
    Run(run::Args),
    /// Remove every program, link, pin, chain and set the agent installed.
    Reset(reset::Args),
    /// Explain the verdict for one flow, with the rules and map keys behind it.
    Explain(explain::Args),
    /// Print the pinned maps decoded into names.
    Dump(dump::Args),
    /// Print the ipsets and chains the iptables datapath would apply.
    Render(render::Args),
    /// Follow drop events live.
    Events(events::Args),
    /// Follow flows live (new flows judged by policy, and drops), named:
    /// from the running agent (run this in its network namespace), else
    /// from the pinned ring buffer.
    Flows(flows::Args),
    /// Per staged policy (annotated `policy-agent/staged: "true"`), the
    /// new flows it would have dropped or admitted since it was staged,
    /// from the running agent.
    StagedReport(staged_report::Args),
    /// Switch kernel debug logging or drop events at run time.
    Config(config::Args),
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    common::init_tracing();
    let result = match cli.command {
        Command::Apply(a) => apply::run(a),
        Command::Run(a) => run::run(a),
        Command::Reset(a) => reset::run(a),
        Command::Explain(a) => explain::run(a),
        Command::Dump(a) => dump::run(a),
        Command::Render(a) => render::run(a),
        Command::Events(a) => events::run(a),
        Command::Flows(a) => flows::run(a),
        Command::StagedReport(a) => staged_report::run(a),
        Command::Config(a) => config::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
