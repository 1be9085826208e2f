//! A simulated cluster of two nodes: two node namespaces joined by a
//! routed link (a veth pair, `uplink0` on both ends, each end holding its
//! node's IPv4 and IPv6 address), each node routing the other's pod CIDRs
//! via the other's address and holding a default route out of the link
//! (so the uplink is the interface with the default route). Pods sit
//! behind routed veths exactly as on a [`SimNode`]. kube-proxy runs per
//! node: [`SimCluster::kube_proxies`] starts one stand-in on each. The
//! nodes do not rate-limit ICMP errors, so every connection to a Service
//! without endpoints is refused (not some of them left unanswered).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::{
    Error, NODE_V4, NODE_V6, PodNet, SimNode, SimPod,
    kube_proxy::{KubeProxy, ProxyConfig, ProxyMode},
};
use policy_agent::cluster::ClusterState;

/// The pod network of the whole cluster (kube-proxy's `--cluster-cidr`).
pub const CLUSTER_CIDR_V4: &str = "10.244.0.0/16";
pub const CLUSTER_CIDR_V6: &str = "fd00:244::/32";
/// The Service network (`--service-cluster-ip-range`).
pub const SERVICE_CIDR_V4: &str = "10.96.0.0/12";
pub const SERVICE_CIDR_V6: &str = "fd00:96::/112";
/// The link between the nodes, on both ends.
pub const UPLINK: &str = "uplink0";

/// One node of the cluster.
#[derive(Debug)]
pub struct ClusterNode {
    /// Its Kubernetes name ("node-1", "node-2").
    pub name: String,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    /// Its pod CIDRs (IPv4, IPv6).
    pub pod_cidrs: [IpNet; 2],
    pub sim: SimNode,
}

impl ClusterNode {
    pub fn ips(&self) -> Vec<IpAddr> {
        vec![IpAddr::V4(self.v4), IpAddr::V6(self.v6)]
    }
}

/// Two nodes (dropping it deletes every namespace it created).
#[derive(Debug)]
pub struct SimCluster {
    pub prefix: String,
    pub nodes: Vec<ClusterNode>,
}

/// Node `n`'s (1-based) addresses: 192.168.200.n and fd00:ffff::n (node 1
/// has [`NODE_V4`]/[`NODE_V6`], the single node's addresses).
pub fn node_ips(n: u8) -> (Ipv4Addr, Ipv6Addr) {
    let [a, b, c, _] = NODE_V4.octets();
    let mut v6 = NODE_V6.segments();
    v6[7] = u16::from(n);
    (Ipv4Addr::new(a, b, c, n), Ipv6Addr::from(v6))
}

/// Node `n`'s pod CIDRs: 10.244.n.0/24 and fd00:244:n::/64.
pub fn pod_cidrs(n: u8) -> [IpNet; 2] {
    [
        IpNet::V4(ipnet::Ipv4Net::new(Ipv4Addr::new(10, 244, n, 0), 24).unwrap_or_default()),
        IpNet::V6(
            ipnet::Ipv6Net::new(
                Ipv6Addr::new(0xfd00, 0x244, u16::from(n), 0, 0, 0, 0, 0),
                64,
            )
            .unwrap_or_default(),
        ),
    ]
}

/// A pod address pair on node `n`: 10.244.n.host and fd00:244:n::host.
pub fn pod_ips(n: u8, host: u8) -> Vec<IpAddr> {
    vec![
        IpAddr::V4(Ipv4Addr::new(10, 244, n, host)),
        IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x244,
            u16::from(n),
            0,
            0,
            0,
            0,
            u16::from(host),
        )),
    ]
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap_or(IpNet::V4(ipnet::Ipv4Net::default()))
}

impl SimCluster {
    /// Creates `<prefix>-node1` with `node1_pods` and `<prefix>-node2`
    /// with `node2_pods` (addresses from [`pod_ips`]), and links them.
    /// `prefix`: at most 9 alphanumerics.
    pub fn create(
        prefix: &str,
        node1_pods: &[SimPod],
        node2_pods: &[SimPod],
    ) -> Result<Self, Error> {
        let mut this = Self {
            prefix: prefix.to_owned(),
            nodes: Vec::new(),
        };
        for (n, pods) in [(1u8, node1_pods), (2, node2_pods)] {
            let (v4, v6) = node_ips(n);
            let sim = SimNode::create_cluster_node(prefix, n, pods)?;
            this.nodes.push(ClusterNode {
                name: format!("node-{n}"),
                v4,
                v6,
                pod_cidrs: pod_cidrs(n),
                sim,
            });
        }
        this.link()?;
        Ok(this)
    }

