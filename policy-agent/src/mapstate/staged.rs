//! The staged view: the map content every policy would give, staged ones
//! included, as the verdict model reads it. The flow pipeline judges each
//! new flow's record against it and reports the flows whose verdict it
//! would change (see `cluster::staged`).
use std::{collections::BTreeMap, net::IpAddr, time::SystemTime};

use policy_common::{
    event::RuleRef,
    identity::IdentityName,
    model::{Maps, PeerOf},
    proto,
    rule_name::{RuleKey, RuleName},
    verdict::Reason,
};

use super::MapState;
use crate::cluster::{PodRef, staged::StagedPolicy};

/// What the staged view decides for one flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedVerdict {
    pub reason: Reason,
    /// The rule reference kept for `reason` (see [`RuleRef::kept_for`]),
    /// named in [`StagedView::rule_names`].
    pub rule: RuleRef,
    /// The pod's identity in the staged view (its isolating policies are
    /// named under it).
    pub endpoint_identity: u32,
}

/// The staged view of one node.
#[derive(Clone, Debug, Default)]
pub struct StagedView {
    /// The staged policies, each with when it was first seen staged.
    pub staged: BTreeMap<StagedPolicy, SystemTime>,
    /// The names of the rules and isolating policies of the staged view.
    pub rule_names: BTreeMap<RuleKey, RuleName>,
    pub identities: BTreeMap<u32, std::sync::Arc<IdentityName>>,
    model: Maps,
    /// "namespace/name" → the pod's key in `model.endpoints`.
    pods: BTreeMap<String, u32>,
}

impl StagedView {
    /// The view of `maps` (what the staged compiler holds).
    pub fn new(maps: &MapState<PodRef>, staged: BTreeMap<StagedPolicy, SystemTime>) -> Self {
        let mut pods = BTreeMap::new();
        let model = maps.to_model(|pod| {
            let key = pods.len() as u32 + 1;
            pods.insert(pod.to_string(), key);
            key
        });
        Self {
            staged,
            rule_names: maps.rule_names.clone(),
            identities: maps.identities.clone(),
            model,
            pods,
        }
    }

    /// Whether `pod` ("namespace/name") is a local endpoint of the view.
    pub fn has_pod(&self, pod: &str) -> bool {
        self.pods.contains_key(pod)
    }

    /// The staged verdict of a new flow of local `pod` in `dir` with
    /// `peer`, which the enforced maps judged `enforced`; None when the
    /// staged policies would not change whether it passes (or the pod is
    /// not in the view). A flow the enforced maps allowed as the pod's own
    /// (a Service hairpin) is judged so here too.
    pub fn judge(
        &self,
        pod: &str,
        dir: u8,
        peer: IpAddr,
        protocol: u8,
        dport: u16,
        enforced: Reason,
    ) -> Option<StagedVerdict> {
        let ep = self.model.endpoints.get(self.pods.get(pod)?)?;
        let peer_of = if enforced == Reason::AllowSelf {
            PeerOf::Itself
        } else {
            PeerOf::Address
        };
        let port = proto::policy_port(protocol, dport);
        let j = self.model.judge_as(ep, dir, peer, protocol, port, peer_of);
        (j.reason.is_drop() != enforced.is_drop()).then(|| StagedVerdict {
            reason: j.reason,
            rule: j.rule.kept_for(j.reason),
            endpoint_identity: ep.identity,
        })
    }
}
