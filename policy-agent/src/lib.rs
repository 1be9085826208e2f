//! The policy agent: cluster state in, enforced datapath out.
//!
//! Layers, each importing only those below it (docs/ARCHITECTURE.md draws
//! them):
//! - vocabularies: [`cluster`] (the model and its [`cluster::Change`]s,
//!   [`cluster::Problem`]), [`identity`], [`mapstate`] (desired map
//!   content and its ordered diff);
//! - stages: [`source`] (manifests, the API server, node addresses) →
//!   [`policy`] (the compiler, explain) → [`datapath`] (bpf, iptables);
//!   no stage imports another;
//! - on top: [`worker`] (the `run` daemon, and the enforcer `apply`
//!   uses), [`inspect`] (`dump`);
//! - support: [`netlink`], [`exec`], [`metrics`].
//!
//! The simulated cluster the agent is tested and demonstrated on is the
//! `policy-testbed` crate: nothing of it is part of this one.
pub mod cluster;
pub mod datapath;
pub mod exec;
pub mod identity;
pub mod inspect;
pub mod mapstate;
pub mod metrics;
pub mod netlink;
pub mod policy;
pub mod source;
pub mod worker;
