//! The semantic core: NetworkPolicy (networking.k8s.io/v1) compiled into
//! datapath-neutral map content.
//!
//! - [`compile`]: cluster state → [`Compiled`] (the desired maps, the local
//!   endpoints, the rule behind each entry, the policies that failed);
//! - [`Compiler`]: the same, kept up to date change by change, returning
//!   the ordered map writes ([`Compiler::apply`]);
//! - [`explain`]: why a flow is allowed or dropped, from the compiled maps
//!   (through [`policy_common::model::Maps::judge`]) and from the rules;
//! - [`evaluate`]: one rule against one flow, a spec sentence per helper,
//!   shared by `explain` and the compiler.
//!
//! Decisions (see each module for the spec lines they implement):
//! - invalid policies fail closed: they isolate what they select in the
//!   directions they declare and allow nothing ([`parse`]);
//! - ipBlocks are compiled to address classes ([`classes`]);
//! - named ports in egress resolve per peer identity ([`compiler`]);
//! - hostNetwork pods have no identity and are never selected as peers or
//!   endpoints: their addresses are the node's; terminal pods hold no
//!   address; of two live pods claiming one address the newest (then the
//!   first by namespace/name) holds it.
mod classes;
pub mod cluster_policy;
mod compiler;
mod error;
pub mod evaluate;
mod explain;
mod parse;
mod peer;
mod ports;
mod selector;

use std::{collections::BTreeMap, net::IpAddr};

pub use self::{
    compiler::{Budget, CompileOptions, Compiler, Refusal},
    error::{PolicyError, PolicyErrorKind},
    explain::{
        BackendReport, DirectionReport, ExplainError, ExplainQuery, Explanation, FlowEnd,
        KeyReport, PeerReport, PolicyReport, RuleMatch, ServiceExplainError, ServiceExplanation,
        ServiceQuery, TierReport, explain, explain_service,
    },
    parse::{ParsedPolicy, Peers, Rule, rule_ref},
    peer::{IpBlock, Namespaces, Peer},
    ports::{PortMatch, Ports, range_blocks},
    selector::{Requirement, Selector},
};
use crate::{
    cluster::{ClusterState, PodRef},
    identity::{IdentityAllocator, IdentityError},
    mapstate::{MapState, RuleOrigin},
};

/// The result of compiling one cluster state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// Desired map content, endpoints keyed by local pod (pods whose
    /// node_name == state.node_name, not hostNetwork, not terminal, holding
    /// at least one IP). `finalize()` already applied; revisions left 0
    /// (the datapath assigns them with `mapstate::assign_revisions`).
    pub maps: MapState<PodRef>,
    /// The IPs of each local endpoint pod (the datapath finds its host
    /// interface by route lookup).
    pub local_pods: BTreeMap<PodRef, Vec<IpAddr>>,
    /// PolicyEntry.rule_ref → the rule it came from.
    pub rules: BTreeMap<u32, RuleOrigin>,
    /// Objects that could not be compiled as written; each names the
    /// object and the field.
    pub errors: Vec<PolicyError>,
    /// Identity numbers that could not be allocated (never in practice:
    /// 2^24 label identities).
    pub identity_errors: Vec<IdentityError>,
}

/// Compiles `state` for the node `state.node_name`.
///
/// This is one identity generation: it allocates the numbers of new keys,
/// releases those no longer used and ends the generation of `ids` (see
/// [`IdentityAllocator`]); callers do not call `end_generation` again.
pub fn compile(state: &ClusterState, ids: &mut IdentityAllocator) -> Compiled {
    compile_with(state, ids, CompileOptions::default())
}

/// Compiles `state` with `options` (e.g. every pod treated as local); one
/// identity generation, as [`compile`].
pub fn compile_with(
    state: &ClusterState,
    ids: &mut IdentityAllocator,
    options: CompileOptions,
) -> Compiled {
    Compiler::build(state, ids, options).into_compiled()
}
