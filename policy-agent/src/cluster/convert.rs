//! From Kubernetes objects (k8s-openapi) to the compiler's plain values.
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use policy_common::proto;

use super::{ContainerPort, NamespaceInfo, NodeInfo, ObjectRef, PodFields, PodInfo};

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{kind} has no metadata.name")]
    MissingName { kind: &'static str },
    #[error("pod {pod}: status.podIPs holds {ip:?}, which is not an IP address")]
    BadPodIp { pod: ObjectRef, ip: String },
    #[error("pod {pod}: container port {port} is outside 1-65535")]
    BadContainerPort { pod: ObjectRef, port: i32 },
    #[error("pod {pod}: container port protocol {protocol:?} is not TCP, UDP or SCTP")]
    BadProtocol { pod: ObjectRef, protocol: String },
}

/// Parses a NetworkPolicy/container protocol name (default TCP).
pub fn protocol_number(name: Option<&str>) -> Option<u8> {
    match name.unwrap_or("TCP") {
        "TCP" => Some(proto::TCP),
        "UDP" => Some(proto::UDP),
        "SCTP" => Some(proto::SCTP),
        _ => None,
    }
}

pub fn namespace_info(ns: &Namespace) -> Result<(String, NamespaceInfo), ConvertError> {
    let name = ns
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Namespace" })?;
    let mut labels = ns.metadata.labels.clone().unwrap_or_default();
    // The API server sets this label on every namespace (1.21+); manifests
    // written by hand may lack it, and policies rely on it.
    labels
        .entry("kubernetes.io/metadata.name".to_owned())
        .or_insert_with(|| name.clone());
    Ok((name, NamespaceInfo { labels }))
}

/// A Node's labels and addresses.
pub fn node_info(
    node: &k8s_openapi::api::core::v1::Node,
) -> Result<(String, NodeInfo), ConvertError> {
    let name = node
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Node" })?;
    let mut addresses: Vec<IpAddr> = node
        .status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter_map(|a| a.address.parse().ok())
        .collect();
    addresses.sort();
    addresses.dedup();
    let labels = node.metadata.labels.clone().unwrap_or_default();
    Ok((name, NodeInfo { labels, addresses }))
}

pub fn pod_info(pod: &Pod) -> Result<(ObjectRef, PodInfo), ConvertError> {
    let name = pod
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Pod" })?;
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let key = ObjectRef::new(namespace, name);
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();

    let mut raw_ips: Vec<String> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().map(|ip| ip.ip.clone()).collect())
        .unwrap_or_default();
    if raw_ips.is_empty()
        && let Some(ip) = status.and_then(|s| s.pod_ip.clone())
    {
        raw_ips.push(ip);
    }
    let mut ips = Vec::with_capacity(raw_ips.len());
    for raw in raw_ips {
        let ip: IpAddr = raw.parse().map_err(|_| ConvertError::BadPodIp {
            pod: key.clone(),
            ip: raw.clone(),
        })?;
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }

    let mut ports = Vec::new();
    for container in spec.map(|s| s.containers.iter()).into_iter().flatten() {
        for p in container.ports.iter().flatten() {
            let port = u16::try_from(p.container_port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or(ConvertError::BadContainerPort {
                    pod: key.clone(),
                    port: p.container_port,
                })?;
            let protocol = protocol_number(p.protocol.as_deref()).ok_or_else(|| {
                ConvertError::BadProtocol {
                    pod: key.clone(),
                    protocol: p.protocol.clone().unwrap_or_default(),
                }
            })?;
            ports.push(ContainerPort {
                name: p.name.as_deref().map(super::interned::short_name),
                port,
                protocol,
            });
        }
    }
    ports.sort();
    ports.dedup();

    let phase = status.and_then(|s| s.phase.as_deref());
    let info = PodInfo::from(PodFields {
        labels: super::pod_labels(pod.metadata.labels.clone().unwrap_or_default()),
        node_name: spec.and_then(|s| s.node_name.as_deref().map(super::interned::short_name)),
        ips: ips.into(),
        ports: super::pod_ports(ports),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        terminal: matches!(phase, Some("Succeeded" | "Failed")),
        created: pod
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second())
            .unwrap_or(0),
        uid: pod.metadata.uid.clone(),
    });
    Ok((key, info))
}
