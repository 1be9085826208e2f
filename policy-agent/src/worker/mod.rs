//! `policy-agent run`: keeps the datapath equal to the cluster state as it
//! changes. The sources (a manifest directory or the API server, and the
//! node's own addresses) publish changes; netlink link and pod-route
//! events, CNI hand-offs and the timers are triggers too; each sends
//! straight into the one inbox of the sync worker thread, which owns the
//! [`Enforcer`] (the compiler and the datapath) and reconciles as soon as
//! a change arrives, folding what arrives during a sync into the next one;
//! an HTTP server exposes metrics and health.
mod enforcer;
mod handoff;
mod heap;
mod inbox;
mod reconcile;
mod staging;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::sync::mpsc;
use tracing::{info, warn};

pub use self::enforcer::Enforcer;
use self::{
    inbox::{Sink, Trigger},
    reconcile::Context,
};
use crate::{
    cluster::{Change, normalized_ranges},
    datapath::{Choice, OpenOptions, bpf::pins::PinLayout, iptables::Backend},
    metrics::{self, Metrics},
    netlink,
    policy::CompileOptions,
    source::{self, SourceId, SourceUpdate},
};

/// Settings of the daemon.
#[derive(Clone, Debug)]
pub struct Config {
    pub node: String,
    pub datapath: OpenOptions,
    /// How the compiler runs (its budgets).
    pub compile: CompileOptions,
    /// /healthz, /readyz and /metrics for the probes (loopback: no pod
    /// can reach it).
    pub listen: SocketAddr,
    /// The same on a second address the operator chooses, for scraping
    /// from elsewhere, with its own connection cap (a flood there never
    /// starves the probes).
    pub metrics_listen: Option<SocketAddr>,
    /// Bounds of each HTTP listener.
    pub http_limits: metrics::Limits,
    /// Quiet time that ends a burst of changes (then one sync). Zero: a
    /// sync starts as soon as a change arrives, taking what has arrived by
    /// then; what arrives during a sync goes into the next one.
    pub debounce: Duration,
    /// Longest a burst may delay a sync.
    pub max_delay: Duration,
    /// Quiet time after a file change before the directory is re-read.
    pub settle: Duration,
    /// How often the manifest directory is checked for changes without
    /// inotify (with it: a slower safety net).
    pub poll: Duration,
    /// Full resync (maps read back from the kernel) this often.
    pub resync: Duration,
    /// How often to look for foreign programs ahead of the classifiers
    /// (between the full passes, which also check).
    pub order_check: Duration,
    /// Where the chained CNI plugin hands pods over (None: no plugin).
    pub cni_socket: Option<PathBuf>,
    /// Longest a CNI ADD waits for its pod to be enforced.
    pub cni_wait: Duration,
    /// `--service-cidr`: the Service ranges, over what the cluster
    /// publishes (None: its ServiceCIDRs in cluster mode, none with
    /// manifests).
    pub service_ranges: Option<Vec<ipnet::IpNet>>,
    /// Where the node's pod ranges come from.
    pub pod_ranges: PodRanges,
}

/// Where the node's pod ranges (the pod-range guard) come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodRanges {
    /// Given: `--pod-cidr`, or none at all (no flag with manifests, or
    /// `--ignore-node-pod-cidrs`).
    Given(Vec<ipnet::IpNet>),
    /// The Node object's `spec.podCIDRs` (cluster mode), read until the
    /// API server answers; until then the guard held stays. With
    /// manifests there is no Node to read: none.
    FromNode,
}

impl Config {
    pub fn new(node: String, layout: PinLayout) -> Self {
        Self {
            node,
            datapath: OpenOptions {
                choice: Choice::Auto,
                layout,
                load: Default::default(),
                iptables: Backend::Auto,
                iptables_records: None,
            },
            compile: CompileOptions::default(),
            listen: SocketAddr::from(([127, 0, 0, 1], 9402)),
            metrics_listen: None,
            http_limits: metrics::Limits::default(),
            debounce: Duration::ZERO,
            max_delay: Duration::from_millis(250),
            settle: Duration::from_millis(20),
            poll: Duration::from_millis(500),
            resync: Duration::from_secs(300),
            order_check: Duration::from_secs(5),
            cni_socket: None,
            cni_wait: Duration::from_secs(30),
            service_ranges: None,
            pod_ranges: PodRanges::Given(Vec::new()),
        }
    }
}

/// Where the cluster state comes from (the node's own addresses are read
/// in either case).
#[derive(Clone)]
pub enum Sources {
    Manifests(PathBuf),
    /// Watch the API server with this client.
    Cluster(kube::Client),
}

