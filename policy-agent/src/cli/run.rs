//! `policy-agent run`: the daemon.
use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::ValueEnum;
use policy_agent::{
    datapath::bpf::flows::FlowLog,
    worker::{self, Config, PodRanges, Sources},
};

use super::common::{EnforceArgs, NodeArg};

#[derive(clap::Args)]
pub struct Args {
    /// Watch this directory of manifests instead of the API server
    /// (without it: cluster mode, in-cluster config or KUBECONFIG).
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArg,
    /// Address for /healthz, /readyz and /metrics: what the kubelet's
    /// probes need. Keep it on loopback: with host networking every pod can
    /// reach the node's other addresses.
    #[arg(long, default_value = "127.0.0.1:9402")]
    pub listen: SocketAddr,
    /// A second address serving the same, for a Prometheus elsewhere (e.g.
    /// 0.0.0.0:9403). Every pod of the node can reach it too; each address
    /// holds at most 64 connections, a request must arrive within 5 s, and
    /// a flood here never reaches the probes' address.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub enforce: EnforceArgs,
    /// Quiet time (ms) that ends a burst of changes. 0: sync as soon as a
    /// change arrives; what arrives during a sync goes into the next one.
    #[arg(long, default_value_t = 0)]
    pub debounce_ms: u64,
    /// Accept pods from the chained CNI plugin (`policy-cni`) on this unix
    /// socket: a new pod is enforced before its CNI ADD returns. The
    /// DaemonSet uses /run/policy-agent/cni.sock.
    #[arg(long, value_name = "PATH")]
    pub cni_socket: Option<PathBuf>,
    /// Longest an ADD waits for its pod to be enforced before it fails
    /// (the kubelet retries the sandbox). The plugin's own timeout is
    /// usually shorter.
    #[arg(long, default_value_t = 30)]
    pub cni_wait_secs: u64,
    /// How often (ms) to look for programs attached ahead of the
    /// classifiers on a running pod's interface (a change triggers a full
    /// pass, which puts them first again where it can).
    #[arg(long, default_value_t = 5000)]
    pub order_check_ms: u64,
    /// Which flow records the log carries: one JSON object per line at
    /// info level, target "flows", at most 20 lines a second (the rest are
    /// counted in policy_agent_flow_log_skipped_total).
    #[arg(long, value_enum, default_value = "drops")]
    pub flow_log: FlowLogChoice,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowLogChoice {
    Off,
    /// Dropped flows and packets.
    Drops,
    /// Every new flow judged by policy, and every drop.
    All,
}

impl From<FlowLogChoice> for FlowLog {
    fn from(c: FlowLogChoice) -> Self {
        match c {
            FlowLogChoice::Off => FlowLog::Off,
            FlowLogChoice::Drops => FlowLog::Drops,
            FlowLogChoice::All => FlowLog::All,
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut config = Config::new(args.node.node.clone(), args.enforce.pins.layout());
    config.listen = args.listen;
    config.metrics_listen = args.metrics_listen;
    config.datapath = args.enforce.open_options();
    config.datapath.load.flows.log = args.flow_log.into();
    config.service_ranges = args.enforce.service_ranges();
    config.pod_ranges = PodRanges::Given(args.enforce.datapath.pod_cidrs.clone());
    config.compile = args.enforce.compile_options();
    config.debounce = Duration::from_millis(args.debounce_ms);
    config.cni_socket = args.cni_socket.clone();
    config.cni_wait = Duration::from_secs(args.cni_wait_secs);
    config.order_check = Duration::from_millis(args.order_check_ms.max(100));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async move {
        let shutdown = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(_) => return,
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        };
        let source = match args.manifests.clone() {
            Some(dir) => Sources::Manifests(dir),
            None => {
                // In a pod: the service account; elsewhere: KUBECONFIG.
                let client = kube::Client::try_default()
                    .await
                    .context("connecting to the API server (in-cluster config or KUBECONFIG)")?;
                if args.enforce.datapath.pod_cidrs.is_empty()
                    && !args.enforce.datapath.ignore_node_pod_cidrs
                {
                    config.pod_ranges = PodRanges::FromNode;
                }
                Sources::Cluster(client)
            }
        };
        worker::run(config, source, shutdown)
            .await
            .map_err(anyhow::Error::from)
    })?;
    Ok(ExitCode::SUCCESS)
}
