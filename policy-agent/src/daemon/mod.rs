//! `policy-agent run`: keeps the datapath equal to the cluster state as it
//! changes. A source (a manifest directory, or the API server) publishes
//! snapshots; a sync worker debounces them with netlink link events and
//! enforces; an HTTP server exposes metrics and health.
mod manifests;
mod worker;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::sync::mpsc;
use tracing::{info, warn};

pub use self::worker::{SourceUpdate, Trigger};
use crate::{
    datapath::{
        bpf::{LoadOptions, PinLayout},
        iptables::Backend,
    },
    enforce,
    metrics::{self, Metrics},
};

/// Settings of the daemon.
#[derive(Clone, Debug)]
pub struct Config {
    pub node: String,
    pub datapath: enforce::Choice,
    pub iptables: Backend,
    pub layout: PinLayout,
    pub load: LoadOptions,
    pub listen: SocketAddr,
    /// Quiet time that ends a burst of changes (then one sync).
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
}

impl Config {
    pub fn new(node: String, layout: PinLayout) -> Self {
        Self {
            node,
            datapath: enforce::Choice::Auto,
            iptables: Backend::Auto,
            layout,
            load: LoadOptions::default(),
            listen: SocketAddr::from(([127, 0, 0, 1], 9402)),
            debounce: Duration::from_millis(20),
            max_delay: Duration::from_millis(250),
            settle: Duration::from_millis(20),
            poll: Duration::from_millis(500),
            resync: Duration::from_secs(300),
        }
    }
}

/// Where cluster state comes from.
#[derive(Clone)]
pub enum Source {
    Manifests(PathBuf),
    /// Watch the API server with this client.
    Cluster(kube::Client),
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
    Netlink(#[from] crate::netlink::Error),
    #[error("starting the sync worker: {0}")]
    Worker(#[source] std::io::Error),
}

/// Runs until `shutdown` resolves. Enforcement stays in place afterwards.
pub async fn run(
    config: Config,
    source: Source,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let metrics = Arc::new(Metrics::new(config.layout.clone()));
    let (_bound, http) = metrics::serve(config.listen, metrics.clone())
        .await
        .map_err(|source| Error::Listen {
            addr: config.listen,
            source,
        })?;

    let (tx, rx) = std::sync::mpsc::channel::<Trigger>();
    // In cluster mode, invalid policies become Events on them.
    let (problem_tx, problem_rx) = mpsc::unbounded_channel();
    let events_task = match &source {
        Source::Cluster(client) => Some(tokio::spawn(crate::k8s::cluster::publish_events(
            client.clone(),
            config.node.clone(),
            problem_rx,
        ))),
        Source::Manifests(_) => None,
    };
    let problem_tx = events_task.as_ref().map(|_| problem_tx);
    let worker =
        worker::spawn(config.clone(), rx, metrics.clone(), problem_tx).map_err(Error::Worker)?;

    // New pod interfaces and pod routes: look the interfaces up again at
    // once, so they are attached.
    let (link_tx, link_rx) = std::sync::mpsc::channel();
    crate::netlink::watch_links(link_tx)?;
    let links_to_worker = tx.clone();
    std::thread::Builder::new()
        .name("link-events".into())
        .spawn(move || {
            while let Ok(event) = link_rx.recv() {
                if let crate::netlink::LinkEvent::Changed(link) = &event
                    && link.kind.as_deref() != Some("veth")
                {
                    continue;
                }
                if links_to_worker.send(Trigger::Links).is_err() {
                    return;
                }
            }
        })
        .map_err(Error::Worker)?;

    let (state_tx, mut state_rx) = mpsc::unbounded_channel::<SourceUpdate>();
    let source_task = match source {
        Source::Manifests(dir) => tokio::spawn(manifests::watch(
            dir,
            config.node.clone(),
            config.settle,
            config.poll,
            state_tx,
        )),
        Source::Cluster(client) => tokio::spawn(crate::k8s::cluster::watch(
            client,
            config.node.clone(),
            config.debounce,
            state_tx,
        )),
    };
    let forward = tx.clone();
    let forward_task = tokio::spawn(async move {
        while let Some(state) = state_rx.recv().await {
            if forward.send(Trigger::Update(state)).is_err() {
                return;
            }
        }
    });
    let resync_tx = tx.clone();
    let resync_every = config.resync;
    let resync_task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(resync_every);
        tick.tick().await;
        loop {
            tick.tick().await;
            if resync_tx.send(Trigger::Resync).is_err() {
                return;
            }
        }
    });

    shutdown.await;
    info!("shutting down; enforcement stays pinned");
    source_task.abort();
    if let Some(t) = events_task {
        t.abort();
    }
    forward_task.abort();
    resync_task.abort();
    http.abort();
    let _ = tx.send(Trigger::Stop);
    if worker.join().is_err() {
        warn!("sync worker panicked");
    }
    Ok(())
}
