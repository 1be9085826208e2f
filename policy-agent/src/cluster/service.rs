//! Services and their EndpointSlices, as far as policy needs them: which
//! addresses and ports are Service frontends, and which backends the
//! node's Service implementation (kube-proxy) may pick for each.
//!
//! kube-proxy never resolves a named `targetPort` itself: the EndpointSlice
//! controller writes, per pod, the number the name resolves to there, and
//! kube-proxy joins a Service port and a slice port by name and protocol.
//! [`backends`] does the same.
use std::net::IpAddr;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{ConvertError, ObjectRef, PodRef, convert::protocol_number};

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A Service's name.
pub type ServiceRef = ObjectRef;

/// One `spec.ports` entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePort {
    /// `name` ("" for a single unnamed port): what slice ports join on.
    pub name: String,
    /// IP protocol number (TCP, UDP, SCTP).
    pub protocol: u8,
    pub port: u16,
    /// `nodePort` (NodePort and LoadBalancer Services).
    pub node_port: Option<u16>,
}

/// A Service, as far as policy cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// `spec.clusterIPs` (empty: headless or ExternalName, not proxied).
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`.
    pub load_balancer_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `internalTrafficPolicy: Local`: ClusterIPs reach this node's
    /// endpoints only.
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
}

impl ServiceInfo {
    /// Whether the node's Service implementation proxies it at all
    /// (kube-proxy skips a Service without a ClusterIP, external IPs or
    /// not).
    pub fn proxied(&self) -> bool {
        !self.cluster_ips.is_empty()
    }
}

/// One endpoint of a slice.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// `addresses[0]` (kube-proxy uses only the first).
    pub address: IpAddr,
    /// `conditions.ready` (absent: true).
    pub ready: bool,
    /// `conditions.serving` (absent: true).
    pub serving: bool,
    /// `conditions.terminating` (absent: false).
    pub terminating: bool,
    /// `nodeName`.
    pub node: Option<String>,
    /// `targetRef` when it is a Pod.
    pub pod: Option<PodRef>,
}

/// One `ports` entry of a slice.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlicePort {
    pub name: String,
    pub protocol: u8,
    pub port: u16,
}

/// An EndpointSlice, as far as policy cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSliceInfo {
    /// The Service it belongs to (its `kubernetes.io/service-name` label).
    pub service: Option<ServiceRef>,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}

/// A backend kube-proxy may pick for a Service port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub address: IpAddr,
    pub port: u16,
    pub pod: Option<PodRef>,
    pub node: Option<String>,
}

/// The backends of `port` of a Service, as kube-proxy picks them
/// (`CategorizeEndpoints`): the ready endpoints of the slices whose port
/// of that name and protocol has a number (only this node's with
/// `local`); if none, those serving and terminating. Sorted by
/// "address:port", kube-proxy's order.
pub fn backends<'a>(
    port: &ServicePort,
    slices: impl IntoIterator<Item = &'a EndpointSliceInfo>,
    local: Option<&str>,
) -> Vec<Backend> {
    let mut ready = Vec::new();
    let mut terminating = Vec::new();
    for slice in slices {
        let Some(number) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
            .map(|p| p.port)
        else {
            continue;
        };
        for ep in &slice.endpoints {
            if local.is_some_and(|n| ep.node.as_deref() != Some(n)) {
                continue;
            }
            let b = Backend {
                address: ep.address,
                port: number,
                pod: ep.pod.clone(),
                node: ep.node.clone(),
            };
            if ep.ready {
                ready.push(b);
            } else if ep.serving && ep.terminating {
                terminating.push(b);
            }
        }
    }
    let mut out = if ready.is_empty() { terminating } else { ready };
    let key = |b: &Backend| match b.address {
        IpAddr::V4(a) => format!("{a}:{}", b.port),
        IpAddr::V6(a) => format!("[{a}]:{}", b.port),
    };
    out.sort_by_key(key);
    out.dedup_by_key(|b| key(b));
    out
}

fn ips(
    raw: impl IntoIterator<Item = String>,
    service: &ObjectRef,
) -> Result<Vec<IpAddr>, ConvertError> {
    let mut out = Vec::new();
    for s in raw {
        if s.is_empty() || s == "None" {
            continue;
        }
        let ip: IpAddr = s.parse().map_err(|_| ConvertError::BadServiceIp {
            service: service.clone(),
            ip: s.clone(),
        })?;
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

fn port_number(v: i32, service: &ObjectRef) -> Result<u16, ConvertError> {
    u16::try_from(v)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ConvertError::BadServicePort {
            service: service.clone(),
            port: v,
        })
}

/// A Service's policy-relevant part. ExternalName Services are DNS only.
pub fn service_info(svc: &Service) -> Result<(ServiceRef, ServiceInfo), ConvertError> {
    let name = svc
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Service" })?;
    let key = ObjectRef::new(
        svc.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        name,
    );
    let Some(spec) = svc.spec.as_ref() else {
        return Ok((key, ServiceInfo::default()));
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok((key, ServiceInfo::default()));
    }
    let mut cluster = spec.cluster_ips.clone().unwrap_or_default();
    if cluster.is_empty()
        && let Some(ip) = spec.cluster_ip.clone()
    {
        cluster.push(ip);
    }
    let mut ports = Vec::new();
    for p in spec.ports.iter().flatten() {
        let protocol = protocol_number(p.protocol.as_deref()).ok_or_else(|| {
            ConvertError::BadServiceProtocol {
                service: key.clone(),
                protocol: p.protocol.clone().unwrap_or_default(),
            }
        })?;
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port: port_number(p.port, &key)?,
            node_port: p.node_port.map(|n| port_number(n, &key)).transpose()?,
        });
    }
    let lb = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.clone());
    let info = ServiceInfo {
        cluster_ips: ips(cluster, &key)?,
        external_ips: ips(spec.external_ips.clone().unwrap_or_default(), &key)?,
        load_balancer_ips: ips(lb, &key)?,
        ports,
        internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        external_local: spec.external_traffic_policy.as_deref() == Some("Local"),
    };
    Ok((key, info))
}

/// An EndpointSlice's policy-relevant part.
pub fn endpoint_slice_info(
    slice: &EndpointSlice,
) -> Result<(ObjectRef, EndpointSliceInfo), ConvertError> {
    let name = slice
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName {
            kind: "EndpointSlice",
        })?;
    let namespace = slice
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let key = ObjectRef::new(namespace.clone(), name);
    let service = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .map(|s| ObjectRef::new(namespace.clone(), s.clone()));
    let mut ports = Vec::new();
    for p in slice.ports.iter().flatten() {
        // kube-proxy skips ports without a name field or a number.
        let (Some(name), Some(number)) = (p.name.clone(), p.port) else {
            continue;
        };
        let Some(protocol) = protocol_number(p.protocol.as_deref()) else {
            continue;
        };
        let Ok(port) = u16::try_from(number) else {
            continue;
        };
        if port == 0 {
            continue;
        }
        ports.push(SlicePort {
            name,
            protocol,
            port,
        });
    }
    let mut endpoints = Vec::new();
    for ep in &slice.endpoints {
        let Some(first) = ep.addresses.first() else {
            continue;
        };
        let address: IpAddr = first.parse().map_err(|_| ConvertError::BadEndpointIp {
            slice: key.clone(),
            ip: first.clone(),
        })?;
        let conditions = ep.conditions.as_ref();
        let pod = ep
            .target_ref
            .as_ref()
            .filter(|r| r.kind.as_deref() == Some("Pod"))
            .and_then(|r| {
                Some(ObjectRef::new(
                    r.namespace.clone().unwrap_or_else(|| namespace.clone()),
                    r.name.clone()?,
                ))
            });
        endpoints.push(Endpoint {
            address,
            ready: conditions.and_then(|c| c.ready).unwrap_or(true),
            serving: conditions.and_then(|c| c.serving).unwrap_or(true),
            terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
            node: ep.node_name.clone(),
            pod,
        });
    }
    Ok((
        key,
        EndpointSliceInfo {
            service,
            ports,
            endpoints,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ip: &str, ready: bool, serving: bool, terminating: bool, node: &str) -> Endpoint {
        Endpoint {
            address: ip.parse().unwrap(),
            ready,
            serving,
            terminating,
            node: Some(node.into()),
            pod: None,
        }
    }

    #[test]
    fn backends_are_chosen_as_kube_proxy_chooses_them() {
        let port = ServicePort {
            name: "http".into(),
            protocol: policy_common::proto::TCP,
            port: 80,
            node_port: None,
        };
        let slice = EndpointSliceInfo {
            service: None,
            ports: vec![
                SlicePort {
                    name: "http".into(),
                    protocol: policy_common::proto::TCP,
                    port: 8080,
                },
                SlicePort {
                    name: "http".into(),
                    protocol: policy_common::proto::UDP,
                    port: 9999,
                },
            ],
            endpoints: vec![
                ep("10.244.1.2", true, true, false, "n1"),
                ep("10.244.1.10", true, true, false, "n2"),
                ep("10.244.1.3", false, false, false, "n1"),
                ep("10.244.1.4", false, true, true, "n1"),
            ],
        };
        let got: Vec<String> = backends(&port, [&slice], None)
            .iter()
            .map(|b| format!("{}:{}", b.address, b.port))
            .collect();
        // Ready only, the slice's number for the name and protocol, sorted
        // as strings ("10.244.1.10" before "10.244.1.2").
        assert_eq!(got, ["10.244.1.10:8080", "10.244.1.2:8080"]);
        let local = backends(&port, [&slice], Some("n1"));
        assert_eq!(local.len(), 1);
        // No ready endpoint: serving and terminating ones serve.
        let mut draining = slice.clone();
        for e in &mut draining.endpoints {
            e.ready = false;
        }
        let got = backends(&port, [&draining], None);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].address.to_string(), "10.244.1.4");
    }
}
