//! Services and their EndpointSlices, as far as policy needs them: which
//! addresses and ports are Service frontends, and which backends the
//! node's Service implementation (kube-proxy) may pick for each.
//!
//! kube-proxy never resolves a named `targetPort` itself: the EndpointSlice
//! controller writes, per pod, the number the name resolves to there, and
//! kube-proxy joins a Service port and a slice port by name and protocol.
//! [`backends`] does the same.
//!
//! Addresses are read as kube-proxy reads them (`address.rs`). What does
//! not read is left out and reported, never the whole object: a Service
//! forgotten for one odd address would have its ClusterIP judged as an
//! ordinary address at the client (see docs/design/services.md).
use std::net::IpAddr;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{
    ConvertError, ObjectKind, ObjectRef, PodRef, Problem, Subject, address::parse_ip_sloppy,
    convert::protocol_number,
};

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
    /// A ClusterIP that does not read even as kube-proxy reads addresses:
    /// the Service is proxied, at an address nobody here can know.
    pub cluster_ip_unreadable: bool,
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
    /// What could not be read (left out of the fields above).
    pub unreadable: Vec<Unreadable>,
}

impl ServiceInfo {
    /// Whether the node's Service implementation proxies it at all
    /// (kube-proxy skips a Service without a ClusterIP, external IPs or
    /// not).
    pub fn proxied(&self) -> bool {
        !self.cluster_ips.is_empty() || self.cluster_ip_unreadable
    }

    /// A problem per field of Service `name` that could not be read.
    pub fn problems<'a>(&'a self, name: &'a ServiceRef) -> impl Iterator<Item = Problem> + 'a {
        self.unreadable.iter().map(move |u| {
            let consequence = if u.field.starts_with("spec.clusterIP") {
                "no frontend: kube-proxy reads addresses alike and rewrites nothing there, so no client reaches the backends through it (by pod IP as policy allows); a Service range covers it for any other reader"
            } else if u.field.contains("ports[") {
                "that port is left out (its frontends stay)"
            } else {
                "not a frontend (the Service's other addresses stay)"
            };
            Problem::new(
                Subject::Field {
                    kind: ObjectKind::Service,
                    name: name.clone(),
                    field: u.field.clone(),
                },
                format!("{}: {consequence}", u.reason),
            )
        })
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
    /// Endpoints whose address could not be read (left out).
    pub unreadable: Vec<Unreadable>,
}

impl EndpointSliceInfo {
    /// A problem per endpoint of slice `name` that could not be read.
    pub fn problems<'a>(&'a self, name: &'a ObjectRef) -> impl Iterator<Item = Problem> + 'a {
        self.unreadable.iter().map(move |u| {
            Problem::new(
                Subject::Field {
                    kind: ObjectKind::EndpointSlice,
                    name: name.clone(),
                    field: u.field.clone(),
                },
                format!(
                    "{}: the endpoint is left out (kube-proxy cannot send to it either)",
                    u.reason
                ),
            )
        })
    }
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

/// A field the agent could not read: left out, and reported.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unreadable {
    /// Its path, as `kubectl explain` spells it (`spec.clusterIPs[0]`).
    pub field: String,
    /// Why, with the value.
    pub reason: String,
}

/// Reads `raw` (the values of the list `field`) as kube-proxy does,
/// keeping what reads and noting the rest in `bad`.
fn ips(raw: impl IntoIterator<Item = (String, String)>, bad: &mut Vec<Unreadable>) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for (field, s) in raw {
        if s.is_empty() || s == "None" {
            continue;
        }
        match parse_ip_sloppy(&s) {
            Some(ip) if !out.contains(&ip) => out.push(ip),
            Some(_) => {}
            None => bad.push(Unreadable {
                field,
                reason: format!("{s:?} is not an IP address"),
            }),
        }
    }
    out
}

fn port_number(v: i32) -> Option<u16> {
    u16::try_from(v).ok().filter(|p| *p != 0)
}

