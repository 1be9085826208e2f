//! Why a flow is allowed or dropped.
//!
//! Two answers, which must agree (the tests check they do):
//! - the map verdict: [`policy_common::model::Maps::judge`] over the
//!   compiled content, exactly what the kernel would do, with the keys it
//!   probed and the one that matched;
//! - the rule verdict: the policies read directly, naming the policies
//!   that select each endpoint and the rules, peers and ports that match.
//!
//! Egress is judged at the source if it is a local endpoint, ingress at the
//! destination if it is one; a flow passes if both pass. For a whole-cluster
//! view compile with [`super::CompileOptions::all_pods_local`].
mod judge;
mod report;
mod service;
mod tiers;

use std::net::IpAddr;

use policy_common::direction;

use self::judge::{Side, holders, judge_side, peer_report, pod_key};
pub use self::{
    report::{
        DirectionReport, Explanation, KeyReport, PeerReport, PolicyReport, RuleMatch, TierReport,
    },
    service::{
        BackendReport, ServiceExplainError, ServiceExplanation, ServiceQuery, explain_service,
    },
};
use super::{Compiled, PolicyErrorKind, parse::ParsedPolicy};
use crate::{
    cluster::{ClusterState, PodRef},
    identity::protocol_name,
};

/// One end of a flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlowEnd {
    Pod(PodRef),
    Ip(IpAddr),
}

/// A flow to explain: `protocol` is an IP protocol number, `port` the
/// destination port (ignored for protocols without ports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExplainQuery {
    pub src: FlowEnd,
    pub dst: FlowEnd,
    pub protocol: u8,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExplainError {
    #[error("pod {0} is not in the cluster state")]
    UnknownPod(PodRef),
    #[error(
        "pod {0} holds no IP address (pending, terminal, hostNetwork or its address taken by a newer pod)"
    )]
    NoAddress(PodRef),
    #[error("{src} and {dst} have no address family in common")]
    FamilyMismatch { src: String, dst: String },
}

/// Explains the flow `q` in `state`, compiled as `compiled`.
pub fn explain(
    state: &ClusterState,
    compiled: &Compiled,
    q: &ExplainQuery,
) -> Result<Explanation, ExplainError> {
    let held = holders(state);
    let addresses = |end: &FlowEnd| -> Result<Vec<IpAddr>, ExplainError> {
        match end {
            FlowEnd::Ip(ip) => Ok(vec![*ip]),
            FlowEnd::Pod(p) => {
                if !state.pods.contains_key(p) {
                    return Err(ExplainError::UnknownPod(p.clone()));
                }
                let ips: Vec<IpAddr> = held
                    .iter()
                    .filter(|(_, h)| *h == p)
                    .map(|(ip, _)| *ip)
                    .collect();
                if ips.is_empty() {
                    Err(ExplainError::NoAddress(p.clone()))
                } else {
                    Ok(ips)
                }
            }
        }
    };
    let (src_ips, dst_ips) = (addresses(&q.src)?, addresses(&q.dst)?);
    let pair = src_ips
        .iter()
        .find_map(|s| {
            dst_ips
                .iter()
                .find(|d| d.is_ipv4() == s.is_ipv4())
                .map(|d| (*s, *d))
        })
        .ok_or_else(|| ExplainError::FamilyMismatch {
            src: format!("{:?}", q.src),
            dst: format!("{:?}", q.dst),
        })?;
    let side = |address: IpAddr| Side {
        address,
        pod: held
            .get(&address)
            .and_then(|p| state.pods.get(p).map(|i| (p.clone(), pod_key(state, p, i)))),
    };
    let (src, dst) = (side(pair.0), side(pair.1));
    let mut model = compiled.maps.to_model(|_| 0);
    model.endpoints.clear();
    let parsed: Vec<ParsedPolicy> = state
        .policies
        .iter()
        .map(|(n, p)| {
            let mut parsed = ParsedPolicy::parse(n, p);
            // A policy the compiler refused for a budget fails closed as an
            // invalid one does: its rules allow nothing.
            let refused = compiled
                .errors
                .iter()
                .filter(|e| e.policy == *n && matches!(e.kind, PolicyErrorKind::Refused(_)));
            for e in refused {
                parsed.errors.push(e.clone());
                parsed.rules.clear();
            }
            parsed
        })
        .collect();

    let mut notes = Vec::new();
    let (egress, ingress) = if src.address == dst.address {
        notes.push(
            "source and destination are the same address: a pod may always talk to itself"
                .to_owned(),
        );
        (None, None)
    } else {
        (
            judge_side(
                state,
                compiled,
                &model,
                &parsed,
                direction::EGRESS,
                &src,
                &dst,
                q.protocol,
                q.port,
            ),
            judge_side(
                state,
                compiled,
                &model,
                &parsed,
                direction::INGRESS,
                &dst,
                &src,
                q.protocol,
                q.port,
            ),
        )
    };
    for (end, report, dir) in [(&src, &egress, "egress"), (&dst, &ingress, "ingress")] {
        if report.is_none() && src.address != dst.address {
            let who = end
                .pod
                .as_ref()
                .map_or_else(|| end.address.to_string(), |(p, _)| p.to_string());
            notes.push(format!(
                "{who} is not a local endpoint: its {dir} is not judged on this node"
            ));
        }
    }
    let allowed = [&egress, &ingress]
        .into_iter()
        .flatten()
        .all(|d| d.map_allowed);
    let mut out = Explanation {
        src: peer_report(state, compiled, &model, &src),
        dst: peer_report(state, compiled, &model, &dst),
        protocol: protocol_name(q.protocol).to_owned(),
        port: q.port,
        allowed,
        egress,
        ingress,
        notes,
    };
    if !out.consistent() {
        out.notes
            .push("map verdict and rule verdict disagree: this is a compiler bug".to_owned());
    }
    Ok(out)
}
