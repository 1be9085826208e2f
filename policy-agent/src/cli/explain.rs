//! `policy-agent explain`: the verdict for one flow and why.
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use policy_agent::{
    cluster::{ClusterState, ObjectRef},
    identity::IdentityAllocator,
    policy::{
        CompileOptions, ExplainQuery, FlowEnd, ServiceQuery, compile_with, explain, explain_service,
    },
    source,
};

use super::common::ManifestsArg;
use policy_common::proto;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub manifests: ManifestsArg,
    /// Source: NAMESPACE/POD or an IP address.
    #[arg(long)]
    pub from: String,
    /// Destination: NAMESPACE/POD, an IP address, or service/NAMESPACE/NAME.
    /// A Service (named, or by one of its addresses) is answered per
    /// backend kube-proxy may pick, as the datapath judges after DNAT.
    #[arg(long)]
    pub to: String,
    /// Destination port (of the Service, for a Service).
    #[arg(long)]
    pub port: u16,
    /// TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    pub protocol: String,
    /// JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Both verdicts: as enforced, and with the staged policies (those
    /// annotated `policy-agent/staged: "true"`) enforced too.
    #[arg(long)]
    pub staged: bool,
}

fn flow_end(s: &str) -> anyhow::Result<FlowEnd> {
    if let Ok(ip) = s.parse() {
        return Ok(FlowEnd::Ip(ip));
    }
    match s.split_once('/') {
        Some((ns, pod)) if !ns.is_empty() && !pod.is_empty() => {
            Ok(FlowEnd::Pod(ObjectRef::new(ns, pod)))
        }
        _ => bail!("{s:?} is neither NAMESPACE/POD nor an IP address"),
    }
}

/// The Service `to` names: `service/NAMESPACE/NAME`, or an address that is
/// a Service frontend (a ClusterIP, external or load-balancer IP).
fn service_target(to: &str, state: &ClusterState) -> anyhow::Result<Option<ObjectRef>> {
    if let Some(service) = to.strip_prefix("service/") {
        let Some((ns, name)) = service
            .split_once('/')
            .filter(|(n, m)| !n.is_empty() && !m.is_empty())
        else {
            bail!("{to:?}: expected service/NAMESPACE/NAME");
        };
        return Ok(Some(ObjectRef::new(ns, name)));
    }
    let Ok(ip) = to.parse::<std::net::IpAddr>() else {
        return Ok(None);
    };
    Ok(state
        .services
        .iter()
        .find(|(_, s)| {
            s.cluster_ips
                .iter()
                .chain(&s.external_ips)
                .chain(&s.load_balancer_ips)
                .any(|a| *a == ip)
        })
        .map(|(name, _)| name.clone()))
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let protocol = match args.protocol.to_ascii_uppercase().as_str() {
        "TCP" => proto::TCP,
        "UDP" => proto::UDP,
        "SCTP" => proto::SCTP,
        other => bail!("unknown protocol {other:?}: use TCP, UDP or SCTP"),
    };
    let mut loaded = source::manifests::load_dir(&args.manifests.manifests);
    // Explain judges every pod as if it were local: no node is needed.
    let state = loaded.cluster_state("", Vec::new());
    for e in &loaded.errors {
        eprintln!("warning: {e}");
    }
    let staged = state.staged_policies();
    let enforced = explain_in(&args, &state.enforced(), protocol)?;
    if !args.staged {
        if !staged.is_empty() {
            eprintln!(
                "note: {} staged polic{} not enforced and not in this verdict (--staged shows both)",
                staged.len(),
                if staged.len() == 1 { "y is" } else { "ies are" }
            );
        }
        print_one(&enforced, args.json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let with_staged = explain_in(&args, &state, protocol)?;
    let names: Vec<String> = staged.iter().map(ToString::to_string).collect();
    if args.json {
        let both = serde_json::json!({
            "enforced": enforced,
            "staged": with_staged,
            "staged_policies": names,
        });
        println!("{}", serde_json::to_string_pretty(&both)?);
    } else {
        println!("== enforced");
        print_one(&enforced, false)?;
        if names.is_empty() {
            println!("== staged: no policy is staged");
        } else {
            println!("== with the staged policies ({})", names.join(", "));
        }
        print_one(&with_staged, false)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One explanation, of a flow or of a flow to a Service.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum Answer {
    Flow(Box<policy_agent::policy::Explanation>),
    Service(policy_agent::policy::ServiceExplanation),
}

fn print_one(answer: &Answer, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(answer)?);
    } else {
        match answer {
            Answer::Flow(e) => print!("{e}"),
            Answer::Service(e) => print!("{e}"),
        }
    }
    Ok(())
}

/// The answer in `state` (every policy in it enforced).
fn explain_in(args: &Args, state: &ClusterState, protocol: u8) -> anyhow::Result<Answer> {
    let mut ids = IdentityAllocator::new();
    let compiled = compile_with(
        state,
        &mut ids,
        CompileOptions {
            all_pods_local: true,
            ..CompileOptions::default()
        },
    );
    if let Some(service) = service_target(&args.to, state)? {
        let query = ServiceQuery {
            src: flow_end(&args.from)?,
            service,
            protocol,
            port: args.port,
        };
        let explanation = explain_service(state, &compiled, &query).context("explaining")?;
        return Ok(Answer::Service(explanation));
    }
    let query = ExplainQuery {
        src: flow_end(&args.from)?,
        dst: flow_end(&args.to)?,
        protocol,
        port: args.port,
    };
    let explanation = explain(state, &compiled, &query).context("explaining")?;
    Ok(Answer::Flow(Box::new(explanation)))
}
