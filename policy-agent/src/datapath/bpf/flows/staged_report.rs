//! Per staged policy, the flows it would have changed since it was
//! staged: what `policy-agent staged-report` prints and `/metrics`
//! counts (`policy_agent_staged_flows_total`). A policy's tally lives
//! while it is staged: the series are bounded by the staged policies.
use std::{
    collections::BTreeMap,
    fmt::{self, Write as _},
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

use super::{
    clock::rfc3339,
    record::{Flow, Verdict},
};
use crate::{cluster::staged::StagedPolicy, mapstate::StagedView};

/// One staged policy's tally.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedTally {
    /// "NetworkPolicy" or "ClusterNetworkPolicy".
    pub kind: String,
    /// None for a ClusterNetworkPolicy.
    pub namespace: Option<String>,
    pub name: String,
    /// When the agent first saw it staged (RFC 3339, UTC).
    pub since: String,
    /// New flows it would drop (allowed now), by direction of the pod.
    pub would_drop_ingress: u64,
    pub would_drop_egress: u64,
    /// New flows it would admit (dropped now).
    pub would_allow_ingress: u64,
    pub would_allow_egress: u64,
    /// The last flow it would have changed.
    pub last: Option<Flow>,
}

impl StagedTally {
    fn new(p: &StagedPolicy, since: SystemTime) -> Self {
        let ns = since
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        Self {
            kind: p.kind().to_owned(),
            namespace: (!p.namespace().is_empty()).then(|| p.namespace().to_owned()),
            name: p.name().to_owned(),
            since: rfc3339(ns),
            ..Self::default()
        }
    }

    pub fn would_drop(&self) -> u64 {
        self.would_drop_ingress + self.would_drop_egress
    }

    pub fn would_allow(&self) -> u64 {
        self.would_allow_ingress + self.would_allow_egress
    }
}

/// The report: every staged policy, in name order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedReport {
    pub policies: Vec<StagedTally>,
    /// Flows the staged view would change that name no staged policy.
    pub unattributed: u64,
}

impl fmt::Display for StagedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.policies.is_empty() {
            return writeln!(f, "no policy is staged");
        }
        for t in &self.policies {
            let name = match &t.namespace {
                Some(ns) => format!("{ns}/{}", t.name),
                None => t.name.clone(),
            };
            writeln!(
                f,
                "{} {name}: staged since {}; would drop {} new flows ({} ingress, {} egress), would admit {} ({} ingress, {} egress)",
                t.kind,
                t.since,
                t.would_drop(),
                t.would_drop_ingress,
                t.would_drop_egress,
                t.would_allow(),
                t.would_allow_ingress,
                t.would_allow_egress
            )?;
            if let Some(last) = &t.last {
                writeln!(f, "  last: {last}")?;
            }
        }
        if self.unattributed > 0 {
            writeln!(
                f,
                "{} flows the staged view would change name no staged policy",
                self.unattributed
            )?;
        }
        Ok(())
    }
}

/// The tallies, kept by the flow thread.
#[derive(Default)]
pub struct StagedTallies {
    inner: Mutex<(BTreeMap<StagedPolicy, StagedTally>, u64)>,
}

fn staged_of(p: &super::record::PolicyRef) -> StagedPolicy {
    match &p.namespace {
        Some(ns) if p.kind == super::record::NETWORK_POLICY => StagedPolicy::NetworkPolicy {
            namespace: ns.clone(),
            name: p.name.clone(),
        },
        _ => StagedPolicy::ClusterNetworkPolicy {
            name: p.name.clone(),
        },
    }
}

impl StagedTallies {
    /// Follows `view`: a tally per staged policy, none for the others.
    pub fn follow(&self, view: Option<&StagedView>) {
        let Ok(mut g) = self.inner.lock() else {
            return;
        };
        let (tallies, unattributed) = &mut *g;
        match view {
            None => {
                tallies.clear();
                *unattributed = 0;
            }
            Some(v) => {
                tallies.retain(|p, _| v.staged.contains_key(p));
                for (p, since) in &v.staged {
                    tallies
                        .entry(p.clone())
                        .or_insert_with(|| StagedTally::new(p, *since));
                }
            }
        }
    }

    /// Counts `flow` for each staged policy its staged verdict names.
    pub fn count(&self, flow: &Flow) {
        let Some(staged) = &flow.staged else {
            return;
        };
        let Ok(mut g) = self.inner.lock() else {
            return;
        };
        let (tallies, unattributed) = &mut *g;
        let ingress = flow.direction == "ingress";
        let mut named = false;
        for p in &staged.policies {
            let Some(t) = tallies.get_mut(&staged_of(p)) else {
                continue;
            };
            named = true;
            let n = match (staged.verdict, ingress) {
                (Verdict::Drop, true) => &mut t.would_drop_ingress,
                (Verdict::Drop, false) => &mut t.would_drop_egress,
                (Verdict::Allow, true) => &mut t.would_allow_ingress,
                (Verdict::Allow, false) => &mut t.would_allow_egress,
            };
            *n += 1;
            t.last = Some(flow.clone());
        }
        if !named {
            *unattributed += 1;
        }
    }

    pub fn report(&self) -> StagedReport {
        self.inner
            .lock()
            .map(|g| StagedReport {
                policies: g.0.values().cloned().collect(),
                unattributed: g.1,
            })
            .unwrap_or_default()
    }

    /// Appends `policy_agent_staged_flows_total`.
    pub fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP policy_agent_staged_flows_total New flows a staged policy would change if it were enforced (verdict: what it would give), since it was staged. A series lasts while its policy is staged.\n# TYPE policy_agent_staged_flows_total counter"
        );
        let report = self.report();
        for t in &report.policies {
            for (dir, verdict, n) in [
                ("ingress", "drop", t.would_drop_ingress),
                ("egress", "drop", t.would_drop_egress),
                ("ingress", "allow", t.would_allow_ingress),
                ("egress", "allow", t.would_allow_egress),
            ] {
                let _ = writeln!(
                    out,
                    "policy_agent_staged_flows_total{{kind=\"{}\",namespace=\"{}\",name=\"{}\",direction=\"{dir}\",verdict=\"{verdict}\"}} {n}",
                    t.kind,
                    super::stats::escape(t.namespace.as_deref().unwrap_or("")),
                    super::stats::escape(&t.name),
                );
            }
        }
    }
}
