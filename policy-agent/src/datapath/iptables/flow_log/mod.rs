//! Flow records on the iptables datapath: the record rules log each new
//! flow's verdict to NFLOG (see `render::records`), with what decided it
//! in the prefix ([`prefix`]); [`reader`] takes them from nfnetlink_log
//! and makes the same [`FlowRecord`]s the BPF datapath sends, and
//! [`names`] is what names them without pins: a file the driver writes
//! on every sync.
//!
//! [`FlowRecord`]: policy_common::event::FlowRecord
pub mod names;
mod packet;
pub mod pipeline;
pub mod prefix;
pub mod reader;

pub use self::{
    names::{DEFAULT_NAMES_FILE, IptablesNames, names_path, read_names, remove_names, write_names},
    pipeline::FileNames,
    prefix::RecordPrefix,
    reader::{IptablesFlowReader, ReaderStats, limited_records},
};

/// Errors of reading flow records and their names.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("nfnetlink_log socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error(
        "NFLOG group {group} is already bound by another socket (one reader per group: is a policy-agent daemon or ulogd reading it?)"
    )]
    GroupTaken { group: u16 },
    #[error("binding NFLOG group {group} needs CAP_NET_ADMIN")]
    NotPermitted { group: u16 },
    #[error("binding NFLOG group {group}: {source}")]
    Bind {
        group: u16,
        #[source]
        source: std::io::Error,
    },
    #[error("names file {path}: {source}")]
    NamesIo {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("names file {path}: {detail}")]
    NamesFormat {
        path: std::path::PathBuf,
        detail: String,
    },
    #[error(transparent)]
    Command(#[from] crate::exec::CommandError),
}
