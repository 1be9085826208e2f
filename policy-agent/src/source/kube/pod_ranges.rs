//! This node's pod ranges from its Node object (`spec.podCIDRs`, else
//! `spec.podCIDR`), for the pod-range guard when `--pod-cidr` is not
//! given.
//!
//! Read until the API server answers: while it does not, the ranges are
//! not known, and the datapath keeps the guard the pins (or the installed
//! rules) hold: an API hiccup at start must not disarm it. Meanwhile the
//! source says so as a node problem (log, `policy_agent_problems`, an
//! Event on the Node) and the agent is not ready. Only a Node read without
//! ranges turns the guard off.
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use tracing::{info, warn};

use super::super::{Sink, SourceId, SourceUpdate};
use crate::cluster::{Change, Problem, normalized_ranges, parse_cidr_sloppy};

/// First and longest wait between two reads.
const FIRST_RETRY: Duration = Duration::from_millis(500);
const LONGEST_RETRY: Duration = Duration::from_secs(30);

/// What a Node says of its pod ranges.
#[derive(Debug, PartialEq, Eq)]
pub struct NodePodCidrs {
    /// Host bits clear, sorted.
    pub ranges: Vec<IpNet>,
    /// Entries that do not read as a CIDR.
    pub unreadable: Vec<String>,
}

/// This node's pod ranges (`spec.podCIDRs`, else `spec.podCIDR`), read as
/// the Kubernetes controllers read them (`ParseCIDRSloppy`). Empty when the
/// node has none (its IPAM does not use them).
pub async fn node_pod_cidrs(client: Client, node: &str) -> Result<NodePodCidrs, kube::Error> {
    let n = Api::<Node>::all(client).get(node).await?;
    let spec = n.spec.unwrap_or_default();
    let cidrs = spec
        .pod_cidrs
        .filter(|v| !v.is_empty())
        .or_else(|| spec.pod_cidr.map(|c| vec![c]))
        .unwrap_or_default();
    let mut ranges = Vec::new();
    let mut unreadable = Vec::new();
    for c in cidrs {
        match parse_cidr_sloppy(&c) {
            Some(net) => ranges.push(net),
            None => unreadable.push(c),
        }
    }
    Ok(NodePodCidrs {
        ranges: normalized_ranges(ranges),
        unreadable,
    })
}

/// Reads this node's pod ranges with backoff until the Node answers, and
/// publishes them (a [`Change::PodRanges`]); a problem while it does not.
/// Returns once published, or once `sink` is closed.
pub async fn read_pod_ranges(client: Client, node: String, sink: Sink) {
    let mut wait = FIRST_RETRY;
    let mut failures = 0u32;
    loop {
        let (changes, problems, done) = match node_pod_cidrs(client.clone(), &node).await {
            Ok(read) if !read.unreadable.is_empty() && read.ranges.is_empty() => {
                // Only what could not be read: never taken for "none".
                let msg = format!(
                    "the Node's spec.podCIDRs {:?} do not read as CIDRs: the pod ranges are not known; the pod-range guard stays as held (pass --pod-cidr)",
                    read.unreadable
                );
                warn!(node = %node, "{msg}");
                (Vec::new(), vec![Problem::node(msg)], true)
            }
            Ok(read) => {
                let mut problems = Vec::new();
                if !read.unreadable.is_empty() {
                    let msg = format!(
                        "the Node's spec.podCIDRs {:?} do not read as CIDRs: left out of the pod ranges",
                        read.unreadable
                    );
                    warn!(node = %node, "{msg}");
                    problems.push(Problem::node(msg));
                }
                if read.ranges.is_empty() {
                    warn!(node = %node, "the Node has no spec.podCIDRs and --pod-cidr is not given: the pod-range guard is off; a new pod is unjudged until the agent attaches to it");
                } else {
                    info!(node = %node, ranges = ?read.ranges, "pod ranges from the Node's spec.podCIDRs");
                }
                (vec![Change::PodRanges(read.ranges)], problems, true)
            }
            Err(e) => {
                failures += 1;
                warn!(node = %node, error = %e, attempt = failures, retry_in = ?wait, "cannot read the Node's spec.podCIDRs: the pod ranges are not known; the pod-range guard stays as held, and the agent is not ready until they are");
                let problem = Problem::node(format!(
                    "the Node cannot be read ({}): its pod ranges are not known; the pod-range guard stays as held until they are",
                    failure_kind(&e)
                ));
                (Vec::new(), vec![problem], false)
            }
        };
        // A failure is published once (the problem stays until replaced).
        if done || failures == 1 {
            let update = SourceUpdate {
                source: SourceId::PodRanges,
                changes,
                problems,
            };
            if !sink.send(update) {
                return;
            }
        }
        if done {
            return;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(LONGEST_RETRY);
    }
}

/// A failure in a few stable words (an Event per distinct text: the
/// message of every attempt would make a new one each time).
fn failure_kind(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("HTTP {} {}", s.code, s.reason),
        _ => "the API server is unreachable".into(),
    }
}
