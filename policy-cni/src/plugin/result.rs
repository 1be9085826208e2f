//! The previous plugin's result (`prevResult`), kept as JSON: what this
//! plugin reads from it (the container interface, the host-side
//! candidates, the pod's addresses) and its re-emission in the config's
//! version (SPEC: a chained plugin that changes nothing outputs a result
//! equivalent to `prevResult`).
//!
//! Shapes (types/040 and types/100): 0.3.0, 0.3.1 and 0.4.0 carry
//! `ips[].version` ("4"/"6"); 1.0.0 dropped it; 1.1.0 only adds optional
//! fields. `ips[].interface` indexes `interfaces[]`; host-side interfaces
//! have no (or an empty) `sandbox`.
use std::net::IpAddr;

use serde_json::Value;

use super::{
    config::{Version, supported},
    error::CniError,
};

fn interfaces(prev: &Value) -> &[Value] {
    prev.get("interfaces")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn sandbox(iface: &Value) -> &str {
    iface.get("sandbox").and_then(Value::as_str).unwrap_or("")
}

fn name(iface: &Value) -> &str {
    iface.get("name").and_then(Value::as_str).unwrap_or("")
}

/// The index of the container's interface: `name == CNI_IFNAME` and
/// `sandbox == CNI_NETNS` (what ptp's own CHECK matches), else the one
/// entry named `CNI_IFNAME` inside some sandbox (the runtime may spell
/// the netns path differently, /var/run vs /run).
pub fn container_interface(prev: &Value, ifname: &str, netns: Option<&str>) -> Option<usize> {
    let list = interfaces(prev);
    let exact = list
        .iter()
        .position(|i| name(i) == ifname && netns.is_some_and(|n| sandbox(i) == n));
    exact.or_else(|| {
        let mut named = list
            .iter()
            .enumerate()
            .filter(|(_, i)| name(i) == ifname && !sandbox(i).is_empty());
        match (named.next(), named.next()) {
            (Some((at, _)), None) => Some(at),
            _ => None,
        }
    })
}

/// The names of the interfaces outside any sandbox (ptp: the host veth;
/// bridge: the bridge and the host veth).
pub fn host_candidates(prev: &Value) -> Vec<String> {
    interfaces(prev)
        .iter()
        .filter(|i| sandbox(i).is_empty() && !name(i).is_empty())
        .map(|i| name(i).to_owned())
        .collect()
}

/// The pod's addresses: `ips[]` entries whose `interface` is the
/// container's (or that name no interface), prefix length stripped.
pub fn pod_ips(prev: &Value, container: Option<usize>) -> Result<Vec<IpAddr>, CniError> {
    let list = interfaces(prev);
    let mut out = Vec::new();
    let ips = prev
        .get("ips")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    for entry in ips {
        let wanted = match entry.get("interface").and_then(Value::as_u64) {
            None => true,
            Some(i) => match container {
                Some(c) => usize::try_from(i).is_ok_and(|i| i == c),
                // No container entry identified: any interface in a sandbox.
                None => usize::try_from(i)
                    .ok()
                    .and_then(|i| list.get(i))
                    .is_some_and(|iface| !sandbox(iface).is_empty()),
            },
        };
        if !wanted {
            continue;
        }
        let text = entry.get("address").and_then(Value::as_str).unwrap_or("");
        let ip = text
            .split_once('/')
            .map_or(text, |(a, _)| a)
            .parse::<IpAddr>()
            .map_err(|_| CniError::config(format!("prevResult: bad address {text:?}")))?;
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// `prevResult` in the config's version: libcni already converts it to the
/// list's version, so this usually only stamps `cniVersion`; a result of
/// another version is converted (`ips[].version` added below 1.0.0,
/// removed from 1.0.0 on).
pub fn convert(prev: &Value, to: &str) -> Result<Value, CniError> {
    let target = supported(to)?;
    let from = match prev.get("cniVersion").and_then(Value::as_str) {
        None | Some("") => target,
        Some(v) => supported(v).map_err(|e| CniError {
            details: format!("prevResult: {}", e.details),
            ..e
        })?,
    };
    let mut out = prev.clone();
    if let Some(obj) = out.as_object_mut() {
        obj.insert("cniVersion".into(), Value::String(to.to_owned()));
    }
    let old_shape = |v: Version| v < Version::V1_0_0;
    if old_shape(from) == old_shape(target) {
        return Ok(out);
    }
    if let Some(ips) = out.get_mut("ips").and_then(Value::as_array_mut) {
        for entry in ips.iter_mut().filter_map(Value::as_object_mut) {
            if old_shape(target) {
                let text = entry.get("address").and_then(Value::as_str).unwrap_or("");
                let family = if text.contains(':') { "6" } else { "4" };
                entry.insert("version".into(), Value::String(family.into()));
            } else {
                entry.remove("version");
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
