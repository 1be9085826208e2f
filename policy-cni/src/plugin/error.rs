//! The CNI error object (SPEC §5 "Error"): printed on stdout with a
//! non-zero exit status. libcni parses stdout first; stderr is for logs.
use serde::Serialize;

/// The spec's well-known codes (`pkg/types/types.go`); 100 and up are the
/// plugin's own (see [`crate::protocol::code`]).
pub mod codes {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_ENVIRONMENT: u32 = 4;
    pub const IO: u32 = 5;
    pub const DECODE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const INVALID_NETNS: u32 = 8;
    pub const TRY_AGAIN: u32 = 11;
    /// STATUS: the plugin cannot take ADDs now.
    pub const NOT_AVAILABLE: u32 = 50;
}

/// A failed command, as the runtime sees it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}: {details} (CNI error code {code})")]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

#[derive(Serialize)]
struct Object<'a> {
    #[serde(rename = "cniVersion", skip_serializing_if = "Option::is_none")]
    cni_version: Option<&'a str>,
    code: u32,
    msg: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    details: &'a str,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    pub fn env(details: impl Into<String>) -> Self {
        Self::new(
            codes::INVALID_ENVIRONMENT,
            "invalid environment variables",
            details,
        )
    }

    pub fn config(details: impl Into<String>) -> Self {
        Self::new(
            codes::INVALID_CONFIG,
            "invalid network configuration",
            details,
        )
    }

    pub fn version(details: impl Into<String>) -> Self {
        Self::new(
            codes::INCOMPATIBLE_VERSION,
            "incompatible CNI versions",
            details,
        )
    }

    /// The error object (with the config's version when it is known).
    pub fn to_json(&self, cni_version: Option<&str>) -> String {
        serde_json::to_string(&Object {
            cni_version,
            code: self.code,
            msg: &self.msg,
            details: &self.details,
        })
        // Serialising strings and a number cannot fail; keep a valid
        // object regardless.
        .unwrap_or_else(|_| format!("{{\"code\":{},\"msg\":\"internal error\"}}", self.code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_has_the_spec_fields() {
        let e = CniError::config("timeoutSeconds must be positive");
        let v: serde_json::Value =
            serde_json::from_str(&e.to_json(Some("1.0.0"))).unwrap_or_default();
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["code"], 7);
        assert_eq!(v["msg"], "invalid network configuration");
        assert_eq!(v["details"], "timeoutSeconds must be positive");
        let bare: serde_json::Value =
            serde_json::from_str(&CniError::new(11, "try again later", "").to_json(None))
                .unwrap_or_default();
        assert!(bare.get("cniVersion").is_none() && bare.get("details").is_none());
    }
}
