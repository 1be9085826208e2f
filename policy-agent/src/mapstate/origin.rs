//! Where a policy entry came from, for renderers and explanations.
use crate::cluster::PolicyRef;

/// The rule behind a `PolicyEntry::rule_ref`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleOrigin {
    pub policy: PolicyRef,
    /// [`policy_common::direction`].
    pub direction: u8,
    /// Index in `spec.ingress` or `spec.egress`.
    pub rule_index: usize,
}
