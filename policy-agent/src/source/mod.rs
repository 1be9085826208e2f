//! Where the cluster state comes from. Every source speaks the cluster
//! model's vocabulary: it publishes [`Change`]s (all of its objects in its
//! first update, what changed after that) and the problems it met.
//!
//! - [`manifests`]: a directory of YAML manifests (the loader, and the
//!   inotify watcher that re-reads only changed files);
//! - [`kube`]: the API server (kube-rs watchers; Events on invalid
//!   policies);
//! - [`node`]: the node's own addresses (always allowed to reach its pods).
//!
//! A source publishes into a [`Sink`] its consumer made. The sink is a
//! boxed closure rather than a trait or a channel: the sources stay free of
//! generics and never name the consumer's types (the worker wraps each
//! update into its own trigger), and a test can collect updates in a plain
//! channel.
pub mod kube;
pub mod manifests;
pub mod node;

use crate::cluster::{Change, Problem};

/// Which source an update comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SourceId {
    Manifests,
    Kube,
    Node,
    /// What the command line says of the cluster (`--service-cidr`,
    /// `--pod-cidr`), sent once, before any other source.
    CommandLine,
    /// This node's pod ranges from its Node object.
    PodRanges,
}

/// What a source publishes.
#[derive(Clone, Debug)]
pub struct SourceUpdate {
    pub source: SourceId,
    /// The changes since this source's previous update; the first update
    /// holds every object the source knows.
    pub changes: Vec<Change>,
    /// What the source could not read; replaces its earlier list.
    pub problems: Vec<Problem>,
}

/// Where a source publishes its updates.
pub struct Sink(Box<dyn Fn(SourceUpdate) -> bool + Send + Sync>);

impl Sink {
    /// A sink that hands each update to `send`, which answers false once
    /// the consumer is gone.
    pub fn new(send: impl Fn(SourceUpdate) -> bool + Send + Sync + 'static) -> Self {
        Self(Box::new(send))
    }

    /// Publishes `update`; false once the consumer is gone (the source
    /// then stops).
    pub fn send(&self, update: SourceUpdate) -> bool {
        (self.0)(update)
    }
}