impl Sources {
    /// The sources whose first update the first sync waits for.
    fn ids(&self) -> [SourceId; 2] {
        match self {
            Sources::Manifests(_) => [SourceId::Manifests, SourceId::Node],
            Sources::Cluster(_) => [SourceId::Kube, SourceId::Node],
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("serving metrics on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("watching network interfaces: {0}")]
    Netlink(#[from] netlink::Error),
    #[error("starting the sync worker: {0}")]
    Worker(#[source] std::io::Error),
    #[error("starting the node-address source: {0}")]
    NodeSource(#[source] std::io::Error),
    #[error("listening for the CNI plugin on {path}: {source}")]
    CniSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Runs until `shutdown` resolves. Enforcement stays in place afterwards.
pub async fn run(
    config: Config,
    sources: Sources,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let metrics = Arc::new(Metrics::new());
    let mut http = Vec::new();
    for addr in std::iter::once(config.listen).chain(config.metrics_listen) {
        let (_bound, task) = metrics::serve(addr, metrics.clone(), config.http_limits)
            .await
            .map_err(|source| Error::Listen { addr, source })?;
        http.push(task);
    }

    let (inbox, sink) = inbox::new();
    // The command line's word on the cluster goes in first.
    let mut given: Vec<Change> = config
        .service_ranges
        .iter()
        .map(|r| Change::ServiceRanges(normalized_ranges(r.iter().copied())))
        .collect();
    let read_node = match (&config.pod_ranges, &sources) {
        (PodRanges::Given(r), _) => {
            given.push(Change::PodRanges(normalized_ranges(r.iter().copied())));
            None
        }
        (PodRanges::FromNode, Sources::Manifests(_)) => {
            given.push(Change::PodRanges(Vec::new()));
            None
        }
        (PodRanges::FromNode, Sources::Cluster(client)) => Some(client.clone()),
    };
    if !given.is_empty() {
        sink.send(Trigger::Update(SourceUpdate {
            source: SourceId::CommandLine,
            changes: given,
            problems: Vec::new(),
        }));
    }
    // The CNI plugin's socket is bound before anything else can fail late:
    // a plugin finding no socket fails its ADD (fail closed) and retries.
    let cni = match &config.cni_socket {
        Some(path) => {
            let listener = handoff::bind(path).map_err(|source| Error::CniSocket {
                path: path.clone(),
                source,
            })?;
            info!(socket = %path.display(), "accepting CNI hand-offs");
            Some(tokio::spawn(handoff::serve(listener, sink.clone())))
        }
        None => None,
    };
    // In cluster mode, invalid policies become Events on them.
    let (problem_tx, problem_rx) = mpsc::unbounded_channel();
    let events_task = match &sources {
        Sources::Cluster(client) => Some(tokio::spawn(source::kube::publish_events(
            client.clone(),
            config.node.clone(),
            problem_rx,
        ))),
        Sources::Manifests(_) => None,
    };
    // ...and one agent of the cluster writes ClusterNetworkPolicy status.
    let (standings_tx, standings_rx) = tokio::sync::watch::channel(Default::default());
    let status_task = match &sources {
        Sources::Cluster(client) => Some(tokio::spawn(source::kube::write_status(
            client.clone(),
            client.default_namespace().to_owned(),
            config.node.clone(),
            standings_rx,
        ))),
        Sources::Manifests(_) => None,
    };
    let context = Context {
        config: config.clone(),
        metrics: metrics.clone(),
        events: events_task.as_ref().map(|_| problem_tx),
        standings: status_task.as_ref().map(|_| standings_tx),
        sources: sources.ids().into_iter().collect(),
    };
    let worker = reconcile::spawn(context, inbox).map_err(Error::Worker)?;

    netlink::watch_links(sink.for_links())?;
    let cluster_task = match sources {
        Sources::Manifests(dir) => tokio::spawn(source::manifests::watch(
            dir,
            config.settle,
            config.poll,
            sink.for_source(),
        )),
        Sources::Cluster(client) => tokio::spawn(source::kube::watch(
            client,
            config.debounce,
            sink.for_source(),
            config.service_ranges.is_none(),
        )),
    };
    source::node::watch(config.node.clone(), sink.for_source()).map_err(Error::NodeSource)?;
    let pod_ranges_task = read_node.map(|client| {
        tokio::spawn(source::kube::read_pod_ranges(
            client,
            config.node.clone(),
            sink.for_source(),
        ))
    });
    let resync_task = tokio::spawn(every(config.resync, sink.clone(), || Trigger::Resync));
    let order_task = tokio::spawn(every(config.order_check, sink.clone(), || {
        Trigger::OrderCheck
    }));

    shutdown.await;
    info!("shutting down; enforcement stays pinned");
    for task in [cluster_task, resync_task, order_task]
        .into_iter()
        .chain(http)
    {
        task.abort();
    }
    for t in [events_task, status_task, pod_ranges_task]
        .into_iter()
        .flatten()
    {
        t.abort();
    }
    if let Some(t) = cni {
        t.abort();
    }
    // The link-event and node-address threads end at their next send,
    // the inbox gone.
    sink.send(Trigger::Stop);
    if worker.join().is_err() {
        warn!("sync worker panicked");
    }
    Ok(())
}

/// Sends `trigger()` every `period` (the first after one period) until
/// the worker is gone.
async fn every(period: Duration, sink: Sink, trigger: impl Fn() -> Trigger) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        if !sink.send(trigger()) {
            return;
        }
    }
}