/// A Service's policy-relevant part. ExternalName Services are DNS only.
///
/// What cannot be read (an address, a port) is left out and noted in
/// [`ServiceInfo::unreadable`]; the rest of the Service stays, so its
/// other frontends are still judged after DNAT. Addresses are read as
/// kube-proxy reads them ([`parse_ip_sloppy`]).
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
    let mut bad = Vec::new();
    // spec.clusterIPs, whose first is spec.clusterIP; an older object may
    // have only the latter.
    let mut cluster: Vec<(String, String)> = spec
        .cluster_ips
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.clone()))
        .collect();
    if cluster.is_empty()
        && let Some(ip) = spec.cluster_ip.clone()
    {
        cluster.push(("spec.clusterIP".into(), ip));
    }
    let cluster_ips = ips(cluster, &mut bad);
    let cluster_ip_unreadable = !bad.is_empty();
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let Some(protocol) = protocol_number(p.protocol.as_deref()) else {
            bad.push(Unreadable {
                field: format!("spec.ports[{i}].protocol"),
                reason: format!(
                    "{:?} is not TCP, UDP or SCTP",
                    p.protocol.clone().unwrap_or_default()
                ),
            });
            continue;
        };
        let Some(port) = port_number(p.port) else {
            bad.push(Unreadable {
                field: format!("spec.ports[{i}].port"),
                reason: format!("{} is outside 1-65535", p.port),
            });
            continue;
        };
        let node_port = match p.node_port.map(|n| (n, port_number(n))) {
            None => None,
            Some((_, Some(n))) => Some(n),
            Some((n, None)) => {
                bad.push(Unreadable {
                    field: format!("spec.ports[{i}].nodePort"),
                    reason: format!("{n} is outside 1-65535"),
                });
                None
            }
        };
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port,
            node_port,
        });
    }
    let external = spec
        .external_ips
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, ip)| (format!("spec.externalIPs[{i}]"), ip.clone()));
    let external_ips = ips(external, &mut bad);
    let lb = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, ing)| {
            Some((
                format!("status.loadBalancer.ingress[{i}].ip"),
                ing.ip.clone()?,
            ))
        });
    let load_balancer_ips = ips(lb, &mut bad);
    let info = ServiceInfo {
        cluster_ips,
        cluster_ip_unreadable,
        external_ips,
        load_balancer_ips,
        ports,
        internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        external_local: spec.external_traffic_policy.as_deref() == Some("Local"),
        unreadable: bad,
    };
    Ok((key, info))
}

/// An EndpointSlice's policy-relevant part. An endpoint whose address
/// cannot be read is left out (kube-proxy cannot send to it either) and
/// noted in [`EndpointSliceInfo::unreadable`].
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
    let mut unreadable = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let Some(first) = ep.addresses.first() else {
            continue;
        };
        let Some(address) = parse_ip_sloppy(first) else {
            unreadable.push(Unreadable {
                field: format!("endpoints[{i}].addresses[0]"),
                reason: format!("{first:?} is not an IP address"),
            });
            continue;
        };
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
            unreadable,
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
            ..Default::default()
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

    fn service(spec: serde_json::Value) -> Service {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "a"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn addresses_read_as_kube_proxy_reads_them_and_one_bad_field_keeps_the_rest() {
        let (key, info) = service_info(&service(serde_json::json!({
            "clusterIP": "010.096.000.050",
            "clusterIPs": ["010.096.000.050", "fd00:96::50"],
            "externalIPs": ["203.0.113.7", "not-an-ip"],
            "ports": [
                {"name": "http", "port": 80, "protocol": "TCP"},
                {"name": "odd", "port": 70000, "protocol": "TCP"},
                {"name": "icmp", "port": 1, "protocol": "ICMP"},
            ],
        })))
        .unwrap();
        let ips = |v: &[IpAddr]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(ips(&info.cluster_ips), ["10.96.0.50", "fd00:96::50"]);
        assert!(!info.cluster_ip_unreadable);
        assert_eq!(ips(&info.external_ips), ["203.0.113.7"]);
        assert_eq!(info.ports.len(), 1);
        let fields: Vec<String> = info.problems(&key).map(|p| p.subject.to_string()).collect();
        assert_eq!(
            fields,
            [
                "service a/web: spec.ports[1].port",
                "service a/web: spec.ports[2].protocol",
                "service a/web: spec.externalIPs[1]",
            ]
        );
    }

    #[test]
    fn an_unreadable_cluster_ip_keeps_the_service_proxied() {
        let (key, info) = service_info(&service(serde_json::json!({
            "clusterIP": "10.96.0.500",
            "clusterIPs": ["10.96.0.500"],
            "externalIPs": ["203.0.113.7"],
            "ports": [{"port": 80}],
        })))
        .unwrap();
        assert!(info.cluster_ips.is_empty() && info.cluster_ip_unreadable);
        assert!(
            info.proxied(),
            "not headless: proxied at an unknown address"
        );
        assert_eq!(info.external_ips.len(), 1);
        let problems: Vec<Problem> = info.problems(&key).collect();
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].to_string().starts_with(
                "service a/web: spec.clusterIPs[0]: \"10.96.0.500\" is not an IP address"
            ),
            "{}",
            problems[0]
        );
    }

    #[test]
    fn an_unreadable_endpoint_is_left_out_and_reported() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": "a", "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.1.999"]}, {"addresses": ["010.244.001.002"]}],
            "ports": [{"name": "http", "port": 8080}],
        }))
        .unwrap();
        let (key, info) = endpoint_slice_info(&slice).unwrap();
        assert_eq!(info.endpoints.len(), 1);
        assert_eq!(info.endpoints[0].address.to_string(), "10.244.1.2");
        let problems: Vec<String> = info.problems(&key).map(|p| p.to_string()).collect();
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("endpointslice a/web-1: endpoints[0].addresses[0]"),
            "{problems:?}"
        );
    }
}
