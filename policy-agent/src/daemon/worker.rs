//! The sync worker: one thread owns the datapath; triggers are coalesced
//! (debounced) and each burst ends in one sync.
use std::{
    sync::{
        Arc,
        mpsc::{Receiver, RecvTimeoutError},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tracing::{error, info, warn};

use super::Config;
use crate::{
    cluster::ClusterState,
    enforce::{self, Enforcer, Input, Problem, apply_to_state},
    inspect::DropEventReader,
    metrics::Metrics,
    netlink,
    policy::Change,
};

/// What a source publishes.
#[derive(Clone, Debug)]
pub enum SourceUpdate {
    /// The whole cluster (first publication, a re-list), with what the
    /// source could not read.
    Snapshot {
        state: ClusterState,
        problems: Vec<Problem>,
    },
    /// What changed since the last update; `problems` replaces the
    /// source's earlier list.
    Delta {
        changes: Vec<Change>,
        problems: Vec<Problem>,
    },
}

pub enum Trigger {
    Update(SourceUpdate),
    /// A pod interface appeared or changed.
    Links,
    /// Periodic: read the maps back and sync.
    Resync,
    Stop,
}

/// `problem_tx`: where each sync's problems go (cluster mode turns
/// invalid policies into Events).
pub fn spawn(
    config: Config,
    rx: Receiver<Trigger>,
    metrics: Arc<Metrics>,
    problem_tx: Option<tokio::sync::mpsc::UnboundedSender<Vec<Problem>>>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("sync".into())
        .spawn(move || run(config, rx, metrics, problem_tx))
}

fn run(
    config: Config,
    rx: Receiver<Trigger>,
    metrics: Arc<Metrics>,
    problem_tx: Option<tokio::sync::mpsc::UnboundedSender<Vec<Problem>>>,
) {
    let mut enforcer: Option<Box<dyn Enforcer + Send>> = None;
    // Input not yet enforced: a snapshot (with later changes folded in) or
    // changes since the last sync.
    let mut snapshot: Option<ClusterState> = None;
    let mut changes: Vec<Change> = Vec::new();
    let mut have_input = false;
    let mut source_problems: Vec<Problem> = Vec::new();
    let mut node_ips: Option<Vec<std::net::IpAddr>> = None;
    let mut last_problems: Vec<Problem> = Vec::new();
    let mut drops_started = false;
    let mut kernel_log_started = false;
    let mut retry_at: Option<Instant> = None;
    loop {
        // Wait for a trigger (or a pending retry), then let the burst settle.
        let first = match retry_at {
            Some(at) => match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                Ok(t) => Some(t),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            },
            None => match rx.recv() {
                Ok(t) => Some(t),
                Err(_) => return,
            },
        };
        let started = Instant::now();
        let mut resync = false;
        let mut links = false;
        let mut pending = first.into_iter().collect::<Vec<_>>();
        loop {
            for t in pending.drain(..) {
                match t {
                    Trigger::Update(SourceUpdate::Snapshot { state, problems }) => {
                        snapshot = Some(state);
                        changes.clear();
                        source_problems = problems;
                        have_input = true;
                    }
                    Trigger::Update(SourceUpdate::Delta {
                        changes: more,
                        problems,
                    }) => {
                        match snapshot.as_mut() {
                            Some(s) => more.iter().for_each(|c| apply_to_state(s, c)),
                            None => changes.extend(more),
                        }
                        source_problems = problems;
                        have_input = true;
                    }
                    Trigger::Links => links = true,
                    Trigger::Resync => resync = true,
                    Trigger::Stop => return,
                }
            }
            if started.elapsed() >= config.max_delay {
                break;
            }
            match rx.recv_timeout(config.debounce) {
                Ok(t) => pending.push(t),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        if !have_input {
            continue;
        }

        if enforcer.is_none() {
            match enforce::open(
                config.datapath,
                &config.layout,
                &config.load,
                config.iptables,
            ) {
                Ok(e) => enforcer = Some(e),
                Err(e) => {
                    error!(error = %e, "cannot open the datapath; retrying in 5s");
                    metrics.sync_failed(started.elapsed(), e.metric_label());
                    retry_at = Some(Instant::now() + Duration::from_secs(5));
                    continue;
                }
            }
        }
        let Some(enf) = enforcer.as_mut() else {
            continue;
        };
        if resync {
            enf.forget_cache();
        } else if links {
            enf.links_changed();
        }
        // The node's own addresses are part of the state.
        match netlink::local_addresses() {
            Ok(ips) if node_ips.as_ref() != Some(&ips) => {
                // A snapshot gets them below.
                if snapshot.is_none() {
                    changes.push(Change::Node {
                        name: config.node.clone(),
                        ips: ips.clone(),
                    });
                }
                node_ips = Some(ips);
            }
            Ok(_) => {}
            Err(e) => warn!(error = %e, "reading node addresses; keeping the last known"),
        }
        if let Some(s) = snapshot.as_mut() {
            s.node_ips = node_ips.clone().unwrap_or_default();
        }
        let result = match snapshot.as_ref() {
            Some(s) => enf.sync(Input::State(s)),
            None => enf.sync(Input::Changes(&changes)),
        };
        // The input is in the compiler now, whatever the datapath did.
        snapshot = None;
        changes.clear();
        match result {
            Ok(report) => {
                retry_at = None;
                let mut problems = source_problems.clone();
                problems.extend(report.problems.iter().cloned());
                metrics.sync_done(
                    started.elapsed(),
                    report.writes,
                    report.endpoints,
                    problems.len(),
                );
                metrics.set_ready();
                if report.writes > 0 || !report.attached.is_empty() || !report.detached.is_empty() {
                    info!(
                        writes = report.writes,
                        endpoints = report.endpoints,
                        attached = ?report.attached,
                        detached = ?report.detached,
                        took_ms = started.elapsed().as_millis() as u64,
                        "synced"
                    );
                }
                if problems != last_problems {
                    for p in &problems {
                        warn!(problem = %p, "not enforced as written");
                    }
                    if let Some(tx) = &problem_tx {
                        let _ = tx.send(problems.clone());
                    }
                    last_problems = problems;
                }
                if enf.name() == "bpf" {
                    // The drop logger is retried until it runs; the kernel
                    // log follower is started once (it would run twice).
                    if !drops_started {
                        drops_started = spawn_drop_logger(&config);
                    }
                    if !kernel_log_started {
                        kernel_log_started = true;
                        follow_kernel_log(&config);
                    }
                }
            }
            Err(e) => {
                error!(error = %e, "sync failed; the previous state stays enforced; retrying");
                metrics.sync_failed(started.elapsed(), e.metric_label());
                // Read everything back on the retry.
                enf.forget_cache();
                retry_at = Some(Instant::now() + Duration::from_secs(2));
            }
        }
    }
}

/// Forwards the classifier's debug log (emitted only while switched on).
fn follow_kernel_log(config: &Config) {
    let id = crate::datapath::bpf::Classifiers::open_pinned(&config.layout)
        .ok()
        .and_then(|p| p.id(crate::datapath::bpf::Hook::Ingress));
    if let Some(id) = id
        && let Err(e) = crate::inspect::follow_kernel_log(id)
    {
        warn!(error = %e, "kernel debug log unavailable");
    }
}

/// Logs drop events with pod names, from a thread of its own, at most
/// `DROP_LOG_PER_SECOND` lines a second (the rest are counted, and the
/// kernel counters have them all).
fn spawn_drop_logger(config: &Config) -> bool {
    const DROP_LOG_PER_SECOND: usize = 20;
    let layout = config.layout.clone();
    let reader = match DropEventReader::open(&layout) {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "drop events unavailable");
            return false;
        }
    };
    std::thread::Builder::new()
        .name("drop-events".into())
        .spawn(move || {
            let mut reader = reader;
            let mut window = Instant::now();
            let (mut logged, mut suppressed) = (0usize, 0usize);
            loop {
                for record in reader.next_batch(Duration::from_secs(1)) {
                    if window.elapsed() >= Duration::from_secs(1) {
                        if suppressed > 0 {
                            info!(target: "drops", suppressed, "more drops not logged");
                        }
                        window = Instant::now();
                        logged = 0;
                        suppressed = 0;
                    }
                    if logged < DROP_LOG_PER_SECOND {
                        info!(target: "drops", "{record}");
                        logged += 1;
                    } else {
                        suppressed += 1;
                    }
                }
            }
        })
        .is_ok()
}
