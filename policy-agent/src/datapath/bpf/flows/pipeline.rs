//! The daemon's flow thread, whatever the datapath: it reads records
//! (the BPF ring, or NFLOG), names each, counts it for `/metrics`, logs
//! it, and hands it to live subscribers on the local socket.
use std::{
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use policy_common::{
    event::FlowRecord,
    rule_name::{RuleKey, RuleName},
    verdict::Reason,
};
use tracing::{info, warn};

use super::{
    FlowLog,
    clock::{WallClock, monotonic_ns},
    hub::{Hub, Line},
    naming::{FlowNamer, NameSource},
    record::Verdict,
    socket,
    staged::{SharedView, StagedJudge},
    stats::FlowStats,
};
use crate::{datapath::bpf::pins::PinLayout, mapstate::StagedView};

/// Lines the flow log writes a second at most (the rest are counted).
const FLOW_LOG_PER_SECOND: usize = 20;
/// How often the per-policy series are checked against the names.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Where the flow thread reads records.
pub trait RecordSource {
    /// Waits up to `timeout` and returns the records available.
    fn next_batch(&mut self, timeout: Duration) -> Vec<FlowRecord>;
    /// Records skipped as malformed so far.
    fn short_records(&self) -> u64 {
        0
    }
    /// Records the source itself lost so far (beyond what the datapath
    /// counts on its own).
    fn lost(&self) -> u64 {
        0
    }
}

impl RecordSource for crate::datapath::bpf::events::FlowRing {
    fn next_batch(&mut self, timeout: Duration) -> Vec<FlowRecord> {
        crate::datapath::bpf::events::FlowRing::next_batch(self, timeout)
    }

    fn short_records(&self) -> u64 {
        crate::datapath::bpf::events::FlowRing::short_records(self)
    }
}

/// The daemon's flow thread and what it shares with `/metrics`.
pub struct FlowObserver {
    log: FlowLog,
    started: bool,
    stats: Arc<FlowStats>,
    hub: Arc<Hub>,
    retiring: Retiring,
    staged: SharedView,
}

/// Names a sync is about to remove from `RULE_NAMES`, handed to the flow
/// thread first: records of flows the rule judged may still be in the
/// ring, and are named with them.
type Retiring = Arc<Mutex<Vec<(RuleKey, RuleName)>>>;

impl FlowObserver {
    pub fn new(log: FlowLog) -> Self {
        Self {
            log,
            started: false,
            stats: Arc::default(),
            hub: Arc::default(),
            retiring: Arc::default(),
            staged: Arc::default(),
        }
    }

    /// The staged view records are judged against from now on (called
    /// once a sync's writes landed: records stamped before stay judged
    /// against the view before). The report follows at once: a policy
    /// no longer staged leaves it with this sync, not when the flow
    /// thread next wakes (up to a second later without records).
    pub fn set_staged(&self, view: Option<&Arc<StagedView>>) {
        if let Ok(mut v) = self.staged.lock() {
            let same = match (&v.0, view) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if !same {
                *v = (view.cloned(), monotonic_ns());
                // Under the view's lock, as the flow thread follows it:
                // neither can follow a view the other has replaced.
                self.stats.staged.follow(view.map(|v| &**v));
            }
        }
    }

    /// Hands the flow thread names about to be removed (see [`Retiring`]).
    pub fn retire(&self, names: Vec<(RuleKey, RuleName)>) {
        if names.is_empty() || !self.started {
            return;
        }
        if let Ok(mut r) = self.retiring.lock() {
            r.extend(names);
        }
    }

    /// Starts the flow thread unless it runs, on what `open` gives (the
    /// records and their names); false while that fails. Subscribers
    /// connect to the socket named after `layout`'s pin root.
    pub fn start<R, S>(
        &mut self,
        layout: &PinLayout,
        open: impl FnOnce() -> Result<(R, S), String>,
    ) -> bool
    where
        R: RecordSource + Send + 'static,
        S: NameSource + Send + 'static,
    {
        if !self.started {
            self.started = match open() {
                Ok((records, names)) => spawn_flows(
                    layout,
                    records,
                    names,
                    self.log,
                    self.stats.clone(),
                    self.hub.clone(),
                    self.retiring.clone(),
                    self.staged.clone(),
                ),
                Err(e) => {
                    warn!(error = %e, "flow records unavailable");
                    false
                }
            };
        }
        self.started
    }

    /// What `/metrics` renders of the flows.
    pub fn stats(&self) -> Arc<FlowStats> {
        self.stats.clone()
    }
}

/// The flow log's rate: a window of one second.
struct LogLimit {
    window: Instant,
    logged: usize,
    skipped: usize,
}

impl LogLimit {
    /// Whether one more line may go out now.
    fn take(&mut self, stats: &FlowStats) -> bool {
        if self.window.elapsed() >= Duration::from_secs(1) {
            if self.skipped > 0 {
                info!(target: "flows", skipped = self.skipped, "more flows not logged");
            }
            self.window = Instant::now();
            self.logged = 0;
            self.skipped = 0;
        }
        if self.logged < FLOW_LOG_PER_SECOND {
            self.logged += 1;
            true
        } else {
            self.skipped += 1;
            stats.log_skipped.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// Reads the records from a thread of its own and serves subscribers.
#[allow(clippy::too_many_arguments)]
fn spawn_flows<R, S>(
    layout: &PinLayout,
    mut ring: R,
    names: S,
    log: FlowLog,
    stats: Arc<FlowStats>,
    hub: Arc<Hub>,
    retiring: Retiring,
    staged: SharedView,
) -> bool
where
    R: RecordSource + Send + 'static,
    S: NameSource + Send + 'static,
{
    if let Err(e) = socket::serve(layout, hub.clone(), stats.clone()) {
        warn!(error = %e, "flow subscribers cannot connect (is another agent serving these pins?)");
    }
    let mut namer = FlowNamer::new(names, WallClock::now());
    std::thread::Builder::new()
        .name("flows".into())
        .spawn(move || {
            let mut limit = LogLimit {
                window: Instant::now(),
                logged: 0,
                skipped: 0,
            };
            let mut pruned = Instant::now();
            let mut judge = StagedJudge::default();
            loop {
                let batch = ring.next_batch(Duration::from_secs(1));
                namer.tick();
                if let Ok(v) = staged.lock() {
                    judge.update(v.0.clone(), v.1);
                    stats.staged.follow(judge.view().map(|v| &**v));
                }
                if pruned.elapsed() >= PRUNE_EVERY {
                    stats.retain(namer.live_labels());
                    pruned = Instant::now();
                }
                stats
                    .short_records
                    .store(ring.short_records(), Ordering::Relaxed);
                stats.source_lost.store(ring.lost(), Ordering::Relaxed);
                for record in batch {
                    // Before naming: a name removed since the batch was
                    // read is found here, not missed in the pins.
                    if let Ok(mut r) = retiring.lock()
                        && !r.is_empty()
                    {
                        namer.keep(r.drain(..));
                    }
                    let mut event = namer.name(&record);
                    judge.judge(&record, &mut event.flow);
                    stats.count(Reason::from_u8(record.reason), &event.flow);
                    stats.staged.count(&event.flow);
                    if !hub.is_empty()
                        && let Ok(line) = serde_json::to_string(&event)
                    {
                        hub.publish(&Line::from(line));
                    }
                    let wanted = match log {
                        FlowLog::Off => false,
                        FlowLog::Drops => {
                            event.flow.verdict == Verdict::Drop || event.flow.staged.is_some()
                        }
                        FlowLog::All => true,
                    };
                    if wanted
                        && limit.take(&stats)
                        && let Ok(line) = serde_json::to_string(&event.flow)
                    {
                        info!(target: "flows", "{line}");
                    }
                }
                stats.subscriber_lost.store(hub.lost(), Ordering::Relaxed);
            }
        })
        .is_ok()
}
