//! The sync worker's one inbox of triggers. Every producer (the sources,
//! netlink link events, the CNI hand-off server, the timers, shutdown)
//! holds a [`Sink`] into it and sends straight in: nothing relays.
//!
//! The layers below the worker never name [`Trigger`]: a source gets a
//! [`source::Sink`] and netlink a closure, each made here, wrapping what
//! they send into the trigger it stands for. A closure is the simplest
//! shape that keeps the sources and netlink free of the worker's types and
//! of generics.
use std::{
    sync::mpsc::{self, RecvTimeoutError, TryRecvError},
    time::Instant,
};

use crate::{
    netlink::LinkEvent,
    source::{self, SourceUpdate},
};

/// What wakes the worker.
pub enum Trigger {
    Update(SourceUpdate),
    /// The CNI plugin hands a sandbox over (answered on the channel).
    Handoff(
        Box<policy_cni::protocol::Request>,
        tokio::sync::oneshot::Sender<policy_cni::protocol::Response>,
    ),
    /// A pod interface appeared or changed.
    Links,
    /// A veth appeared (ifindex, name): prepared at once (see
    /// `Datapath::new_veth`), then looked up as any link change.
    NewVeth(u32, String),
    /// Periodic: read the installed state back and sync.
    Resync,
    /// Periodic, between resyncs: a full pass only if what runs before
    /// the classifiers changed (see `Datapath::order_changed`).
    OrderCheck,
    Stop,
}

/// The receiving side, read by the sync thread alone.
pub struct Inbox(mpsc::Receiver<Trigger>);

/// A producer's way in; cloned for each producer.
#[derive(Clone)]
pub struct Sink(mpsc::Sender<Trigger>);

/// An empty inbox and the first sink into it.
pub fn new() -> (Inbox, Sink) {
    let (tx, rx) = mpsc::channel();
    (Inbox(rx), Sink(tx))
}

impl Inbox {
    /// The next trigger, waiting until `deadline` at most (None: as long as
    /// it takes); None if the deadline passed first. Once every sink is
    /// gone, [`Trigger::Stop`].
    pub fn recv(&self, deadline: Option<Instant>) -> Option<Trigger> {
        let received = match deadline {
            None => self.0.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(at) => {
                let now = Instant::now();
                if at <= now {
                    self.0.try_recv().map_err(|e| match e {
                        TryRecvError::Empty => RecvTimeoutError::Timeout,
                        TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                    })
                } else {
                    self.0.recv_timeout(at - now)
                }
            }
        };
        match received {
            Ok(trigger) => Some(trigger),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Trigger::Stop),
        }
    }
}

impl Sink {
    /// Sends `trigger`; false once the worker is gone.
    pub fn send(&self, trigger: Trigger) -> bool {
        self.0.send(trigger).is_ok()
    }

    /// A source's sink: each update becomes [`Trigger::Update`].
    pub fn for_source(&self) -> source::Sink {
        let sink = self.clone();
        source::Sink::new(move |update| sink.send(Trigger::Update(update)))
    }

    /// Netlink's link-event sink. New interfaces and pod routes make the
    /// worker look the interfaces up again at once, so pods get their
    /// classifiers and every other interface the uplink one; a new veth is
    /// also prepared at once.
    pub fn for_links(&self) -> impl Fn(LinkEvent) -> bool + Send + 'static {
        let sink = self.clone();
        move |event| {
            sink.send(match event {
                LinkEvent::Created(link) if link.kind.as_deref() == Some("veth") => {
                    Trigger::NewVeth(link.index, link.name)
                }
                _ => Trigger::Links,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn recv_times_out_then_stops_when_every_sink_is_gone() {
        let (inbox, sink) = new();
        assert!(inbox.recv(Some(Instant::now())).is_none());
        let soon = Instant::now() + Duration::from_millis(5);
        assert!(inbox.recv(Some(soon)).is_none());
        assert!(sink.send(Trigger::Resync));
        assert!(matches!(
            inbox.recv(Some(Instant::now())),
            Some(Trigger::Resync)
        ));
        drop(sink);
        assert!(matches!(inbox.recv(None), Some(Trigger::Stop)));
    }

    #[test]
    fn sinks_wrap_what_producers_send() {
        let (inbox, sink) = new();
        let update = SourceUpdate {
            source: source::SourceId::Node,
            changes: Vec::new(),
            problems: Vec::new(),
        };
        assert!(sink.for_source().send(update));
        assert!(matches!(inbox.recv(None), Some(Trigger::Update(_))));
        let links = sink.for_links();
        let link = |kind: &str| crate::netlink::Link {
            index: 7,
            name: "veth7".into(),
            kind: Some(kind.into()),
            framing: crate::netlink::Framing::Ethernet,
        };
        assert!(links(LinkEvent::Created(link("veth"))));
        assert!(matches!(
            inbox.recv(None),
            Some(Trigger::NewVeth(7, name)) if name == "veth7"
        ));
        assert!(links(LinkEvent::Created(link("bridge"))));
        assert!(links(LinkEvent::Changed(link("veth"))));
        assert!(links(LinkEvent::PodRoute { oif: 7 }));
        for _ in 0..3 {
            assert!(matches!(inbox.recv(None), Some(Trigger::Links)));
        }
        drop(inbox);
        assert!(!sink.send(Trigger::Resync));
    }
}
