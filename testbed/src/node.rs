//! Building the simulated node.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{Error, NetNs, netns::run};

/// A pod of the simulated node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimPod {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub tcp_ports: Vec<u16>,
    pub udp_ports: Vec<u16>,
}

impl SimPod {
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A created pod: its namespace and host-side interface.
#[derive(Debug)]
pub struct PodNet {
    pub pod: SimPod,
    pub netns: NetNs,
    pub host_if: String,
}

/// The node namespace and its pods. Dropping it deletes every namespace
/// (and with them every veth) it created.
#[derive(Debug)]
pub struct SimNode {
    pub prefix: String,
    pub pods: Vec<PodNet>,
    /// How its namespaces and interfaces are named and its uplink made.
    layout: Layout,
    /// Declared last so it is deleted after the pods.
    pub node: NetNs,
}

/// Names of what a node creates, and whether it makes its own stand-in
/// uplink (a node of a [`crate::SimCluster`] is given a link instead).
#[derive(Clone, Debug)]
struct Layout {
    /// The node namespace.
    node_ns: String,
    /// Pod namespaces are `<pod_ns><index>`.
    pod_ns: String,
    /// Host-side interfaces are `<host_if><index>`.
    host_if: String,
    stub_uplink: bool,
}

fn check_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.len() > 9 || prefix.is_empty() || !prefix.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(Error::Invalid(format!(
            "sim prefix {prefix:?} must be 1-9 alphanumerics"
        )));
    }
    Ok(())
}

/// The node's own addresses (on a stand-in uplink in the node namespace).
pub const NODE_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 200, 1);
pub const NODE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xffff, 0, 0, 0, 0, 0, 1);
/// The gateway pods route through (answered by proxy ARP / the host veth).
const GATEWAY_V4: &str = "169.254.1.1";
const GATEWAY_V6: &str = "fe80::1";

impl SimNode {
    /// Creates `<prefix>-node` and one namespace per pod. `prefix` keeps
    /// parallel tests apart: at most 9 characters (interface names are
    /// `<prefix>h<index>`, 15 characters at most).
    pub fn create(prefix: &str, pods: &[SimPod]) -> Result<Self, Error> {
        check_prefix(prefix)?;
        let layout = Layout {
            node_ns: format!("{prefix}-node"),
            pod_ns: format!("{prefix}-p"),
            host_if: format!("{prefix}h"),
            stub_uplink: true,
        };
        Self::build(prefix, layout, pods)
    }

    /// Node `index` (1-9) of a cluster: `<prefix>-node<index>`, pods
    /// `<prefix>-n<index>p<i>` behind `<prefix><index>h<i>`, and no
    /// uplink (the cluster links the nodes).
    pub(super) fn create_cluster_node(
        prefix: &str,
        index: u8,
        pods: &[SimPod],
    ) -> Result<Self, Error> {
        check_prefix(prefix)?;
        if !(1..=9).contains(&index) {
            return Err(Error::Invalid(format!("node index {index} is not 1-9")));
        }
        let layout = Layout {
            node_ns: format!("{prefix}-node{index}"),
            pod_ns: format!("{prefix}-n{index}p"),
            host_if: format!("{prefix}{index}h"),
            stub_uplink: false,
        };
        Self::build(prefix, layout, pods)
    }

    fn build(prefix: &str, layout: Layout, pods: &[SimPod]) -> Result<Self, Error> {
        let node = NetNs::create(&layout.node_ns)?;
        let mut this = Self {
            prefix: prefix.to_owned(),
            pods: Vec::new(),
            layout,
            node,
        };
        this.setup_node()?;
        for (i, pod) in pods.iter().enumerate() {
            this.add_pod(i, pod)?;
        }
        Ok(this)
    }

    fn setup_node(&self) -> Result<(), Error> {
        self.node.sysctl("net.ipv4.ip_forward", "1")?;
        self.node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        self.node.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        self.node
            .sysctl("net.ipv4.ping_group_range", "0 2147483647")?;
        if !self.layout.stub_uplink {
            return Ok(());
        }
        self.node.ip_batch(&[
            // The kernel may lack the dummy driver: a veth pair whose far
            // end stays in the node namespace stands in for the uplink.
            "link add uplink0 type veth peer name uplink1".into(),
            "link set uplink1 up".into(),
            format!("addr add {NODE_V4}/32 dev uplink0"),
            format!("addr add {NODE_V6}/128 dev uplink0 nodad"),
            "link set uplink0 up".into(),
            // A default route out of the uplink makes the pods' gateway
            // routable, so proxy ARP answers for it (as on a Calico node).
            "route add 0.0.0.0/0 dev uplink0".into(),
            "route add ::/0 dev uplink0".into(),
        ])
    }

    fn add_pod(&mut self, index: usize, pod: &SimPod) -> Result<(), Error> {
        let netns = NetNs::create(&format!("{}{index}", self.layout.pod_ns))?;
        let host_if = format!("{}{index}", self.layout.host_if);
        netns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        netns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        // Unprivileged ICMP sockets, so probes can ping without raw sockets.
        netns.sysctl("net.ipv4.ping_group_range", "0 2147483647")?;
        self.node.ip_batch(&[format!(
            "link add {host_if} type veth peer name eth0 netns {}",
            netns.name
        )])?;
        self.node
            .sysctl(&format!("net.ipv4.conf.{host_if}.proxy_arp"), "1")?;
        self.node
            .sysctl(&format!("net.ipv4.neigh.{host_if}.proxy_delay"), "0")?;
        self.node
            .sysctl(&format!("net.ipv6.conf.{host_if}.accept_dad"), "0")?;
        let mut node = vec![
            format!("link set {host_if} up"),
            format!("addr add {GATEWAY_V6}/64 dev {host_if} nodad"),
        ];
        let mut pod_side = vec!["link set eth0 up".to_owned()];
        for ip in &pod.ips {
            let (net, nodad) = host_net(ip);
            pod_side.push(format!("addr add {net} dev eth0{nodad}"));
            node.push(format!("route add {net} dev {host_if}"));
        }
        pod_side.extend(gateway_routes(&pod.ips, "add"));
        self.node.ip_batch(&node)?;
        netns.ip_batch(&pod_side)?;
        self.pods.push(PodNet {
            pod: pod.clone(),
            netns,
            host_if,
        });
        Ok(())
    }

