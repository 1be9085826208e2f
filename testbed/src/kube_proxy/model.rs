//! What one family's kube-proxy knows of each Service port: its frontends
//! and the endpoints `CategorizeEndpoints` gives it, from the cluster
//! model and [`policy_agent::cluster::backends`] (never re-derived here).
use std::net::IpAddr;

use policy_common::proto;

use policy_agent::cluster::{Backend, ClusterState, EndpointSliceInfo, backends};

/// An address family: kube-proxy runs one proxier per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Self {
        if ip.is_ipv4() { Self::V4 } else { Self::V6 }
    }

    pub fn holds(self, ip: &IpAddr) -> bool {
        Self::of(ip) == self
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }
}

/// kube-proxy's lower-case protocol name.
pub fn protocol_name(protocol: u8) -> &'static str {
    match protocol {
        proto::UDP => "udp",
        proto::SCTP => "sctp",
        _ => "tcp",
    }
}

/// `net.JoinHostPort(ip, port)`: an endpoint's string and sort key.
pub fn join_host_port(ip: &IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// One Service port as one family's proxier sees it.
#[derive(Clone, Debug)]
pub struct SvcPort {
    pub namespace: String,
    pub name: String,
    pub port_name: String,
    /// `ServicePortName.String()`: "ns/name" or "ns/name:port".
    pub spn: String,
    pub protocol: &'static str,
    pub cluster_ip: IpAddr,
    pub port: u16,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    pub lb_ips: Vec<IpAddr>,
    pub internal_local: bool,
    /// externalTrafficPolicy Local (only when externally accessible).
    pub external_local: bool,
    /// Cluster-policy endpoints (empty unless the port uses them).
    pub cluster: Vec<Backend>,
    /// This node's endpoints (empty unless the port uses them).
    pub local: Vec<Backend>,
    /// Any usable endpoint anywhere (ready, or serving and terminating).
    pub has_any: bool,
}

impl SvcPort {
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.lb_ips.is_empty()
    }

    /// `UsesClusterEndpoints`: internal policy Cluster, or any external
    /// frontend (Local's short circuits use cluster endpoints).
    pub fn uses_cluster(&self) -> bool {
        !self.internal_local || self.externally_accessible()
    }

    pub fn uses_local(&self) -> bool {
        self.internal_local || self.external_local
    }

    pub fn uses_cluster_chain(&self) -> bool {
        self.uses_cluster() && !self.cluster.is_empty()
    }

    pub fn uses_local_chain(&self) -> bool {
        self.uses_local() && !self.local.is_empty()
    }

    pub fn has_internal(&self) -> bool {
        self.has_any && (!self.internal_local || !self.local.is_empty())
    }

    pub fn has_external(&self) -> bool {
        self.has_any && (!self.external_local || !self.local.is_empty())
    }

    pub fn uses_external_chain(&self) -> bool {
        self.has_any && self.externally_accessible()
    }

    /// `allLocallyReachableEndpoints`: the endpoints that get a chain.
    pub fn reachable(&self) -> Vec<&Backend> {
        let mut all: Vec<&Backend> = Vec::new();
        if self.uses_cluster() {
            all.extend(&self.cluster);
        }
        if self.uses_local() {
            for b in &self.local {
                if !all
                    .iter()
                    .any(|x| x.address == b.address && x.port == b.port)
                {
                    all.push(b);
                }
            }
        }
        all
    }
}

/// The Service ports one family's proxier on `node` programs, in a stable
/// order (Services by name, ports as written). A Service without a
/// ClusterIP of the family is skipped, as kube-proxy skips it.
pub fn service_ports(state: &ClusterState, node: &str, family: Family) -> Vec<SvcPort> {
    let mut out = Vec::new();
    for (svc_ref, svc) in &state.services {
        let Some(cluster_ip) = svc.cluster_ips.iter().find(|ip| family.holds(ip)) else {
            continue;
        };
        // A proxier sees only the slices of its own family.
        let slices: Vec<EndpointSliceInfo> = state
            .slices_of(svc_ref)
            .map(|s| EndpointSliceInfo {
                service: s.service.clone(),
                ports: s.ports.clone(),
                endpoints: s
                    .endpoints
                    .iter()
                    .filter(|e| family.holds(&e.address))
                    .cloned()
                    .collect(),
                unreadable: Vec::new(),
            })
            .collect();
        let of_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
            ips.iter().filter(|ip| family.holds(ip)).copied().collect()
        };
        for port in &svc.ports {
            let spn = if port.name.is_empty() {
                svc_ref.to_string()
            } else {
                format!("{svc_ref}:{}", port.name)
            };
            let mut p = SvcPort {
                namespace: svc_ref.namespace.to_string(),
                name: svc_ref.name.to_string(),
                port_name: port.name.clone(),
                spn,
                protocol: protocol_name(port.protocol),
                cluster_ip: *cluster_ip,
                port: port.port,
                node_port: port.node_port,
                external_ips: of_family(&svc.external_ips),
                lb_ips: of_family(&svc.load_balancer_ips),
                internal_local: svc.internal_local,
                external_local: false,
                cluster: Vec::new(),
                local: Vec::new(),
                has_any: false,
            };
            p.external_local = svc.external_local && p.externally_accessible();
            let all = backends(port, &slices, None);
            p.has_any = !all.is_empty();
            if p.uses_cluster() {
                p.cluster = all;
            }
            if p.uses_local() {
                p.local = backends(port, &slices, Some(node));
            }
            out.push(p);
        }
    }
    out
}