    fn link(&self) -> Result<(), Error> {
        let [a, b] = [&self.nodes[0], &self.nodes[1]];
        a.sim.node.ip(&[
            "link",
            "add",
            UPLINK,
            "type",
            "veth",
            "peer",
            "name",
            UPLINK,
            "netns",
            &b.sim.node.name,
        ])?;
        for (me, other) in [(a, b), (b, a)] {
            let ns = &me.sim.node;
            ns.sysctl(&format!("net.ipv6.conf.{UPLINK}.accept_dad"), "0")?;
            // ICMP errors unlimited: kube-proxy's REJECT of a Service
            // without endpoints answers every connection (the default
            // allows a burst of about six per peer, then one a second).
            ns.sysctl("net.ipv4.icmp_ratelimit", "0")?;
            ns.sysctl("net.ipv6.icmp.ratelimit", "0")?;
            let v4 = format!("{}/24", me.v4);
            let v6 = format!("{}/64", me.v6);
            let (o4, o6) = (other.v4.to_string(), other.v6.to_string());
            let (c4, c6) = (
                other.pod_cidrs[0].to_string(),
                other.pod_cidrs[1].to_string(),
            );
            for args in [
                vec!["addr", "add", &v4, "dev", UPLINK],
                vec!["-6", "addr", "add", &v6, "dev", UPLINK, "nodad"],
                vec!["link", "set", UPLINK, "up"],
                vec!["route", "add", &c4, "via", &o4, "dev", UPLINK],
                vec!["-6", "route", "add", &c6, "via", &o6, "dev", UPLINK],
                // The uplink carries the default route: the pods' gateway
                // is routable (proxy ARP answers for it), and what no
                // route claims leaves by the link, as on a real node.
                vec!["route", "add", "default", "dev", UPLINK],
                vec!["-6", "route", "add", "default", "dev", UPLINK],
            ] {
                ns.ip(&args)?;
            }
        }
        Ok(())
    }

    pub fn node(&self, name: &str) -> Option<&ClusterNode> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// A pod ("ns/name") and the node it runs on.
    pub fn pod(&self, id: &str) -> Option<(&ClusterNode, &PodNet)> {
        self.nodes
            .iter()
            .find_map(|n| n.sim.pod(id).map(|p| (n, p)))
    }

    /// Every node's addresses.
    pub fn node_addresses(&self) -> Vec<IpAddr> {
        self.nodes.iter().flat_map(ClusterNode::ips).collect()
    }

    /// The kube-proxy configuration of node `name`.
    pub fn proxy_config(&self, node: &ClusterNode) -> ProxyConfig {
        ProxyConfig {
            node_name: node.name.clone(),
            node_ips: node.ips(),
            cluster_cidrs: vec![net(CLUSTER_CIDR_V4), net(CLUSTER_CIDR_V6)],
            service_cidrs: vec![net(SERVICE_CIDR_V4), net(SERVICE_CIDR_V6)],
        }
    }

    /// Starts a kube-proxy stand-in on every node, all syncing `state`.
    pub fn kube_proxies(
        &self,
        mode: ProxyMode,
        state: &ClusterState,
    ) -> Result<KubeProxies, Error> {
        let mut proxies = Vec::new();
        for node in &self.nodes {
            proxies.push(KubeProxy::install(
                &node.sim.node,
                mode,
                self.proxy_config(node),
                state,
            )?);
        }
        Ok(KubeProxies(proxies))
    }
}

/// The kube-proxy stand-ins of every node (each removed on drop).
#[derive(Debug)]
pub struct KubeProxies(pub Vec<KubeProxy>);

impl KubeProxies {
    /// Every node syncs the changed state (as every kube-proxy watches the
    /// same API server).
    pub fn update(&mut self, state: &ClusterState) -> Result<(), Error> {
        for p in &mut self.0 {
            p.update(state)?;
        }
        Ok(())
    }

    pub fn remove(self) -> Result<(), Error> {
        let mut first = None;
        for p in self.0 {
            if let Err(e) = p.remove() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_networks_lie_in_the_cluster_network() {
        for n in 1..=2 {
            let [v4, v6] = pod_cidrs(n);
            assert!(net(CLUSTER_CIDR_V4).contains(&v4), "{v4}");
            assert!(net(CLUSTER_CIDR_V6).contains(&v6), "{v6}");
            for ip in pod_ips(n, 7) {
                assert!(v4.contains(&ip) || v6.contains(&ip), "{ip}");
            }
        }
        assert_eq!(node_ips(1), (NODE_V4, NODE_V6));
        assert_eq!(node_ips(2).1.to_string(), "fd00:ffff::2");
    }
}
