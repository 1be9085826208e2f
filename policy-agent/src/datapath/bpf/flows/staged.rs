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

/// The view the daemon's flow thread judges against, replaced by each
/// sync (None: nothing is staged).
pub type SharedView = Arc<Mutex<Option<Arc<StagedView>>>>;

/// Judges records against the current staged view.
#[derive(Default)]
pub struct StagedJudge {
    current: Option<(Arc<StagedView>, NameTables)>,
}

impl StagedJudge {
    /// Takes `view` if it is not the one held.
    pub fn update(&mut self, view: Option<Arc<StagedView>>) {
        match (view, &self.current) {
            (None, _) => self.current = None,
            (Some(v), Some((held, _))) if Arc::ptr_eq(&v, held) => {}
            (Some(v), _) => {
                let tables = NameTables {
                    identities: v.identities.clone(),
                    endpoints: BTreeMap::new(),
                    rules: v.rule_names.clone(),
                };
                self.current = Some((v, tables));
            }
        }
    }

    /// The view held.
    pub fn view(&self) -> Option<&Arc<StagedView>> {
        self.current.as_ref().map(|(v, _)| v)
    }

    /// Sets `flow.staged` when the staged view would change whether the
    /// new flow of `record` passes. Only verdicts of policy are judged
    /// again (not a flow refused while its tier entries were landing).
    pub fn judge(&self, record: &FlowRecord, flow: &mut Flow) {
        let Some((view, tables)) = &self.current else {
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
