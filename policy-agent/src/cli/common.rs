//! Options and helpers shared by subcommands.
use std::path::PathBuf;

use anyhow::Context as _;
use clap::ValueEnum;
use policy_agent::{
    cluster::{ClusterState, Problem},
    datapath::{
        Choice, OpenOptions,
        bpf::{
            flows::{FlowOptions, FlowRate},
            loader::LoadOptions,
            pins::{DEFAULT_PIN_ROOT, PinLayout},
            sizing::Sizing,
        },
        iptables::Backend,
    },
    netlink,
    policy::{Budget, CompileOptions},
    source,
};

pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Where the pinned state lives.
#[derive(clap::Args, Clone, Debug)]
pub struct PinArgs {
    /// Pin directory root (the layout version is appended: <root>/v2).
    #[arg(long, env = "POLICY_AGENT_PIN_DIR", default_value = DEFAULT_PIN_ROOT)]
    pub pin_dir: PathBuf,
}

impl PinArgs {
    pub fn layout(&self) -> PinLayout {
        PinLayout::new(&self.pin_dir)
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatapathChoice {
    /// eBPF, falling back to iptables when BPF cannot be used.
    Auto,
    Bpf,
    Iptables,
}

impl From<DatapathChoice> for Choice {
    fn from(c: DatapathChoice) -> Self {
        match c {
            DatapathChoice::Auto => Choice::Auto,
            DatapathChoice::Bpf => Choice::Bpf,
            DatapathChoice::Iptables => Choice::Iptables,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IptablesChoice {
    /// Whatever `iptables` is on this machine.
    Auto,
    Nft,
    Legacy,
}

/// How the BPF classifiers are attached (see `--attach`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachChoice {
    /// clsact qdisc and cls_bpf filters at priority 20: no RCU grace
    /// period per attach, so a CNI ADD is not held up.
    Netlink,
    /// TCX links, first in the chain (one RCU grace period per attach,
    /// with RTNL held).
    Tcx,
}

impl From<IptablesChoice> for Backend {
    fn from(c: IptablesChoice) -> Self {
        match c {
            IptablesChoice::Auto => Backend::Auto,
            IptablesChoice::Nft => Backend::Nft,
            IptablesChoice::Legacy => Backend::Legacy,
        }
    }
}

/// Which datapath, and how.
#[derive(clap::Args, Clone, Debug)]
pub struct DatapathArgs {
    #[arg(long, value_enum, default_value = "auto")]
    pub datapath: DatapathChoice,
    /// The iptables flavour the fallback drives.
    #[arg(long, value_enum, default_value = "auto")]
    pub iptables_backend: IptablesChoice,
    /// How the classifiers go on an interface: netlink clsact filters, or
    /// TCX links (Linux >= 6.6; below it, netlink). An interface keeps the
    /// kind it was attached with.
    #[arg(long, value_enum, default_value = "netlink")]
    pub attach: AttachChoice,
    /// The cluster's Service range(s) (kube-apiserver's
    /// --service-cluster-ip-range; repeatable, one per family). Every
    /// address in them is a frontend from the start, before its Service
    /// is seen: an isolated pod's egress to it is judged after DNAT, on
    /// the backend (BPF datapath). In cluster mode the ranges are read
    /// from the cluster's ServiceCIDR objects (Kubernetes >= 1.33); when
    /// this flag is given it wins and ServiceCIDRs are not read.
    #[arg(long = "service-cidr", value_name = "CIDR")]
    pub service_cidrs: Vec<ipnet::IpNet>,
    /// The range(s) this node's IPAM hands to its own pods (the Node's
    /// spec.podCIDRs; repeatable, one per family). An address in them that
    /// no enforced pod holds yet (a new pod whose veth the agent has not
    /// attached to) is unreachable: nothing from it or to it passes the
    /// other pods' veths or the node's uplinks. The node's own addresses
    /// in them (a ptp gateway) keep working. Both datapaths.
    #[arg(long = "pod-cidr", value_name = "CIDR")]
    pub pod_cidrs: Vec<ipnet::IpNet>,
    /// In cluster mode without --pod-cidr, do not take the ranges from the
    /// Node's spec.podCIDRs: for an IPAM that ignores them (Calico IPAM,
    /// Cilium cluster-pool), which may give those addresses to pods of
    /// other nodes.
    #[arg(long)]
    pub ignore_node_pod_cidrs: bool,
}

/// The node the agent enforces on.
#[derive(clap::Args, Clone, Debug)]
pub struct NodeArg {
    /// This node's name: pods with this spec.nodeName are enforced here
    /// (in a cluster: from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
}

/// A directory of manifests describing the cluster.
#[derive(clap::Args, Clone, Debug)]
pub struct ManifestsArg {
    /// Directory of *.yaml / *.yml manifests (Namespaces, Pods, NetworkPolicies).
    #[arg(long)]
    pub manifests: PathBuf,
}

impl ManifestsArg {
    /// The manifests as the cluster state of `node`, whose own addresses
    /// are this network namespace's; with what could not be read.
    pub fn load_for(&self, node: &NodeArg) -> anyhow::Result<(ClusterState, Vec<Problem>)> {
        let mut loaded = source::manifests::load_dir(&self.manifests);
        let node_ips = netlink::local_addresses().context("reading this node's addresses")?;
        let state = loaded.cluster_state(&node.node, node_ips);
        let problems = loaded.errors.iter().map(|e| e.problem()).collect();
        Ok((state, problems))
    }
}

/// How large the BPF maps are made (when first created).
#[derive(clap::Args, Clone, Debug)]
pub struct SizingArgs {
    /// Pods this node runs at most (the kubelet's maxPods): sizes
    /// conntrack, policy and endpoint maps (see docs/ARCHITECTURE.md).
    #[arg(long, default_value_t = 110)]
    pub max_pods: u32,
    /// Pods in the whole cluster at most: sizes the ipcache.
    #[arg(long, default_value_t = 65536)]
    pub cluster_pods: u32,
    /// One map's size, NAME=ENTRIES (repeatable), over the formula.
    #[arg(long = "map-size", value_parser = Sizing::parse_override)]
    pub map_sizes: Vec<(&'static str, u32)>,
    /// The most conntrack entries one pod may hold; past it, its new flows
    /// are not tracked (their replies are judged as new). 0: no bound.
    /// Default: a quarter of the conntrack map.
    #[arg(long)]
    pub conntrack_share: Option<u32>,
}

/// How much compiled state policies may hold (docs/design/semantics.md).
#[derive(clap::Args, Clone, Debug)]
pub struct BudgetArgs {
    /// Entries one NetworkPolicy may compile to: its policy-map keys (for
    /// each local endpoint identity it selects, each peer its rules reach
    /// times their port blocks) plus the identities its rules reach. A
    /// policy past it allows nothing, isolates what it selects, and is
    /// reported. Default: a quarter of --compiled-entries-max (56,320 for
    /// --max-pods 110).
    #[arg(long, value_name = "ENTRIES")]
    pub policy_entries_max: Option<u64>,
    /// Entries all policies may compile to together; a policy that does
    /// not fit in what the others leave is refused the same way (a full
    /// compile takes the smallest first). Default: the POLICY map's size
    /// by the formula, max(16384, max-pods × 2048) (225,280 for 110 pods;
    /// the agent holds about 350 bytes per key).
    #[arg(long, value_name = "ENTRIES")]
    pub compiled_entries_max: Option<u64>,
}

impl BudgetArgs {
    /// The budgets for a node of `max_pods`, flags over the defaults.
    pub fn budget(&self, max_pods: u32) -> Budget {
        let default = Budget::for_node(max_pods);
        let total = self.compiled_entries_max.unwrap_or(default.total);
        Budget {
            per_policy: self.policy_entries_max.unwrap_or(total / 4),
            total,
        }
    }
}

/// How many flow records the classifier emits (BPF datapath).
#[derive(clap::Args, Clone, Debug)]
pub struct FlowRecordArgs {
    /// Flow records (new flows and drops) each CPU may emit a second; the
    /// rest are counted, not recorded. 0: no limit.
    #[arg(long, default_value_t = FlowRate::DEFAULT.per_second)]
    pub flow_records_per_second: u64,
    /// Flow records each CPU may emit at once after a quiet time.
    #[arg(long, default_value_t = FlowRate::DEFAULT.burst)]
    pub flow_records_burst: u64,
    /// The NFLOG group the iptables fallback logs flow records to (its
    /// budget is the node's, per family: the two options above).
    #[arg(long, default_value_t = policy_agent::datapath::iptables::DEFAULT_GROUP)]
    pub flow_records_group: u16,
}

/// Which datapath to enforce with, and where its pins live.
#[derive(clap::Args, Clone, Debug)]
pub struct EnforceArgs {
    #[command(flatten)]
    pub datapath: DatapathArgs,
    #[command(flatten)]
    pub pins: PinArgs,
    #[command(flatten)]
    pub sizing: SizingArgs,
    #[command(flatten)]
    pub budget: BudgetArgs,
    #[command(flatten)]
    pub flow_records: FlowRecordArgs,
}

impl EnforceArgs {
    /// `--service-cidr`, if given: it wins over the cluster's ServiceCIDRs.
    pub fn service_ranges(&self) -> Option<Vec<ipnet::IpNet>> {
        let given = &self.datapath.service_cidrs;
        (!given.is_empty()).then(|| given.clone())
    }

    /// How the agent compiles: within the budgets.
    pub fn compile_options(&self) -> CompileOptions {
        CompileOptions {
            budget: self.budget.budget(self.sizing.max_pods),
            ..CompileOptions::default()
        }
    }

    pub fn open_options(&self) -> OpenOptions {
        OpenOptions {
            choice: self.datapath.datapath.into(),
            layout: self.pins.layout(),
            load: LoadOptions {
                tcx: self.datapath.attach == AttachChoice::Tcx,
                capacities: Sizing {
                    max_pods: self.sizing.max_pods,
                    cluster_pods: self.sizing.cluster_pods,
                    overrides: self.sizing.map_sizes.clone(),
                }
                .capacities(),
                conntrack_share: self.sizing.conntrack_share,
                flows: FlowOptions {
                    rate: Some(FlowRate {
                        per_second: self.flow_records.flow_records_per_second,
                        burst: self.flow_records.flow_records_burst,
                    }),
                    ..FlowOptions::default()
                },
            },
            iptables: self.datapath.iptables_backend.into(),
            iptables_records: Some(policy_agent::datapath::iptables::FlowLogOptions {
                group: self.flow_records.flow_records_group,
                per_second: u32::try_from(self.flow_records.flow_records_per_second)
                    .unwrap_or(u32::MAX),
                burst: u32::try_from(self.flow_records.flow_records_burst).unwrap_or(u32::MAX),
            }),
        }
    }
}

/// Prints problems to stderr, one per line.
pub fn print_problems(problems: &[Problem]) {
    for p in problems {
        eprintln!("not enforced: {p}");
    }
}
