//! The iptables + ipset fallback: the same compiled maps rendered as
//! ipsets (who a peer identity is) and chains (what each pod may do),
//! applied atomically with `ipset restore` and `iptables-restore --noflush`,
//! touching only the agent's own chains and sets.
mod error;
mod exec;
mod render;
mod ruleset;

pub use self::{
    error::Error,
    exec::{ApplyReport, Backend, Executor, ResetReport},
    render::{DEFAULT_MARK, RenderInput, render},
    ruleset::{Chain, Family, IpSet, Ruleset, SetKind},
};
