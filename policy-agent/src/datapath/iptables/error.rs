use crate::exec::CommandError;

/// Errors of the iptables datapath: a tool missing or failing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("iptables datapath: {0}")]
    Command(#[from] CommandError),
    /// Marking established flows for re-judgement (ctnetlink).
    #[error("iptables datapath: conntrack: {0}")]
    Conntrack(#[from] crate::netlink::Error),
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Command(CommandError::Missing { .. }) => "setup",
            Self::Command(_) => "iptables",
            Self::Conntrack(_) => "conntrack",
        }
    }
}
