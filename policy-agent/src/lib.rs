//! The policy agent: cluster state in, enforced datapath out.
//!
//! - [`cluster`]: the plain cluster model the compiler reads;
//! - [`mapstate`]: the datapath-neutral desired map content and its ordered diff.
pub mod cluster;
pub mod datapath;
pub mod mapstate;
pub mod sim;
