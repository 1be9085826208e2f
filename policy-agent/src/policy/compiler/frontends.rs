//! Service frontends: the addresses kube-proxy rewrites. ClusterIPs,
//! external IPs and load-balancer IPs of every Service (kube-proxy rewrites
//! them on every node), this node's own addresses once some Service has a
//! nodePort, and the cluster's Service ranges (every address in them, the
//! Services not seen yet included). Addresses, not ports: see
//! `policy_common::service`.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use policy_common::service::{SERVICE_NODE_ADDRESS, SERVICE_RANGE, ServiceEntry};

use super::Compiler;
use crate::cluster::{ServiceInfo, ServiceRef};

/// The frontend addresses of `services` on a node with `node_ips`, and
/// the Service `ranges`.
pub fn frontends(
    services: &BTreeMap<ServiceRef, ServiceInfo>,
    node_ips: &BTreeSet<IpAddr>,
    ranges: &BTreeSet<IpNet>,
) -> BTreeMap<IpNet, ServiceEntry> {
    let mut out = BTreeMap::new();
    for net in ranges {
        out.insert(
            *net,
            ServiceEntry {
                flags: SERVICE_RANGE,
                ..ServiceEntry::default()
            },
        );
    }
    let mut node_ports = false;
    for svc in services.values() {
        let addresses = svc
            .cluster_ips
            .iter()
            .chain(&svc.external_ips)
            .chain(&svc.load_balancer_ips);
        for ip in addresses {
            // A frontend that is a whole (/32, /128) range keeps its flag.
            out.entry(IpNet::from(*ip))
                .or_insert_with(ServiceEntry::default);
        }
        node_ports |= svc.ports.iter().any(|p| p.node_port.is_some());
    }
    if node_ports {
        for ip in node_ips {
            out.entry(IpNet::from(*ip))
                .or_insert_with(ServiceEntry::default)
                .flags |= SERVICE_NODE_ADDRESS;
        }
    }
    out
}

impl Compiler {
    /// Brings the compiled frontends up to date with the Services and the
    /// node's addresses (cheap: a pass over the Services).
    pub(super) fn sync_frontends(&mut self) {
        let want = frontends(&self.services, &self.node_ips, &self.service_ranges);
        let gone: Vec<IpNet> = self
            .out
            .maps
            .services
            .keys()
            .filter(|k| !want.contains_key(k))
            .copied()
            .collect();
        for net in gone {
            self.out.set_service(net, None);
        }
        for (net, entry) in want {
            self.out.set_service(net, Some(entry));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ServicePort;

    fn service(cluster: &[&str], external: &[&str], node_port: Option<u16>) -> ServiceInfo {
        ServiceInfo {
            cluster_ips: cluster.iter().map(|s| s.parse().unwrap()).collect(),
            external_ips: external.iter().map(|s| s.parse().unwrap()).collect(),
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: policy_common::proto::TCP,
                port: 80,
                node_port,
            }],
            ..ServiceInfo::default()
        }
    }

    #[test]
    fn cluster_external_and_node_addresses_are_frontends() {
        let node: BTreeSet<IpAddr> = ["192.168.0.5".parse().unwrap()].into();
        let mut services = BTreeMap::new();
        services.insert(
            ServiceRef::new("a", "web"),
            service(&["10.96.0.10", "fd00:10:96::a"], &["203.0.113.7"], None),
        );
        let got = frontends(&services, &node, &BTreeSet::new());
        let nets: Vec<String> = got.keys().map(ToString::to_string).collect();
        assert_eq!(
            nets,
            ["10.96.0.10/32", "203.0.113.7/32", "fd00:10:96::a/128"],
            "no nodePort: the node's address is not a frontend"
        );
        services.insert(
            ServiceRef::new("a", "np"),
            service(&["10.96.0.11"], &[], Some(30080)),
        );
        let got = frontends(&services, &node, &BTreeSet::new());
        let node_net: IpNet = "192.168.0.5/32".parse().unwrap();
        assert_eq!(got[&node_net].flags, SERVICE_NODE_ADDRESS);
        assert_eq!(got.len(), 5);
    }

    #[test]
    fn a_headless_service_has_no_frontend() {
        let mut services = BTreeMap::new();
        services.insert(ServiceRef::new("a", "headless"), service(&[], &[], None));
        assert!(frontends(&services, &BTreeSet::new(), &BTreeSet::new()).is_empty());
    }

    #[test]
    fn a_range_is_one_frontend_beside_the_addresses_in_it() {
        let mut services = BTreeMap::new();
        services.insert(
            ServiceRef::new("a", "web"),
            service(&["10.96.0.10"], &[], None),
        );
        let ranges: BTreeSet<IpNet> = ["10.96.0.0/12".parse().unwrap()].into();
        let got = frontends(&services, &BTreeSet::new(), &ranges);
        let flags: Vec<(String, u32)> = got.iter().map(|(n, e)| (n.to_string(), e.flags)).collect();
        assert_eq!(
            flags,
            [
                ("10.96.0.0/12".into(), SERVICE_RANGE),
                ("10.96.0.10/32".into(), 0)
            ]
        );
    }
}