    /// Adds a pod to the running node (a pod scheduled later).
    pub fn add(&mut self, pod: &SimPod) -> Result<(), Error> {
        let index = self.pods.len() + 100;
        self.add_pod(index, pod)
    }

    pub fn pod(&self, id: &str) -> Option<&PodNet> {
        self.pods.iter().find(|p| p.pod.id() == id)
    }

    /// Replaces a pod's addresses (pod IP changes, IP reuse).
    pub fn readdress(&mut self, id: &str, ips: &[IpAddr]) -> Result<(), Error> {
        let Some(i) = self.pods.iter().position(|p| p.pod.id() == id) else {
            return Err(Error::Invalid(format!("no pod {id}")));
        };
        let (host_if, netns_name, old) = {
            let p = &self.pods[i];
            (p.host_if.clone(), p.netns.name.clone(), p.pod.ips.clone())
        };
        let netns = NetNs::borrow(&netns_name);
        // New addresses first: removing an interface's last address would
        // flush its routes.
        let mut pod_side = Vec::new();
        let mut node = Vec::new();
        for ip in ips.iter().filter(|ip| !old.contains(ip)) {
            let (net, nodad) = host_net(ip);
            pod_side.push(format!("addr add {net} dev eth0{nodad}"));
            node.push(format!("route replace {net} dev {host_if}"));
        }
        for ip in old.iter().filter(|ip| !ips.contains(ip)) {
            let (net, _) = host_net(ip);
            pod_side.push(format!("addr del {net} dev eth0"));
        }
        pod_side.extend(gateway_routes(ips, "replace"));
        netns.ip_batch(&pod_side)?;
        self.node.ip_batch(&node)?;
        // The old routes may be gone with their addresses already.
        for ip in old.iter().filter(|ip| !ips.contains(ip)) {
            let (net, _) = host_net(ip);
            let _ = self
                .node
                .ip_batch(&[format!("route del {net} dev {host_if}")]);
        }
        self.pods[i].pod.ips = ips.to_vec();
        Ok(())
    }

    /// Removes a pod (its namespace and veth).
    pub fn remove_pod(&mut self, id: &str) -> Option<SimPod> {
        let i = self.pods.iter().position(|p| p.pod.id() == id)?;
        let p = self.pods.remove(i);
        // Delete the veth now: namespace teardown is asynchronous, and its
        // routes would linger for a moment.
        let _ = self.node.ip(&["link", "del", &p.host_if]);
        Some(p.pod.clone())
    }
}

/// A pod address as a host prefix, and the `nodad` an IPv6 address takes.
fn host_net(ip: &IpAddr) -> (String, &'static str) {
    match ip {
        IpAddr::V4(a) => (format!("{a}/32"), ""),
        IpAddr::V6(a) => (format!("{a}/128"), " nodad"),
    }
}

/// The pod's routes to its gateway, for the families it has addresses of
/// (`verb`: add or replace).
fn gateway_routes(ips: &[IpAddr], verb: &str) -> Vec<String> {
    let mut out = Vec::new();
    if ips.iter().any(IpAddr::is_ipv4) {
        out.push(format!("route {verb} {GATEWAY_V4} dev eth0 scope link"));
        out.push(format!("route {verb} 0.0.0.0/0 via {GATEWAY_V4} dev eth0"));
    }
    if ips.iter().any(IpAddr::is_ipv6) {
        out.push(format!("route {verb} ::/0 via {GATEWAY_V6} dev eth0"));
    }
    out
}

/// Deletes leftovers of an earlier run with this prefix (a killed test).
pub fn cleanup_prefix(prefix: &str) {
    if let Ok(list) = run("ip", &["netns", "list"]) {
        for line in list.lines() {
            let name = line.split_whitespace().next().unwrap_or_default();
            if name.starts_with(&format!("{prefix}-")) {
                let _ = run("ip", &["netns", "del", name]);
            }
        }
    }
}

/// Pods of the simulated node from the manifests: every Pod of `node`
/// with IPs, serving its container ports.
pub fn pods_from_manifests(
    pods: &std::collections::BTreeMap<
        policy_agent::cluster::ObjectRef,
        policy_agent::cluster::PodInfo,
    >,
    node: &str,
) -> Vec<SimPod> {
    pods.iter()
        .filter(|(_, p)| {
            p.node_name.as_deref() == Some(node) && !p.host_network && !p.ips.is_empty()
        })
        .map(|(r, p)| SimPod {
            namespace: r.namespace.to_string(),
            name: r.name.to_string(),
            ips: p.ips.to_vec(),
            tcp_ports: p
                .ports
                .iter()
                .filter(|c| c.protocol == policy_common::proto::TCP)
                .map(|c| c.port)
                .collect(),
            udp_ports: p
                .ports
                .iter()
                .filter(|c| c.protocol == policy_common::proto::UDP)
                .map(|c| c.port)
                .collect(),
        })
        .collect()
}
