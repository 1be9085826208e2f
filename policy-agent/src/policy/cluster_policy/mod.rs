//! ClusterNetworkPolicy (`policy.networking.k8s.io/v1alpha2`): cluster-wide
//! rules in two tiers around NetworkPolicy, with priorities and Accept,
//! Deny and Pass.
//!
//! - `cluster::cluster_policy`: the object as it arrives, unknown fields
//!   kept;
//! - [`parse`]: validated, failing closed as the API requires;
//! - [`evaluate`]: the reference evaluator, from the API's text alone.
pub mod error;
pub mod evaluate;
pub mod parse;

pub use crate::cluster::ClusterNetworkPolicy;

pub use self::{
    error::{ClusterPolicyError, ClusterPolicyErrorKind, Effect},
    evaluate::{Connection, Decision, PodView, Remote, TierMatch, decide, first_match},
    parse::{
        Action, ClusterPeer, ClusterRule, ParsedClusterPolicy, ProtocolMatch, RuleMatch,
        SubjectSelector, Tier,
    },
};
