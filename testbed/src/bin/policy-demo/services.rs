//! The demo's Service section: from every pod, a few connections to each
//! Service port on each of its ClusterIPs, and for each connection the
//! backend whose capture saw it (so which node it was sent to) and what
//! the client saw.
use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use policy_agent::cluster::{ClusterState, backends};
use policy_common::proto;
use policy_testbed::{Error, Landed, Outcome, Servers, SimCluster, Transport, through};

/// Connections (datagrams) per client, Service port and family.
const COUNT: usize = 6;

/// One client's connections to one Service port, per family.
pub struct Row {
    pub from: String,
    pub service: String,
    /// Per family (IPv4 first): the frontend and where each connection
    /// landed.
    pub families: Vec<(SocketAddr, Vec<Landed>)>,
    pub transport: Transport,
}

/// Probes every Service port with backends from every pod but its own
/// backends.
pub fn probe(
    cluster: &SimCluster,
    state: &ClusterState,
    servers: &[&Servers],
    timeout: Duration,
) -> Result<Vec<Row>, Error> {
    let mut rows = Vec::new();
    for (svc_ref, svc) in &state.services {
        for port in &svc.ports {
            let transport = match port.protocol {
                proto::TCP => Transport::Tcp,
                proto::UDP => Transport::Udp,
                _ => continue,
            };
            let all: Vec<(String, SocketAddr)> = backends(port, state.slices_of(svc_ref), None)
                .into_iter()
                .map(|b| {
                    let id = b
                        .pod
                        .map_or_else(|| b.address.to_string(), |p| p.to_string());
                    (id, SocketAddr::new(b.address, b.port))
                })
                .collect();
            if all.is_empty() {
                continue;
            }
            for node in &cluster.nodes {
                // A backend to its own Service is hairpin traffic, which
                // kube-proxy masquerades to a node address: left out.
                let clients = node
                    .sim
                    .pods
                    .iter()
                    .filter(|p| !all.iter().any(|(id, _)| *id == p.pod.id()));
                for pod in clients {
                    let mut families = Vec::new();
                    for ip in &svc.cluster_ips {
                        let frontend = SocketAddr::new(*ip, port.port);
                        let of_family: Vec<(String, SocketAddr)> = all
                            .iter()
                            .filter(|(_, a)| a.is_ipv4() == ip.is_ipv4())
                            .cloned()
                            .collect();
                        let landed = through(
                            &pod.netns, frontend, transport, &of_family, servers, COUNT, timeout,
                        )?;
                        families.push((frontend, landed));
                    }
                    rows.push(Row {
                        from: pod.pod.id(),
                        service: svc_ref.to_string(),
                        families,
                        transport,
                    });
                }
            }
        }
    }
    Ok(rows)
}

/// "✓ backend [node-1] ×3, backend-2 [node-2] ×3" or "✗ dropped ×6".
fn summary(cluster: &SimCluster, landed: &[Landed]) -> String {
    let mut groups: BTreeMap<String, usize> = BTreeMap::new();
    for l in landed {
        let node = |pod: &str| {
            cluster
                .pod(pod)
                .map_or_else(String::new, |(n, _)| format!(" [{}]", n.name))
        };
        let key = match (l.outcome, &l.backend) {
            (Outcome::Open, Some(b)) => format!("✓ {b}{}", node(b)),
            (Outcome::Open, None) => "✓ (no backend saw it)".into(),
            (Outcome::Blocked, None) => "✗ dropped".into(),
            (Outcome::Blocked, Some(b)) => format!("? reached {b}{}, no reply", node(b)),
            (Outcome::Refused, _) => "R refused".into(),
        };
        *groups.entry(key).or_default() += 1;
    }
    groups
        .iter()
        .map(|(k, n)| format!("{k} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn print(cluster: &SimCluster, title: &str, rows: &[Row]) {
    println!(
        "\n{title}: {COUNT} connections per client, Service port and ClusterIP, each judged where it landed (✓ answered by the backend named, its node in brackets; ✗ dropped, no backend saw it). A Service's own backends are not clients: to their own Service they would be hairpin traffic, which kube-proxy masquerades to a node address."
    );
    for r in rows {
        let from = cluster.pod(&r.from).map_or_else(
            || r.from.clone(),
            |(n, _)| format!("{} [{}]", r.from, n.name),
        );
        for (frontend, landed) in &r.families {
            println!(
                "  {from:>24} -> {} {frontend}/{}: {}",
                r.service,
                r.transport.name(),
                summary(cluster, landed)
            );
        }
    }
}
