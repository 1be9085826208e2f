//! Flow records named and handed on: the daemon is the ring's one reader
//! (a BPF ring buffer has a single consumer position, so two readers
//! would each see part of the records). It names each record, counts it
//! for `/metrics`, logs it, and fans it out to `policy-agent flows` over
//! a unix socket; without a daemon, `flows` reads the ring itself.
//!
//! - [`record`]: the named flow and its text form.
//! - [`naming`]: numbers to names, with a cache that outlives the pins.
//! - [`policies`]: which policies a record names.
//! - [`clock`]: the kernel's monotonic time as wall-clock time.
//! - [`filter`]: the `flows` command's filters.
//! - [`stats`]: the per-policy series, with their cardinality bound.
//! - [`hub`]: bounded queues to live subscribers.
//! - [`socket`]: the subscribers' socket, served and connected to.
//! - [`source`]: where a reader gets named flows (daemon or ring).
//! - [`budget`]: the per-CPU record budget the agent writes.
//! - [`staged`]: each new flow judged again against the staged view;
//!   [`staged_report`]: per staged policy, the flows it would change.
//! - [`pipeline`]: the daemon's flow thread, on either datapath's records.
pub mod budget;
pub mod clock;
pub mod filter;
pub mod hub;
pub mod naming;
pub mod pipeline;
pub mod policies;
pub mod record;
pub mod socket;
pub mod source;
pub mod staged;
pub mod staged_report;
pub mod stats;

use std::path::PathBuf;

pub use self::budget::FlowRate;

/// Which records the daemon's flow log writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlowLog {
    Off,
    /// Dropped packets and flows.
    #[default]
    Drops,
    All,
}

/// How flow records are limited and logged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowOptions {
    /// Written into `FLOW_BUDGET` at open (None: left as it is; a new map
    /// has no limit).
    pub rate: Option<FlowRate>,
    /// The daemon's flow log.
    pub log: FlowLog,
}

/// Errors of reading, naming and serving flows.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Bpf(#[from] super::Error),
    #[error("flow socket {name:?}: {source}")]
    Socket {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a flow from the agent could not be read: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("the agent serving the flows of {0} closed the connection (only root may subscribe)")]
    Closed(PathBuf),
    #[error("the agent refused the subscription: {0}")]
    Refused(String),
    #[error(transparent)]
    Iptables(#[from] crate::datapath::iptables::flow_log::Error),
}
