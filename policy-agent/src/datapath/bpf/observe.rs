//! What observes the BPF datapath while the agent runs: the flow thread
//! (the ring's one reader: names each record, counts it, logs it and
//! hands it to live subscribers), the classifier's debug log, and the
//! kernel-side figures for `/metrics`.
use std::{
    fmt::Write as _,
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use policy_common::{
    rule_name::{RuleKey, RuleName},
    verdict::Reason,
};
use tracing::{info, warn};

use super::{
    events::FlowRing,
    flows::{
        FlowLog,
        clock::WallClock,
        hub::{Hub, Line},
        naming::{FlowNamer, PinnedNames},
        record::Verdict,
        socket,
        stats::FlowStats,
    },
    kernel_log::follow_kernel_log as follow,
    loader::Classifiers,
    maps::BpfMaps,
    pins::{Hook, PinLayout},
};

/// Lines the flow log writes a second at most (the rest are counted).
const FLOW_LOG_PER_SECOND: usize = 20;
/// How often the per-policy series are checked against `RULE_NAMES`.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Forwards the classifier's debug log (emitted only while switched on).
pub(super) fn follow_kernel_log(layout: &PinLayout) {
    let id = Classifiers::open_pinned(layout)
        .ok()
        .and_then(|p| p.id(Hook::Ingress));
    if let Some(id) = id
        && let Err(e) = follow(id)
    {
        warn!(error = %e, "kernel debug log unavailable");
    }
}

/// The daemon's flow thread and what it shares with `/metrics`.
pub(super) struct FlowObserver {
    log: FlowLog,
    started: bool,
    stats: Arc<FlowStats>,
    hub: Arc<Hub>,
    retiring: Retiring,
}

/// Names a sync is about to remove from `RULE_NAMES`, handed to the flow
/// thread first: records of flows the rule judged may still be in the
/// ring, and are named with them.
type Retiring = Arc<Mutex<Vec<(RuleKey, RuleName)>>>;

impl FlowObserver {
    pub(super) fn new(log: FlowLog) -> Self {
        Self {
            log,
            started: false,
            stats: Arc::default(),
            hub: Arc::default(),
            retiring: Arc::default(),
        }
    }

    /// Hands the flow thread names about to be removed (see [`Retiring`]).
    pub(super) fn retire(&self, names: Vec<(RuleKey, RuleName)>) {
        if names.is_empty() || !self.started {
            return;
        }
        if let Ok(mut r) = self.retiring.lock() {
            r.extend(names);
        }
    }

    /// Starts the flow thread unless it runs; false while the ring
    /// cannot be opened.
    pub(super) fn start(&mut self, layout: &PinLayout) -> bool {
        if !self.started {
            self.started = spawn_flows(
                layout,
                self.log,
                self.stats.clone(),
                self.hub.clone(),
                self.retiring.clone(),
            );
        }
        self.started
    }

    /// What `/metrics` renders of the flows.
    pub(super) fn stats(&self) -> Arc<FlowStats> {
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

/// Reads the ring from a thread of its own and serves subscribers. False
/// when the ring cannot be opened (tried again after the next sync).
fn spawn_flows(
    layout: &PinLayout,
    log: FlowLog,
    stats: Arc<FlowStats>,
    hub: Arc<Hub>,
    retiring: Retiring,
) -> bool {
    let mut ring = match FlowRing::open(layout) {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "flow records unavailable");
            return false;
        }
    };
    if let Err(e) = socket::serve(layout, hub.clone()) {
        warn!(error = %e, "flow subscribers cannot connect (is another agent serving these pins?)");
    }
    let mut namer = FlowNamer::new(PinnedNames::new(layout), WallClock::now());
    std::thread::Builder::new()
        .name("flows".into())
        .spawn(move || {
            let mut limit = LogLimit {
                window: Instant::now(),
                logged: 0,
                skipped: 0,
            };
            let mut pruned = Instant::now();
            loop {
                let batch = ring.next_batch(Duration::from_secs(1));
                namer.tick();
                if pruned.elapsed() >= PRUNE_EVERY {
                    stats.retain(namer.live_labels());
                    pruned = Instant::now();
                }
                stats
                    .short_records
                    .store(ring.short_records(), Ordering::Relaxed);
                for record in batch {
                    // Before naming: a name removed since the batch was
                    // read is found here, not missed in the pins.
                    if let Ok(mut r) = retiring.lock()
                        && !r.is_empty()
                    {
                        namer.keep(r.drain(..));
                    }
                    let event = namer.name(&record);
                    stats.count(Reason::from_u8(record.reason), &event.flow);
                    if !hub.is_empty()
                        && let Ok(line) = serde_json::to_string(&event)
                    {
                        hub.publish(&Line::from(line));
                    }
                    let wanted = match log {
                        FlowLog::Off => false,
                        FlowLog::Drops => event.flow.verdict == Verdict::Drop,
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

/// Appends the kernel's verdict counters and map fill, read from the pins
/// now (nothing while nothing is pinned), and the flows' figures.
pub(super) fn render_metrics(out: &mut String, layout: &PinLayout, flows: Option<&FlowStats>) {
    let Ok(maps) = BpfMaps::from_pins(layout) else {
        return;
    };
    if let Ok(counters) = maps.counters() {
        let _ = writeln!(
            out,
            "# HELP policy_agent_packets_total Packets judged by the classifier, by verdict reason and pod direction.\n# TYPE policy_agent_packets_total counter"
        );
        for ((reason, dir), n) in &counters {
            let d = policy_common::direction::name(*dir);
            let _ = writeln!(
                out,
                "policy_agent_packets_total{{reason=\"{}\",direction=\"{d}\"}} {n}",
                reason.name()
            );
        }
        let _ = writeln!(
            out,
            "# HELP policy_agent_drops_total Packets dropped, by reason.\n# TYPE policy_agent_drops_total counter"
        );
        let mut drops: std::collections::BTreeMap<&str, u64> = Default::default();
        for ((reason, _), n) in &counters {
            if reason.is_drop() {
                *drops.entry(reason.name()).or_default() += n;
            }
        }
        for (r, n) in drops {
            let _ = writeln!(out, "policy_agent_drops_total{{reason=\"{r}\"}} {n}");
        }
        if let Some(flows) = flows {
            let sum = |wanted: Reason| -> u64 {
                counters
                    .iter()
                    .filter(|((r, _), _)| *r == wanted)
                    .map(|(_, n)| *n)
                    .sum()
            };
            flows.render(out, sum(Reason::RecordLimited), sum(Reason::EventLost));
        }
    }
    if let Ok(share) = maps.ct_share.get(&0, 0) {
        let _ = writeln!(
            out,
            "# HELP policy_agent_conntrack_share The most conntrack entries one pod may hold (0: no bound).\n# TYPE policy_agent_conntrack_share gauge\npolicy_agent_conntrack_share {}",
            share.share
        );
    }
    let _ = writeln!(
        out,
        "# HELP policy_agent_map_entries Entries in each datapath map.\n# TYPE policy_agent_map_entries gauge"
    );
    let fill = maps.fill();
    for (name, n, _) in &fill {
        let _ = writeln!(out, "policy_agent_map_entries{{map=\"{name}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP policy_agent_map_capacity Capacity of each datapath map.\n# TYPE policy_agent_map_capacity gauge"
    );
    for (name, _, cap) in &fill {
        let _ = writeln!(out, "policy_agent_map_capacity{{map=\"{name}\"}} {cap}");
    }
}
