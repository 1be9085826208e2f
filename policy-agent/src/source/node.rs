//! The node's own addresses as a source: read at start, read again when
//! netlink reports an address change (with a slow poll as a safety net),
//! published as [`Change::Node`] whenever they differ.
//!
//! Traffic between a pod and the node's own addresses (kubelet probes) is
//! always allowed, so these addresses are part of what is enforced.
//!
//! One thread both waits on the netlink socket and reads the addresses:
//! nothing relays the events.
use std::{net::IpAddr, thread::JoinHandle, time::Duration};

use tracing::warn;

use super::{Sink, SourceId, SourceUpdate};
use crate::{
    cluster::{Change, Problem},
    netlink::{self, AddressEvents},
};

/// How often the addresses are read without a netlink event.
const POLL: Duration = Duration::from_secs(30);
/// How long a burst of address events (an interface coming up) may
/// settle before the addresses are read.
const SETTLE: Duration = Duration::from_millis(20);

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
/// `node`, and every change of them, from a background thread until
/// `sink` is closed. A failed read is reported and the last known
/// addresses stay.
pub fn watch(node: String, sink: Sink) -> std::io::Result<JoinHandle<()>> {
    // Subscribed here, before the first read, so no change is missed; the
    // thread inherits this thread's namespace.
    let events = match AddressEvents::subscribe() {
        Ok(events) => Some(events),
        Err(e) => {
            warn!(error = %e, "address events unavailable; polling the node's addresses");
            None
        }
    };
    std::thread::Builder::new()
        .name("node-addresses".into())
        .spawn(move || publish(&node, &sink, events))
}

fn publish(node: &str, sink: &Sink, mut events: Option<AddressEvents>) {
    let mut last: Option<Vec<IpAddr>> = None;
    loop {
        match netlink::local_addresses() {
            Ok(ips) if last.as_ref() != Some(&ips) => {
                last = Some(ips.clone());
                if !sink.send(update(node, ips)) {
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
                    let mut u = update(node, Vec::new());
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
        match events.as_mut() {
            Some(events) => {
                if events.wait(POLL) {
                    std::thread::sleep(SETTLE);
                    events.drain();
                }
            }
            None => std::thread::sleep(POLL),
        }
    }
}
