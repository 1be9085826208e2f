//! Flows counted per policy rule for `/metrics`, with the label
//! cardinality bounded: a series lasts while its rule is named in
//! `RULE_NAMES` (pruned each minute), and at most [`MAX_SERIES`] exist;
//! past that, and for rules never named, flows count under
//! `kind="other"`.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use policy_common::verdict::Reason;

use super::{
    naming::is_new_flow,
    record::{Flow, PolicyRef},
};

/// The most per-policy series kept.
pub const MAX_SERIES: usize = 10_000;

/// The labels of one rule (a whole policy for an isolating one: `rule`
/// empty), without the verdict.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleLabels {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub rule: String,
    pub direction: &'static str,
}

impl RuleLabels {
    pub fn of(p: &PolicyRef, direction: &'static str) -> Self {
        Self {
            kind: p.kind.clone(),
            namespace: p.namespace.clone().unwrap_or_default(),
            name: p.name.clone(),
            rule: p.rule.map(|r| r.to_string()).unwrap_or_default(),
            direction,
        }
    }
}

#[derive(Default)]
struct Series {
    by_rule: BTreeMap<(RuleLabels, &'static str), u64>,
    /// Flows past the bound or of unnamed rules, by direction and verdict.
    other: BTreeMap<(&'static str, &'static str), u64>,
}

/// What the flow thread counts and `/metrics` renders.
#[derive(Default)]
pub struct FlowStats {
    series: Mutex<Series>,
    /// Records a subscriber's full queue lost.
    pub subscriber_lost: AtomicU64,
    /// Flow-log lines not written (past the log's rate).
    pub log_skipped: AtomicU64,
    /// Ring records too short to be a flow record.
    pub short_records: AtomicU64,
    /// Records the source lost (NFLOG: gaps in its sequence numbers).
    pub source_lost: AtomicU64,
    /// Per staged policy, the flows it would change.
    pub staged: super::staged_report::StagedTallies,
}

fn direction_label(d: &str) -> &'static str {
    if d == "ingress" { "ingress" } else { "egress" }
}

impl FlowStats {
    /// Counts `flow` (of `reason`) for each policy it names, if it is a
    /// new flow.
    pub fn count(&self, reason: Option<Reason>, flow: &Flow) {
        if !reason.is_some_and(is_new_flow) || flow.policies.is_empty() {
            return;
        }
        let dir = direction_label(&flow.direction);
        let verdict = flow.verdict.name();
        let Ok(mut s) = self.series.lock() else {
            return;
        };
        for p in &flow.policies {
            let key = (RuleLabels::of(p, dir), verdict);
            let room = s.by_rule.len() < MAX_SERIES;
            match s.by_rule.get_mut(&key) {
                Some(n) => *n += 1,
                None if room && !p.is_unknown() => {
                    s.by_rule.insert(key, 1);
                }
                None => *s.other.entry((dir, verdict)).or_default() += 1,
            }
        }
    }

    /// Drops the series of rules `live` no longer names.
    pub fn retain(&self, live: &BTreeSet<RuleLabels>) {
        if let Ok(mut s) = self.series.lock() {
            s.by_rule.retain(|(labels, _), _| live.contains(labels));
        }
    }

    /// How many per-rule series exist.
    pub fn series(&self) -> usize {
        self.series.lock().map_or(0, |s| s.by_rule.len())
    }

    /// The count of one series (tests, and the curious).
    pub fn get(&self, labels: &RuleLabels, verdict: &str) -> Option<u64> {
        let s = self.series.lock().ok()?;
        s.by_rule
            .iter()
            .find(|((l, v), _)| l == labels && *v == verdict)
            .map(|(_, n)| *n)
    }

    /// The flows counted under `kind="other"` in `direction` with `verdict`.
    pub fn other(&self, direction: &str, verdict: &str) -> u64 {
        self.series.lock().map_or(0, |s| {
            s.other
                .iter()
                .filter(|((d, v), _)| *d == direction && *v == verdict)
                .map(|(_, n)| *n)
                .sum()
        })
    }

    /// Appends the per-policy series and the records lost (`budget` and
    /// `ring`: the kernel's `RecordLimited` and `EventLost` counters).
    pub fn render(&self, out: &mut String, budget: u64, ring: u64) {
        let _ = writeln!(
            out,
            "# HELP policy_agent_policy_flows_total New flows allowed or dropped, by the policy rule that decided them (a policy drop counts for each NetworkPolicy isolating the pod, rule=\"\"). A series lasts while RULE_NAMES names its rule (checked each minute) and at most {MAX_SERIES} exist; past that, and for rules never named, flows count under kind=\"other\". Records the budget or a full ring lost are not counted.\n# TYPE policy_agent_policy_flows_total counter"
        );
        if let Ok(s) = self.series.lock() {
            for ((l, verdict), n) in &s.by_rule {
                let _ = writeln!(
                    out,
                    "policy_agent_policy_flows_total{{kind=\"{}\",namespace=\"{}\",name=\"{}\",rule=\"{}\",direction=\"{}\",verdict=\"{verdict}\"}} {n}",
                    escape(&l.kind),
                    escape(&l.namespace),
                    escape(&l.name),
                    escape(&l.rule),
                    l.direction
                );
            }
            for ((dir, verdict), n) in &s.other {
                let _ = writeln!(
                    out,
                    "policy_agent_policy_flows_total{{kind=\"other\",namespace=\"\",name=\"\",rule=\"\",direction=\"{dir}\",verdict=\"{verdict}\"}} {n}"
                );
            }
        }
        let subscriber = self.subscriber_lost.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP policy_agent_flow_records_lost_total Flow records lost: held back by the per-CPU budget (--flow-records-per-second), lost to a full ring, or dropped from a slow subscriber's queue.\n# TYPE policy_agent_flow_records_lost_total counter\npolicy_agent_flow_records_lost_total{{cause=\"budget\"}} {budget}\npolicy_agent_flow_records_lost_total{{cause=\"ring\"}} {ring}\npolicy_agent_flow_records_lost_total{{cause=\"subscriber\"}} {subscriber}"
        );
        self.staged.render(out);
        let _ = writeln!(
            out,
            "# HELP policy_agent_flow_log_skipped_total Flow-log lines not written, past the log's rate.\n# TYPE policy_agent_flow_log_skipped_total counter\npolicy_agent_flow_log_skipped_total {}",
            self.log_skipped.load(Ordering::Relaxed)
        );
    }
}

/// A Prometheus label value, escaped.
pub(super) fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
