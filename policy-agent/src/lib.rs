//! The policy agent: cluster state in, enforced datapath out.
//!
//! - [`cluster`]: the plain cluster model the compiler reads;
//! - [`identity`]: label and address-class identities and their stable numbers;
//! - [`policy`]: the compiler from cluster state to map content, and explain;
//! - [`mapstate`]: the datapath-neutral desired map content and its ordered diff.
pub mod cluster;
pub mod daemon;
pub mod datapath;
pub mod enforce;
pub mod identity;
pub mod inspect;
pub mod k8s;
pub mod mapstate;
pub mod metrics;
pub mod netlink;
pub mod policy;
pub mod sim;
