//! The sync worker, shaped like a kube-rs controller: triggers are
//! coalesced into one [`reconcile`] (on the leading edge: what has arrived
//! when the worker is free, or after a quiet time where one is set); a failure goes
//! through [`error_policy`], which decides when to try again; every
//! outcome is recorded in one place ([`record`]). One thread owns the
//! enforcer (compiler and datapath).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, error, info, warn};

use super::{
    Config, Enforcer,
    handoff::Handoffs,
    inbox::{Inbox, Trigger},
};
use crate::{
    cluster::{Change, Problem},
    datapath::{self, SyncReport},
    metrics::Metrics,
    source::SourceId,
};

/// When to try again after a sync that could not write everything.
const INCOMPLETE_RETRY: Duration = Duration::from_secs(10);

/// What every reconcile shares.
pub struct Context {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// Where each sync's problems go (cluster mode: Events on policies).
    pub events: Option<UnboundedSender<Vec<Problem>>>,
    /// Where each sync's ClusterNetworkPolicy standings go (cluster mode:
    /// their status, written by one agent of the cluster).
    pub standings: Option<tokio::sync::watch::Sender<crate::source::kube::Standings>>,
    /// The sources whose first update the first sync waits for.
    pub sources: BTreeSet<SourceId>,
}

/// What the worker holds between reconciles.
struct State {
    handoffs: Handoffs,
    enforcer: Option<Enforcer>,
    /// Changes not yet handed to the compiler, in arrival order.
    changes: Vec<Change>,
    /// Each source's current problems.
    source_problems: BTreeMap<SourceId, Vec<Problem>>,
    /// Sources heard from at least once.
    heard: BTreeSet<SourceId>,
    links: bool,
    resync: bool,
    /// Problems last reported (they are logged and published on change).
    reported: Vec<Problem>,
    observers_started: bool,
    /// A sync has run (the CNI plugin's STATUS).
    synced: bool,
}

impl State {
    fn new(config: &Config) -> Self {
        Self {
            handoffs: Handoffs::new(config.node.clone(), config.cni_wait),
            enforcer: None,
            changes: Vec::new(),
            source_problems: BTreeMap::new(),
            heard: BTreeSet::new(),
            links: false,
            resync: false,
            reported: Vec::new(),
            observers_started: false,
            synced: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open the datapath: {0}")]
    Open(#[source] datapath::Error),
    #[error("sync failed: {0}")]
    Sync(#[source] datapath::Error),
}

impl Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Open(e) | Error::Sync(e) => e.metric_label(),
        }
    }
}

/// When to sync again after a sync that left something undone.
const RETRY_UNFINISHED: Duration = Duration::from_secs(2);

pub fn spawn(ctx: Context, inbox: Inbox) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("sync".into())
        .spawn(move || run(&ctx, &inbox))
}

