//! The eBPF datapath: the classifier object, its pinned maps and programs,
//! and attachments to pod interfaces. Each file is one concern; siblings
//! and users import by path (`bpf::maps::BpfMaps`). The two names
//! re-exported here are the datapath's seam: [`BpfDriver`] (the
//! [`crate::datapath::Datapath`] implementation) and its [`Error`].
pub mod attach;
mod capacity_plan;
pub mod conntrack_share;
pub mod driver;
pub mod earlier_layout;
pub mod error;
pub mod events;
pub mod flows;
mod foreign_programs;
pub mod kernel_features;
pub mod kernel_log;
pub mod loader;
mod map_layout;
mod map_read;
pub mod maps;
pub mod name_tables;
pub mod object;
mod observe;
pub mod pins;
pub mod pod_range_guard;
mod program_load;
pub mod reset;
pub mod sizing;
mod standing_problems;
mod sync_pass;
pub mod sys;
pub mod unpinned;
mod uplinks;
mod verifier;

pub use self::{driver::BpfDriver, error::Error};
