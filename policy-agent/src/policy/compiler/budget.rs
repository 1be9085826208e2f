//! How much compiled state one policy, and all of them, may hold.
//!
//! A policy's keys grow as (local endpoint identities it selects) × (peer
//! identities its rules reach) × (port blocks), with no bound in the
//! NetworkPolicy API: a namespace admin's policy selecting its own pods,
//! with `namespaceSelector: {}` peers and thousands of ports, would need
//! millions. Its *entries* are counted before they are built:
//!
//! entries(p) = Σ over its rules r of
//!   (label identities r reaches)
//!   + Σ over the local endpoint identities e it selects of (keys r gives e)
//!
//! where the keys r gives e are (any peer + address classes + identities
//! reached) × (port blocks of r), each counted once per rule that makes
//! it. A policy past [`Budget::per_policy`], or past what
//! [`Budget::total`] leaves, is refused: it fails closed like an invalid
//! one (the pods it selects stay isolated in the directions it declares,
//! nothing of it is allowed) and is reported.
use std::fmt;

/// Limits on the compiled state, in entries (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Entries one policy may compile to.
    pub per_policy: u64,
    /// Entries all admitted policies may compile to together.
    pub total: u64,
}

impl Default for Budget {
    /// No limit (the library's default; the agent sets [`Budget::for_node`]).
    fn default() -> Self {
        Self {
            per_policy: u64::MAX,
            total: u64::MAX,
        }
    }
}

impl Budget {
    /// The agent's defaults for a node of `max_pods`: in total what the
    /// node's `POLICY` map holds by the sizing formula, max(16384,
    /// max_pods × 2048); per policy a quarter of it. 110 pods: 225,280 and
    /// 56,320 entries.
    pub fn for_node(max_pods: u32) -> Self {
        let total = u64::from(max_pods).saturating_mul(2048).max(16384);
        Self {
            per_policy: total / 4,
            total,
        }
    }
}

impl Budget {
    /// Why a policy holding `held` entries may not add the ones `tally`
    /// counted (its limit: the policy's room), when the admitted policies
    /// hold `admitted` (the policy's own included if admitted).
    pub(super) fn refusal(&self, held: u64, tally: &Tally, admitted: u64) -> Option<Refusal> {
        if tally.over() {
            Some(Refusal::PolicyBudget {
                budget: self.per_policy,
            })
        } else if tally.n > self.total.saturating_sub(admitted) {
            Some(Refusal::TotalBudget {
                entries: held.saturating_add(tally.n),
                budget: self.total,
            })
        } else {
            None
        }
    }
}

/// Why a policy compiles to nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Past the per-policy budget (counting stopped there).
    PolicyBudget { budget: u64 },
    /// Within it, but the other policies leave too little of the total.
    TotalBudget { entries: u64, budget: u64 },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PolicyBudget { budget } => write!(
                f,
                "compiles to more than {budget} entries, the per-policy budget (--policy-entries-max): it allows nothing, the pods it selects stay isolated"
            ),
            Self::TotalBudget { entries, budget } => write!(
                f,
                "its {entries} entries do not fit in what the other policies leave of the total budget of {budget} (--compiled-entries-max): it allows nothing, the pods it selects stay isolated"
            ),
        }
    }
}

/// Entries counted towards a limit; counting may stop once past it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tally {
    pub n: u64,
    pub limit: u64,
}

impl Tally {
    pub fn new(limit: u64) -> Self {
        Self { n: 0, limit }
    }

    pub fn add(&mut self, n: u64) {
        self.n = self.n.saturating_add(n);
    }

    pub fn over(&self) -> bool {
        self.n > self.limit
    }
}
