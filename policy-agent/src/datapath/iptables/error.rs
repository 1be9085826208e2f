/// Errors of the iptables datapath.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{tool} is not installed (needed by the iptables datapath)")]
    Missing { tool: String },
    #[error("running {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{command} failed: {stderr}")]
    Failed { command: String, stderr: String },
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Missing { .. } => "setup",
            Self::Spawn { .. } | Self::Failed { .. } => "iptables",
        }
    }
}
