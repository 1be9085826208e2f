//! The iptables + ipset fallback: the same compiled maps rendered as
//! ipsets (who a peer identity is) and chains (what each pod may do),
//! applied atomically with `ipset restore` and `iptables-restore --noflush`,
//! touching only the agent's own chains and sets.
mod apply;
mod driver;
mod error;
pub mod flow_log;
mod pod_range_guard;
mod render;
mod ruleset;

pub use self::{
    apply::{ApplyReport, Backend, Executor, ResetReport},
    driver::IptablesDriver,
    error::Error,
    flow_log::{IptablesFlowReader, IptablesNames, read_names},
    render::{
        DEFAULT_BURST, DEFAULT_GROUP, DEFAULT_MARK, DEFAULT_RATE, FlowLogOptions, NAME_BITS,
        RenderInput, render, render_with,
    },
    ruleset::{
        Chain, ChainKind, FORWARD_CHAIN, Family, INPUT_CHAIN, IpSet, LIMITED_CHAIN,
        LIMITED_COMMENT, LIMITED_DROP_CHAIN, OUTPUT_CHAIN, OWN_PREFIX, Ruleset, SetKind, SetName,
        TUNNEL_CHAIN, is_own_chain, is_own_set,
    },
};
