//! The agent's own metrics, plus what the datapath reports at scrape time
//! (for BPF: the kernel's verdict counters and map fill).
use std::{
    fmt::Write as _,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

/// Figures a datapath adds at scrape time (appends Prometheus text).
pub type MetricsSource = std::sync::Arc<dyn Fn(&mut String) + Send + Sync>;

/// Upper bounds (seconds) of the sync duration histogram.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// Shared by the sync worker (writes) and the HTTP server (reads).
pub struct Metrics {
    datapath: Mutex<Option<MetricsSource>>,
    /// A sync has been enforced.
    synced: AtomicBool,
    /// The node's pod ranges are known (not only what the pins held).
    pod_ranges_known: AtomicBool,
    syncs_ok: AtomicU64,
    syncs_failed: AtomicU64,
    problems: AtomicU64,
    endpoints: AtomicU64,
    map_writes: AtomicU64,
    last_sync_unix: AtomicU64,
    /// Order checks between full passes: how many, their total and
    /// longest time (µs).
    order_checks: AtomicU64,
    order_check_us: AtomicU64,
    order_check_max_us: AtomicU64,
    durations: Mutex<Histogram>,
    errors_by_kind: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Entries the last sync could not write, by map (0 when all landed).
    shortfall: Mutex<std::collections::BTreeMap<String, u64>>,
    shortfall_total: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Entries the admitted policies compile to, and policies refused for
    /// a budget.
    compiled_entries: AtomicU64,
    policies_refused: AtomicU64,
    /// HTTP connections closed unanswered, by reason.
    http_dropped: Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            datapath: Mutex::new(None),
            synced: AtomicBool::new(false),
            pod_ranges_known: AtomicBool::new(false),
            syncs_ok: AtomicU64::new(0),
            syncs_failed: AtomicU64::new(0),
            problems: AtomicU64::new(0),
            endpoints: AtomicU64::new(0),
            map_writes: AtomicU64::new(0),
            last_sync_unix: AtomicU64::new(0),
            order_checks: AtomicU64::new(0),
            order_check_us: AtomicU64::new(0),
            order_check_max_us: AtomicU64::new(0),
            durations: Mutex::new(Histogram::default()),
            errors_by_kind: Mutex::new(Default::default()),
            shortfall: Mutex::new(Default::default()),
            shortfall_total: Mutex::new(Default::default()),
            compiled_entries: AtomicU64::new(0),
            policies_refused: AtomicU64::new(0),
            http_dropped: Mutex::new(Default::default()),
        }
    }

    /// What the datapath reports at scrape time, from now on.
    pub fn set_datapath(&self, source: Option<MetricsSource>) {
        if let Ok(mut d) = self.datapath.lock() {
            *d = source;
        }
    }

    /// Ready: a sync is enforced and the pod ranges are known. An agent
    /// that could not read its Node keeps enforcing (with the guard the
    /// pins hold) but is not ready: a rolling update stops at it instead
    /// of carrying on to nodes that may have no guard to keep.
    pub fn ready(&self) -> bool {
        self.not_ready().is_none()
    }

    /// Why the agent is not ready, if it is not.
    pub fn not_ready(&self) -> Option<&'static str> {
        if !self.synced.load(Ordering::Relaxed) {
            Some("first sync not enforced yet")
        } else if !self.pod_ranges_known.load(Ordering::Relaxed) {
            Some(
                "this node's pod ranges are not known (its Node could not be read): the pod-range guard is as the pins held it",
            )
        } else {
            None
        }
    }

    /// A sync was enforced; `pod_ranges_known`: with the node's pod ranges.
    pub fn set_synced(&self, pod_ranges_known: bool) {
        self.synced.store(true, Ordering::Relaxed);
        self.pod_ranges_known
            .store(pod_ranges_known, Ordering::Relaxed);
    }

    /// Records one sync that reached the datapath.
    /// One order check between full passes took `took`.
    pub fn order_checked(&self, took: Duration) {
        let us = took.as_micros() as u64;
        self.order_checks.fetch_add(1, Ordering::Relaxed);
        self.order_check_us.fetch_add(us, Ordering::Relaxed);
        self.order_check_max_us.fetch_max(us, Ordering::Relaxed);
    }

    pub fn sync_done(&self, took: Duration, writes: usize, endpoints: usize, problems: usize) {
        self.syncs_ok.fetch_add(1, Ordering::Relaxed);
        self.map_writes.fetch_add(writes as u64, Ordering::Relaxed);
        self.endpoints.store(endpoints as u64, Ordering::Relaxed);
        self.problems.store(problems as u64, Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.last_sync_unix.store(now, Ordering::Relaxed);
        self.observe(took);
    }

    /// Records what the last sync could not write, by map.
    pub fn map_shortfall(&self, by_map: &std::collections::BTreeMap<&'static str, usize>) {
        if let (Ok(mut now), Ok(mut total)) = (self.shortfall.lock(), self.shortfall_total.lock()) {
            for v in now.values_mut() {
                *v = 0;
            }
            for (map, n) in by_map {
                now.insert((*map).to_owned(), *n as u64);
                *total.entry((*map).to_owned()).or_default() += *n as u64;
            }
        }
    }

    /// What the compiler holds against its budgets after a sync.
    pub fn compiled(&self, entries: u64, refused: usize) {
        self.compiled_entries.store(entries, Ordering::Relaxed);
        self.policies_refused
            .store(refused as u64, Ordering::Relaxed);
    }

    /// One HTTP connection closed unanswered (or one accept failed):
    /// `evicted`, `full`, `read_timeout`, `write_timeout`, `accept_error`.
    pub fn http_dropped(&self, reason: &'static str) {
        if let Ok(mut m) = self.http_dropped.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    /// Records a sync that failed (the previous state stays enforced).
    pub fn sync_failed(&self, took: Duration, kind: &str) {
        self.syncs_failed.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut m) = self.errors_by_kind.lock() {
            *m.entry(kind.to_owned()).or_default() += 1;
        }
        self.observe(took);
    }

    fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        if let Ok(mut h) = self.durations.lock() {
            for (i, le) in BUCKETS.iter().enumerate() {
                if secs <= *le {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += secs;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, kind: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        gauge(
            "policy_agent_ready",
            "1 once the first full sync is enforced and the node's pod ranges are known.",
            "gauge",
            u64::from(self.ready()).to_string(),
        );
        gauge(
            "policy_agent_pod_ranges_known",
            "1 once the node's pod ranges are known (0: its Node could not be read; the pod-range guard is as the pins held it).",
            "gauge",
            u64::from(self.pod_ranges_known.load(Ordering::Relaxed)).to_string(),
        );
        gauge(
            "policy_agent_endpoints",
            "Local endpoints enforced.",
            "gauge",
            self.endpoints.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            "policy_agent_problems",
            "Objects not enforced as written in the last sync (invalid policies fail closed).",
            "gauge",
            self.problems.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            "policy_agent_compiled_entries",
            "Entries (policy-map keys and identities reached) the admitted policies compile to, against --compiled-entries-max.",
            "gauge",
            self.compiled_entries.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            "policy_agent_policies_refused",
            "Policies compiled to nothing for a budget (they fail closed, and are among the problems).",
            "gauge",
            self.policies_refused.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            "policy_agent_map_writes_total",
            "Map writes applied.",
            "counter",
            self.map_writes.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            "policy_agent_last_sync_timestamp_seconds",
            "Unix time of the last successful sync.",
            "gauge",
            self.last_sync_unix.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            "policy_agent_order_check_max_seconds",
            "The longest order check so far.",
            "gauge",
            (self.order_check_max_us.load(Ordering::Relaxed) as f64 / 1e6).to_string(),
        );
        let name = "policy_agent_order_check_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time spent looking for programs ahead of the classifiers between full passes.\n# TYPE {name} summary\n{name}_sum {}\n{name}_count {}",
            self.order_check_us.load(Ordering::Relaxed) as f64 / 1e6,
            self.order_checks.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP policy_agent_syncs_total Syncs by result.\n# TYPE policy_agent_syncs_total counter"
        );
        let _ = writeln!(
            out,
            "policy_agent_syncs_total{{result=\"ok\"}} {}",
            self.syncs_ok.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "policy_agent_syncs_total{{result=\"error\"}} {}",
            self.syncs_failed.load(Ordering::Relaxed)
        );
        if let Ok(m) = self.errors_by_kind.lock() {
            let _ = writeln!(
                out,
                "# HELP policy_agent_sync_errors_total Failed syncs by kind.\n# TYPE policy_agent_sync_errors_total counter"
            );
            for (k, v) in m.iter() {
                let _ = writeln!(out, "policy_agent_sync_errors_total{{kind=\"{k}\"}} {v}");
            }
        }
        if let Ok(h) = self.durations.lock() {
            let name = "policy_agent_sync_duration_seconds";
            let _ = writeln!(
                out,
                "# HELP {name} Time from a change to its enforcement in the datapath.\n# TYPE {name} histogram"
            );
            for (i, le) in BUCKETS.iter().enumerate() {
                let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {}", h.counts[i]);
            }
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
                h.count, h.sum, h.count
            );
        }
        if let (Ok(now), Ok(total)) = (self.shortfall.lock(), self.shortfall_total.lock()) {
            let _ = writeln!(
                out,
                "# HELP policy_agent_map_shortfall Entries the last sync could not write, by map (a full map fails closed).\n# TYPE policy_agent_map_shortfall gauge"
            );
            for (map, n) in now.iter() {
                let _ = writeln!(out, "policy_agent_map_shortfall{{map=\"{map}\"}} {n}");
            }
            let _ = writeln!(
                out,
                "# HELP policy_agent_map_write_failures_total Entries not written, by map.\n# TYPE policy_agent_map_write_failures_total counter"
            );
            for (map, n) in total.iter() {
                let _ = writeln!(
                    out,
                    "policy_agent_map_write_failures_total{{map=\"{map}\"}} {n}"
                );
            }
        }
        if let Ok(m) = self.http_dropped.lock() {
            let name = "policy_agent_http_dropped_total";
            let _ = writeln!(
                out,
                "# HELP {name} HTTP connections closed unanswered (and failed accepts), by reason.\n# TYPE {name} counter"
            );
            for (reason, n) in m.iter() {
                let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {n}");
            }
        }
        let source = self.datapath.lock().ok().and_then(|d| d.clone());
        if let Some(source) = source {
            source(&mut out);
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_synced_with_the_pod_ranges_known() {
        let m = Metrics::new();
        assert_eq!(m.not_ready(), Some("first sync not enforced yet"));
        m.set_synced(false);
        assert!(!m.ready());
        assert!(m.not_ready().is_some_and(|w| w.contains("pod ranges")));
        assert!(m.render().contains("\npolicy_agent_pod_ranges_known 0\n"));
        m.set_synced(true);
        assert!(m.ready());
        assert!(m.render().contains("\npolicy_agent_ready 1\n"));
    }
}
