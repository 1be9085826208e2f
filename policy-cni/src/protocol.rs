//! The request and response of one hand-off (see the crate docs).
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// The protocol's version: an agent refuses requests of another.
pub const PROTOCOL_VERSION: u32 = 1;

/// Where the agent listens by default (a hostPath the DaemonSet shares
/// with the node's CNI plugins).
pub const DEFAULT_SOCKET: &str = "/run/policy-agent/cni.sock";

/// The pod a sandbox belongs to, from `CNI_ARGS` (`K8S_POD_NAMESPACE`,
/// `K8S_POD_NAME`, `K8S_POD_UID`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodId {
    pub namespace: String,
    pub name: String,
    /// Absent when the runtime did not pass it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// The host side of the pod's interface, in the agent's (the host's)
/// network namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInterface {
    pub name: String,
    pub ifindex: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "lowercase")]
pub enum Command {
    /// A sandbox's interface is up with these addresses: enforce the pod
    /// before answering.
    Add {
        pod: PodId,
        interface: HostInterface,
        ips: Vec<IpAddr>,
    },
    /// The sandbox is going: forget what ADD told (unknown: fine).
    Del {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodId>,
    },
    /// Is the pod still enforced on this interface?
    Check {
        pod: PodId,
        interface: HostInterface,
    },
    /// Is the agent ready to take ADDs?
    Status,
}

/// One request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub version: u32,
    /// `CNI_CONTAINERID`: ADD and DEL of one sandbox name the same.
    pub container_id: String,
    #[serde(flatten)]
    pub command: Command,
}

/// The agent's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    /// With `ok: false`: the CNI error code the plugin returns (11: try
    /// again later; 100+: the agent's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl Response {
    pub fn ok() -> Self {
        Self {
            ok: true,
            code: None,
            message: String::new(),
        }
    }

    pub fn error(code: u32, message: impl Into<String>) -> Self {
        Self {
            ok: false,
            code: Some(code),
            message: message.into(),
        }
    }
}

/// CNI error codes the agent answers with.
pub mod code {
    /// Try again later (the agent is not ready, the pod not known yet).
    pub const TRY_AGAIN: u32 = 11;
    /// The pod could not be enforced (attach failed, map full...).
    pub const NOT_ENFORCED: u32 = 100;
    /// The request is malformed or of another protocol version.
    pub const BAD_REQUEST: u32 = 101;
    /// The plugin's own (never sent by the agent): the pod's host-side
    /// interface could be found neither in the kernel nor in `prevResult`.
    pub const NO_HOST_INTERFACE: u32 = 102;
    /// The plugin's own: `prevResult` holds no address for the pod's
    /// interface.
    pub const NO_ADDRESS: u32 = 103;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_one_json_object_with_its_command_inline() {
        let r = Request {
            version: PROTOCOL_VERSION,
            container_id: "c0ffee".into(),
            command: Command::Add {
                pod: PodId {
                    namespace: "a".into(),
                    name: "p".into(),
                    uid: Some("u-1".into()),
                },
                interface: HostInterface {
                    name: "veth1".into(),
                    ifindex: 7,
                },
                ips: vec!["10.0.0.5".parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))],
            },
        };
        let text = serde_json::to_string(&r).unwrap_or_default();
        assert!(text.contains(r#""command":"add""#), "{text}");
        let back: Request = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(back, r);
    }
}
