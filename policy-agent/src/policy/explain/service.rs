//! A flow to a Service, explained per backend: with kube-proxy the
//! client's packets are judged after DNAT, against the backend they land
//! on, so the answer is one verdict per backend kube-proxy may pick.
use std::fmt::{self, Write as _};

use serde::Serialize;

use super::{ExplainError, ExplainQuery, Explanation, FlowEnd, explain};
use crate::{
    cluster::{Backend, ClusterState, EndpointSliceInfo, ServiceRef, backends},
    identity::protocol_name,
    policy::Compiled,
};

/// A flow from `src` to port `port`/`protocol` of `service`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceQuery {
    pub src: FlowEnd,
    pub service: ServiceRef,
    pub protocol: u8,
    /// The Service's port (`spec.ports[].port`).
    pub port: u16,
}

/// One backend and the verdict for the flow that lands on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackendReport {
    pub address: std::net::IpAddr,
    pub port: u16,
    /// "namespace/name" of the backend pod, when the slice names one.
    pub pod: Option<String>,
    pub node: Option<String>,
    pub explanation: Explanation,
}

/// The flow to a Service, per backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceExplanation {
    pub service: String,
    pub protocol: String,
    pub port: u16,
    /// Every backend allows the flow (false when there is none).
    pub allowed_all: bool,
    /// Some backend allows it: the flow works when kube-proxy picks one.
    pub allowed_any: bool,
    pub backends: Vec<BackendReport>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceExplainError {
    #[error("Service {0} is not in the cluster state")]
    UnknownService(ServiceRef),
    #[error("Service {service} has no port {port}/{protocol}")]
    NoSuchPort {
        service: ServiceRef,
        port: u16,
        protocol: String,
    },
    #[error(transparent)]
    Flow(#[from] ExplainError),
}

/// Explains `q`: the backends kube-proxy may pick for the port (this
/// client's node only under `internalTrafficPolicy: Local`), each judged
/// as a flow from the client to the backend's address and target port.
pub fn explain_service(
    state: &ClusterState,
    compiled: &Compiled,
    q: &ServiceQuery,
) -> Result<ServiceExplanation, ServiceExplainError> {
    let svc = state
        .services
        .get(&q.service)
        .ok_or_else(|| ServiceExplainError::UnknownService(q.service.clone()))?;
    let port = svc
        .ports
        .iter()
        .find(|p| p.port == q.port && p.protocol == q.protocol)
        .ok_or_else(|| ServiceExplainError::NoSuchPort {
            service: q.service.clone(),
            port: q.port,
            protocol: protocol_name(q.protocol).to_owned(),
        })?;
    let mut notes = Vec::new();
    let client_node = match &q.src {
        FlowEnd::Pod(p) => state.pods.get(p).and_then(|i| i.node_name.clone()),
        FlowEnd::Ip(_) => None,
    };
    let local = if svc.internal_local {
        notes.push(format!(
            "internalTrafficPolicy Local: only endpoints on the client's node ({})",
            client_node.as_deref().unwrap_or("unknown")
        ));
        Some(client_node.as_deref().unwrap_or(""))
    } else {
        None
    };
    // kube-proxy runs one proxier per family: "ready, else terminating"
    // is decided among the client's family's endpoints.
    let client_ips: Vec<std::net::IpAddr> = match &q.src {
        FlowEnd::Pod(p) => state
            .pods
            .get(p)
            .map(|i| i.ips.to_vec())
            .unwrap_or_default(),
        FlowEnd::Ip(ip) => vec![*ip],
    };
    let mut picked: Vec<Backend> = Vec::new();
    for v4 in [true, false] {
        if !client_ips.iter().any(|ip| ip.is_ipv4() == v4) {
            continue;
        }
        let slices: Vec<EndpointSliceInfo> = state
            .slices_of(&q.service)
            .map(|s| EndpointSliceInfo {
                endpoints: s
                    .endpoints
                    .iter()
                    .filter(|e| e.address.is_ipv4() == v4)
                    .cloned()
                    .collect(),
                ..s.clone()
            })
            .collect();
        picked.extend(backends(port, &slices, local));
    }
    if picked.is_empty() {
        notes.push(
            "no backend: kube-proxy rejects the flow (no ready or serving endpoint)".to_owned(),
        );
    }
    if !svc.proxied() {
        notes.push("headless or ExternalName: not proxied, clients reach pods directly".into());
    }
    let mut reports = Vec::new();
    for b in picked {
        let query = ExplainQuery {
            src: q.src.clone(),
            dst: FlowEnd::Ip(b.address),
            protocol: q.protocol,
            port: b.port,
        };
        let explanation = match explain(state, compiled, &query) {
            Ok(e) => e,
            // A backend of the other family than the client: kube-proxy
            // never sends the client there.
            Err(ExplainError::FamilyMismatch { .. }) => continue,
            Err(e) => return Err(e.into()),
        };
        reports.push(BackendReport {
            address: b.address,
            port: b.port,
            pod: b.pod.as_ref().map(ToString::to_string),
            node: b.node.clone(),
            explanation,
        });
    }
    let allowed_any = reports.iter().any(|r| r.explanation.allowed);
    let allowed_all = !reports.is_empty() && reports.iter().all(|r| r.explanation.allowed);
    if allowed_any && !allowed_all {
        notes.push(
            "some backends allow the flow and some do not: it works only when kube-proxy picks an allowed one"
                .to_owned(),
        );
    }
    Ok(ServiceExplanation {
        service: q.service.to_string(),
        protocol: protocol_name(q.protocol).to_owned(),
        port: q.port,
        allowed_all,
        allowed_any,
        backends: reports,
        notes,
    })
}

impl fmt::Display for ServiceExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        let verdict = match (self.allowed_all, self.allowed_any) {
            (true, _) => "ALLOWED on every backend",
            (false, true) => "ALLOWED on some backends only",
            (false, false) => "DROPPED",
        };
        let _ = writeln!(
            s,
            "Service {} port {} {}: {verdict} ({} backends; judged after DNAT, on the backend)",
            self.service,
            self.port,
            self.protocol,
            self.backends.len()
        );
        for note in &self.notes {
            let _ = writeln!(s, "note: {note}");
        }
        for b in &self.backends {
            let who = b.pod.as_deref().unwrap_or("no pod");
            let _ = writeln!(
                s,
                "\nbackend {}:{} ({who}): {}",
                b.address,
                b.port,
                if b.explanation.allowed {
                    "allowed"
                } else {
                    "dropped"
                }
            );
            let _ = write!(s, "{}", b.explanation);
        }
        f.write_str(&s)
    }
}
