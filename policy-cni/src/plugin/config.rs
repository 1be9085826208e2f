//! The per-plugin configuration the runtime derives from the list and
//! writes on stdin (SPEC §3 "Deriving request configuration"): the list's
//! `cniVersion` and `name`, our plugin object, `prevResult` (ADD: the
//! previous plugin's result; DEL and CHECK: the final ADD result).
use std::{path::PathBuf, time::Duration};

use serde::Deserialize;
use serde_json::Value;

use super::error::CniError;
use crate::protocol::DEFAULT_SOCKET;

/// The versions this plugin speaks: the chaining ones (`prevResult`
/// exists from 0.3.0 on).
pub const SUPPORTED: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// How long ADD waits for the agent by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest wait a config may ask for (kubelet's runtime request
/// timeout is 2 minutes; the whole chain must fit in it).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(100);

/// A `major.minor.patch` version, ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    pub const V0_4_0: Self = Self(0, 4, 0);
    pub const V1_0_0: Self = Self(1, 0, 0);
    pub const V1_1_0: Self = Self(1, 1, 0);

    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.split('.').map(|p| p.parse::<u32>().ok());
        match (it.next(), it.next(), it.next(), it.next()) {
            (Some(Some(a)), Some(Some(b)), Some(Some(c)), None) => Some(Self(a, b, c)),
            _ => None,
        }
    }
}

/// The parts of the configuration this plugin reads; the rest (`type`
/// aside, `runtimeConfig`, `args`, other plugins' keys) is ignored.
#[derive(Clone, Debug, PartialEq)]
pub struct NetConf {
    pub cni_version: String,
    pub version: Version,
    pub name: String,
    pub plugin_type: String,
    pub prev_result: Option<Value>,
    /// The agent's socket (`socket`).
    pub socket: PathBuf,
    /// How long ADD and CHECK wait for the agent (`timeoutSeconds`).
    pub timeout: Duration,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(rename = "cniVersion", default)]
    cni_version: String,
    #[serde(default)]
    name: String,
    #[serde(rename = "type", default)]
    plugin_type: String,
    #[serde(rename = "prevResult", default)]
    prev_result: Option<Value>,
    #[serde(default)]
    socket: Option<String>,
    #[serde(rename = "timeoutSeconds", default)]
    timeout_seconds: Option<f64>,
}

/// Parses stdin: not JSON → code 6 (decode); a missing or bad field →
/// code 7; a version this plugin does not speak → code 1.
pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
    let raw: Raw = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(
            super::error::codes::DECODE,
            "failed to decode the network configuration",
            e.to_string(),
        )
    })?;
    if raw.cni_version.is_empty() {
        return Err(CniError::config("cniVersion is missing"));
    }
    let version = supported(&raw.cni_version)?;
    if raw.name.is_empty() {
        return Err(CniError::config("name is missing"));
    }
    if raw.plugin_type.is_empty() {
        return Err(CniError::config("type is missing"));
    }
    let socket = match raw.socket {
        None => PathBuf::from(DEFAULT_SOCKET),
        Some(s) if s.starts_with('/') => PathBuf::from(s),
        Some(s) => {
            return Err(CniError::config(format!(
                "socket {s:?} must be an absolute path"
            )));
        }
    };
    let timeout = match raw.timeout_seconds {
        None => DEFAULT_TIMEOUT,
        Some(t) if t > 0.0 && t <= MAX_TIMEOUT.as_secs_f64() => Duration::from_secs_f64(t),
        Some(t) => {
            return Err(CniError::config(format!(
                "timeoutSeconds {t} must be above 0 and at most {}",
                MAX_TIMEOUT.as_secs()
            )));
        }
    };
    let prev_result = match raw.prev_result {
        Some(Value::Null) | None => None,
        Some(v @ Value::Object(_)) => Some(v),
        Some(other) => {
            return Err(CniError::config(format!(
                "prevResult must be an object, not {other}"
            )));
        }
    };
    Ok(NetConf {
        cni_version: raw.cni_version,
        version,
        name: raw.name,
        plugin_type: raw.plugin_type,
        prev_result,
        socket,
        timeout,
    })
}

/// The version if this plugin speaks it (code 1 otherwise, as skel says).
pub fn supported(cni_version: &str) -> Result<Version, CniError> {
    match Version::parse(cni_version) {
        Some(v) if SUPPORTED.contains(&cni_version) => Ok(v),
        _ => Err(CniError::version(format!(
            "config is {cni_version:?}, plugin supports {SUPPORTED:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_our_keys() {
        let c = parse(br#"{"cniVersion":"1.0.0","name":"podnet","type":"policy-cni"}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.socket, PathBuf::from(DEFAULT_SOCKET));
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.version, Version::V1_0_0);
        assert!(c.prev_result.is_none());
        let c = parse(
            br#"{"cniVersion":"0.3.1","name":"kindnet","type":"policy-cni","socket":"/tmp/a.sock",
                "timeoutSeconds":0.5,"runtimeConfig":{"portMappings":[]},"prevResult":{"cniVersion":"0.3.1"}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.socket, PathBuf::from("/tmp/a.sock"));
        assert_eq!(c.timeout, Duration::from_millis(500));
        assert!(c.prev_result.is_some());
    }

    #[test]
    fn bad_configs_have_their_codes() {
        let cases: [(&[u8], u32); 10] = [
            (b"not json", 6),
            (br#"{"name":"n","type":"t"}"#, 7),
            (br#"{"cniVersion":"1.0.0","type":"t"}"#, 7),
            (br#"{"cniVersion":"1.0.0","name":"n"}"#, 7),
            (br#"{"cniVersion":"0.2.0","name":"n","type":"t"}"#, 1),
            (br#"{"cniVersion":"1.2.0","name":"n","type":"t"}"#, 1),
            (
                br#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":0}"#,
                7,
            ),
            (
                br#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":1000}"#,
                7,
            ),
            (
                br#"{"cniVersion":"1.0.0","name":"n","type":"t","socket":"rel.sock"}"#,
                7,
            ),
            (
                br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":[1]}"#,
                7,
            ),
        ];
        for (input, code) in cases {
            let e = parse(input).unwrap_err();
            assert_eq!(e.code, code, "{}: {e}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn versions_order_numerically() {
        assert!(Version::parse("0.10.0") > Version::parse("0.4.0"));
        assert!(Version::parse("1.1.0") > Some(Version::V1_0_0));
        assert_eq!(Version::parse("1.0"), None);
        assert_eq!(Version::parse("1.0.x"), None);
    }
}
