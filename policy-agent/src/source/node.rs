//! The node's own addresses as a source: read at start, read again when
//! netlink reports an address change (with a slow poll as a safety net),
//! published as [`Change::Node`] whenever they differ.
//!
//! Traffic between a pod and the node's own addresses (kubelet probes) is
//! always allowed, so these addresses are part of what is enforced.
use std::{net::IpAddr, time::Duration};

use tracing::warn;

use super::{Sink, SourceId, SourceUpdate};
use crate::{
    cluster::{Change, Problem},
    netlink,
};

/// How often the addresses are read without a netlink event.
const POLL: Duration = Duration::from_secs(30);

fn update(node: &str, ips: Vec<IpAddr>) -> SourceUpdate {
    SourceUpdate {
        source: SourceId::Node,
        changes: vec![Change::Node {
            name: node.to_owned(),
            ips,
        }],
        problems: Vec::new(),
    }
}

/// Publishes the addresses of the calling thread's network namespace for
/// `node`, and every change of them, until `sink` is closed. A failed read
/// is reported and the last known addresses stay.
pub async fn watch(node: String, sink: Sink) {
    let (event_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    if let Err(e) = netlink::watch_addresses(event_tx) {
        warn!(error = %e, "address events unavailable; polling the node's addresses");
    }
    let mut last: Option<Vec<IpAddr>> = None;
    loop {
        match netlink::local_addresses() {
            Ok(ips) if last.as_ref() != Some(&ips) => {
                last = Some(ips.clone());
                if !sink.send(update(&node, ips)) {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "reading the node's addresses; keeping the last known");
                let first = last.is_none();
                let problem = Problem::node(format!("reading the node's addresses: {e}"));
                let sent = if first {
                    // Publish the node name now; addresses follow.
                    last = Some(Vec::new());
                    let mut u = update(&node, Vec::new());
                    u.problems.push(problem);
                    sink.send(u)
                } else {
                    sink.send(SourceUpdate {
                        source: SourceId::Node,
                        changes: Vec::new(),
                        problems: vec![problem],
                    })
                };
                if !sent {
                    return;
                }
            }
        }
        tokio::select! {
            event = events.recv() => {
                if event.is_none() {
                    // The watcher thread ended: poll only.
                    tokio::time::sleep(POLL).await;
                }
                // A burst of address events (an interface coming up) settles first.
                tokio::time::sleep(Duration::from_millis(20)).await;
                while events.try_recv().is_ok() {}
            }
            () = tokio::time::sleep(POLL) => {}
        }
    }
}