fn run(ctx: &Context, inbox: &Inbox) {
    let mut state = State::new(&ctx.config);
    // Opened at once, while the sources read the cluster: the first sync
    // then waits for the slower of the two, not for both in turn. A
    // failure here is the first reconcile's to retry and report.
    if let Err(e) = open(ctx, &mut state) {
        debug!(error = %e, "the datapath did not open at start; the first sync tries again");
    }
    let mut retry_at: Option<Instant> = None;
    loop {
        let wake = match (retry_at, state.handoffs.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let started = match collect(ctx, inbox, &mut state, wake) {
            Collected::Stop => return,
            Collected::Nothing => continue,
            Collected::Sync { started } => started,
        };
        if !ctx.sources.is_subset(&state.heard) {
            // The first sync waits for every source's first word; waiting
            // hand-offs run out meanwhile.
            state.handoffs.confirm(None);
            continue;
        }
        let reconciling = Instant::now();
        let result = reconcile(ctx, &mut state);
        retry_at = match &result {
            // What was written stands; what could not be done (a conntrack
            // deletion) is retried by the datapath on the next sync.
            Ok(report) if report.retry => Some(Instant::now() + RETRY_UNFINISHED),
            // Short of room or a failed write: safe but not what was asked;
            // the driver reads the maps back on the retry.
            Ok(report) if report.incomplete => Some(Instant::now() + INCOMPLETE_RETRY),
            Ok(_) => None,
            Err(e) => Some(Instant::now() + error_policy(e, &mut state)),
        };
        record(
            ctx,
            &mut state,
            &result,
            started.elapsed(),
            reconciling.elapsed(),
        );
    }
}

/// What a burst of triggers asks of the worker.
#[derive(Debug)]
enum Collected {
    /// [`Trigger::Stop`], or every sink is gone.
    Stop,
    /// Only checks that found nothing to do (an order check that found no
    /// change).
    Nothing,
    /// Sync now. The burst began at `started`; the sync's time counts from
    /// there.
    Sync { started: Instant },
}

/// Waits for a trigger (or the pending retry at `retry_at`), then takes
/// what has arrived meanwhile; with a `debounce` set, lets the burst
/// settle: until `debounce` passes quietly, at most `max_delay`. A CNI
/// hand-off does not wait for quiet: a pod's start waits on it, so
/// what has arrived by then is taken and the sync runs at once.
fn collect(
    ctx: &Context,
    inbox: &Inbox,
    state: &mut State,
    retry_at: Option<Instant>,
) -> Collected {
    // None: the retry is due.
    let first = inbox.recv(retry_at);
    let started = Instant::now();
    // A due retry is work; so is every trigger but a quiet order check.
    let mut work = first.is_none();
    let mut next = first;
    let mut handoff = false;
    let settled = |work: bool| {
        if work {
            Collected::Sync { started }
        } else {
            Collected::Nothing
        }
    };
    loop {
        work |= next
            .as_ref()
            .is_some_and(|t| !matches!(t, Trigger::OrderCheck));
        match next.take() {
            Some(Trigger::Update(update)) => {
                state.heard.insert(update.source);
                state.changes.extend(update.changes);
                state.source_problems.insert(update.source, update.problems);
            }
            Some(Trigger::Handoff(req, reply)) => {
                state.handoffs.receive(*req, reply, state.synced);
                handoff = true;
            }
            Some(Trigger::Links) => state.links = true,
            Some(Trigger::NewVeth(ifindex, name)) => {
                state.links = true;
                if let Some(enforcer) = state.enforcer.as_mut() {
                    enforcer.datapath().new_veth(ifindex, &name);
                }
            }
            Some(Trigger::Resync) => state.resync = true,
            Some(Trigger::OrderCheck) => {
                if let Some(enforcer) = state.enforcer.as_mut() {
                    let t = Instant::now();
                    let changed = enforcer.datapath().order_changed();
                    ctx.metrics.order_checked(t.elapsed());
                    if changed {
                        state.resync = true;
                        work = true;
                    }
                }
            }
            Some(Trigger::Stop) => return Collected::Stop,
            None => {}
        }
        if started.elapsed() >= ctx.config.max_delay {
            return settled(work);
        }
        // After a hand-off, only what has already arrived.
        let quiet = Instant::now()
            + if handoff {
                Duration::ZERO
            } else {
                ctx.config.debounce
            };
        next = inbox.recv(Some(quiet));
        if next.is_none() {
            return settled(work);
        }
    }
}

/// Opens the datapath unless it is open. Changes wait (uncompiled) until
/// it is, so the compiler starts from the identity numbers it already
/// uses.
fn open(ctx: &Context, state: &mut State) -> Result<(), Error> {
    if state.enforcer.is_none() {
        let enforcer =
            Enforcer::open(&ctx.config.datapath, ctx.config.compile).map_err(Error::Open)?;
        ctx.metrics.set_datapath(enforcer.metrics());
        state.enforcer = Some(enforcer);
    }
    Ok(())
}

/// Opens the datapath if need be and enforces every pending change.
fn reconcile(ctx: &Context, state: &mut State) -> Result<SyncReport, Error> {
    open(ctx, state)?;
    let Some(enforcer) = state.enforcer.as_mut() else {
        unreachable!("opened above");
    };
    let (first, full_pass) = (!state.synced, state.resync);
    if std::mem::take(&mut state.resync) {
        enforcer.datapath().forget_cache();
        enforcer.recompile_refused();
        state.links = false;
    } else if std::mem::take(&mut state.links) {
        enforcer.datapath().links_changed();
    }
    // The changes are the compiler's from here, whatever the datapath does.
    let mut changes = std::mem::take(&mut state.changes);
    let compiler = enforcer.compiler();
    state
        .handoffs
        .rewrite(&mut changes, |pod| compiler.pod(pod).cloned());
    let result = enforcer.enforce(changes);
    // Answered from what the kernel holds, whether the sync went through
    // or not.
    state.handoffs.confirm(Some(enforcer.datapath_ref()));
    let report = result.map_err(Error::Sync)?;
    state.synced = true;
    if super::heap::worth_trimming(first, full_pass, report.writes) {
        super::heap::release_freed();
    }
    if !state.observers_started {
        state.observers_started = enforcer.datapath().start_observers();
    }
    Ok(report)
}

/// When to try again after `error`, and what the retry must redo.
fn error_policy(error: &Error, state: &mut State) -> Duration {
    match error {
        // Nothing opened: the pending changes are still pending.
        Error::Open(_) => Duration::from_secs(5),
        // The maps hold an unknown prefix of the writes: read everything
        // back on the retry.
        Error::Sync(_) => {
            state.resync = true;
            Duration::from_secs(2)
        }
    }
}

/// Logs, metrics and Events for one reconcile, in one place. `took`
/// counts from the burst's first trigger, `reconciled` from the
/// reconcile's start (what arrived before then is in it).
fn record(
    ctx: &Context,
    state: &mut State,
    result: &Result<SyncReport, Error>,
    took: Duration,
    reconciled: Duration,
) {
    match result {
        Ok(report) => {
            let mut problems: Vec<Problem> =
                state.source_problems.values().flatten().cloned().collect();
            problems.extend(state.handoffs.problems().cloned());
            problems.extend(report.problems.iter().cloned());
            ctx.metrics
                .sync_done(took, report.writes, report.endpoints, problems.len());
            ctx.metrics.map_shortfall(&report.map_failures);
            if let Some(enforcer) = state.enforcer.as_ref() {
                let (entries, refused) = enforcer.compiler().budget_use();
                ctx.metrics.compiled(entries, refused);
                if let Some(tx) = &ctx.standings {
                    let now = enforcer.compiler().cluster_policy_standings();
                    tx.send_if_modified(|had| {
                        let changed = *had != now;
                        *had = now;
                        changed
                    });
                }
            }
            let known = state
                .enforcer
                .as_ref()
                .is_some_and(Enforcer::pod_ranges_known);
            ctx.metrics.set_synced(known);
            if report.writes > 0 || !report.attached.is_empty() || !report.detached.is_empty() {
                info!(
                    writes = report.writes,
                    endpoints = report.endpoints,
                    attached = ?report.attached,
                    detached = ?report.detached,
                    took_ms = took.as_millis() as u64,
                    took_us = took.as_micros() as u64,
                    reconcile_us = reconciled.as_micros() as u64,
                    "synced"
                );
            }
            if problems != state.reported {
                // Each problem is logged once, when it appears (a node with
                // many pending pods would otherwise repeat them all at every
                // sync); Events and metrics carry the whole list.
                let before: BTreeSet<&Problem> = state.reported.iter().collect();
                let now: BTreeSet<&Problem> = problems.iter().collect();
                for p in now.difference(&before) {
                    warn!(problem = %p, "not enforced as written");
                }
                let settled = before.difference(&now).count();
                if settled > 0 {
                    info!(settled, remaining = problems.len(), "problems settled");
                }
                if let Some(tx) = &ctx.events {
                    let _ = tx.send(problems.clone());
                }
                state.reported = problems;
            }
        }
        Err(e) => {
            match e {
                Error::Open(_) => error!(error = %e, "retrying in 5s"),
                Error::Sync(_) => {
                    error!(error = %e, "the previous state stays enforced; retrying in 2s")
                }
            }
            ctx.metrics.sync_failed(took, e.metric_label());
        }
    }
}

#[cfg(test)]
mod tests {
    use policy_cni::protocol::{Command, PROTOCOL_VERSION, Request};

    use super::*;
    use crate::{datapath::bpf::pins::PinLayout, source::SourceUpdate, worker::inbox};

    fn context(debounce: Duration, max_delay: Duration) -> Context {
        let mut config = Config::new("node".into(), PinLayout::new("/nonexistent"));
        config.debounce = debounce;
        config.max_delay = max_delay;
        Context {
            config,
            metrics: Arc::new(Metrics::new()),
            events: None,
            standings: None,
            sources: [SourceId::Node].into_iter().collect(),
        }
    }

    fn node_update() -> Trigger {
        Trigger::Update(SourceUpdate {
            source: SourceId::Node,
            changes: Vec::new(),
            problems: Vec::new(),
        })
    }

    #[test]
    fn a_burst_is_one_sync_and_stop_stops() {
        let ctx = context(Duration::from_millis(20), Duration::from_secs(5));
        let mut state = State::new(&ctx.config);
        let (inbox, sink) = inbox::new();
        sink.send(node_update());
        sink.send(Trigger::Links);
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Sync { .. }
        ));
        assert!(state.heard.contains(&SourceId::Node) && state.links);
        sink.send(Trigger::Stop);
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Stop
        ));
        drop(sink);
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Stop
        ));
    }

    #[test]
    fn without_a_debounce_a_sync_takes_what_has_arrived_and_starts_at_once() {
        let ctx = context(Duration::ZERO, Duration::from_secs(5));
        let mut state = State::new(&ctx.config);
        let (inbox, sink) = inbox::new();
        sink.send(node_update());
        sink.send(Trigger::Links);
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Sync { .. }
        ));
        assert!(
            state.heard.contains(&SourceId::Node) && state.links,
            "both queued triggers are in this sync"
        );
        // Nothing queued: the next trigger is the next sync's.
        sink.send(Trigger::Resync);
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Sync { .. }
        ));
        assert!(state.resync);
    }

    #[test]
    fn a_quiet_order_check_is_nothing_and_a_due_retry_is_a_sync() {
        let ctx = context(Duration::from_millis(5), Duration::from_secs(5));
        let mut state = State::new(&ctx.config);
        let (inbox, sink) = inbox::new();
        sink.send(Trigger::OrderCheck);
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Nothing
        ));
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, Some(Instant::now())),
            Collected::Sync { .. }
        ));
    }

    #[test]
    fn a_handoff_does_not_wait_for_quiet_and_max_delay_ends_a_burst() {
        let ctx = context(Duration::from_secs(60), Duration::from_millis(50));
        let mut state = State::new(&ctx.config);
        let (inbox, sink) = inbox::new();
        let (reply, _answer) = tokio::sync::oneshot::channel();
        let request = Request {
            version: PROTOCOL_VERSION,
            container_id: "c".into(),
            command: Command::Del { pod: None },
        };
        sink.send(Trigger::Handoff(Box::new(request), reply));
        let t = Instant::now();
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Sync { .. }
        ));
        assert!(t.elapsed() < Duration::from_secs(5));

        // A steady stream of triggers is cut at max_delay.
        let producer = std::thread::spawn(move || {
            while sink.send(Trigger::Links) {
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let t = Instant::now();
        assert!(matches!(
            collect(&ctx, &inbox, &mut state, None),
            Collected::Sync { .. }
        ));
        assert!(t.elapsed() < Duration::from_secs(5));
        drop(inbox);
        assert!(producer.join().is_ok());
    }
}
