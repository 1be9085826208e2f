//! `policy-agent explain`: the verdict for one flow and why.
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use policy_agent::{
    cluster::ObjectRef,
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
    /// Destination: NAMESPACE/POD, an IP address, or service/NAMESPACE/NAME
    /// (a Service: each backend kube-proxy may pick is judged, as the
    /// datapath does after DNAT).
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
    let mut ids = IdentityAllocator::new();
    let compiled = compile_with(
        &state,
        &mut ids,
        CompileOptions {
            all_pods_local: true,
        },
    );
    if let Some(service) = args.to.strip_prefix("service/") {
        let Some((ns, name)) = service
            .split_once('/')
            .filter(|(n, m)| !n.is_empty() && !m.is_empty())
        else {
            bail!("{:?}: expected service/NAMESPACE/NAME", args.to);
        };
        let query = ServiceQuery {
            src: flow_end(&args.from)?,
            service: ObjectRef::new(ns, name),
            protocol,
            port: args.port,
        };
        let explanation = explain_service(&state, &compiled, &query).context("explaining")?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&explanation)?);
        } else {
            print!("{explanation}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let query = ExplainQuery {
        src: flow_end(&args.from)?,
        dst: flow_end(&args.to)?,
        protocol,
        port: args.port,
    };
    let explanation = explain(&state, &compiled, &query).context("explaining")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&explanation)?);
    } else {
        print!("{explanation}");
    }
    Ok(ExitCode::SUCCESS)
}
