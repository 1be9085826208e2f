//! Staged verdicts: each new flow's record judged again against the
//! staged view (the map content with the staged policies enforced too),
//! and, where that would change whether it passes, what would decide it.
//!
//! The kernel judges only what is enforced; the staged view is judged
//! here, from the record's pod, peer address, protocol and port, with the
//! same verdict model the kernel is tested against. An endpoint no staged
//! policy touches costs nothing; one that only a staged policy judges is
//! tracked (`ENDPOINT_STAGED`) so each of its new flows is recorded once.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use policy_common::{event::FlowRecord, verdict::Reason};

use super::{
    naming::{is_new_flow, policies},
    record::{Flow, Staged, Verdict},
};
use crate::{datapath::bpf::name_tables::NameTables, mapstate::StagedView};

/// The view the daemon's flow thread judges against, replaced after each
/// sync's writes (None: nothing is staged), with when it was replaced
/// (CLOCK_MONOTONIC ns, the clock records are stamped with).
pub type SharedView = Arc<Mutex<(Option<Arc<StagedView>>, u64)>>;

type Held = Option<(Arc<StagedView>, NameTables)>;

/// Judges records against the staged view they were made under: a record
/// stamped before the view was replaced is judged against the one before
/// (a policy un-staged a moment ago is still reported for the flows the
/// kernel judged before its enforcement landed).
#[derive(Default)]
pub struct StagedJudge {
    current: Held,
    previous: Held,
    /// When `current` replaced `previous`.
    since_ns: u64,
}

fn held(view: Option<Arc<StagedView>>) -> Held {
    view.map(|v| {
        let tables = NameTables {
            identities: v.identities.clone(),
            endpoints: BTreeMap::new(),
            rules: v.rule_names.clone(),
        };
        (v, tables)
    })
}

impl StagedJudge {
    /// Takes `view`, in place since `since_ns`, if it is not the one held.
    pub fn update(&mut self, view: Option<Arc<StagedView>>, since_ns: u64) {
        let same = match (&view, &self.current) {
            (Some(v), Some((held, _))) => Arc::ptr_eq(v, held),
            (None, None) => true,
            _ => false,
        };
        if !same {
            self.previous = std::mem::replace(&mut self.current, held(view));
            self.since_ns = since_ns;
        }
    }

    /// The view held now.
    pub fn view(&self) -> Option<&Arc<StagedView>> {
        self.current.as_ref().map(|(v, _)| v)
    }

    /// Sets `flow.staged` when the staged view would change whether the
    /// new flow of `record` passes. Only verdicts of policy are judged
    /// again (not a flow refused while its tier entries were landing).
    pub fn judge(&self, record: &FlowRecord, flow: &mut Flow) {
        let at = if record.timestamp_ns < self.since_ns {
            &self.previous
        } else {
            &self.current
        };
        let Some((view, tables)) = at else {
            return;
        };
        let Some(reason) = Reason::from_u8(record.reason) else {
            return;
        };
        if !is_new_flow(reason) || reason == Reason::DropUpdating || record.family == 0 {
            return;
        }
        let Ok(peer) = flow.peer.ip.parse() else {
            return;
        };
        let Some(v) = view.judge(
            &flow.pod,
            record.direction,
            peer,
            record.protocol,
            record.dport,
            reason,
        ) else {
            return;
        };
        flow.staged = Some(Staged {
            verdict: if v.reason.is_drop() {
                Verdict::Drop
            } else {
                Verdict::Allow
            },
            reason: v.reason.name().to_owned(),
            policies: policies(
                tables,
                v.reason,
                &v.rule,
                record.direction,
                v.endpoint_identity,
            ),
        });
    }
}
