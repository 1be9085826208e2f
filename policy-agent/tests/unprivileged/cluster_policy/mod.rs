//! ClusterNetworkPolicy: validation that fails closed as the API says,
//! and the reference evaluator on the upstream conformance scenarios.
mod compiled;
mod fail_closed;
mod rule_names;
mod upstream;

use std::{collections::BTreeMap, net::IpAddr};

use policy_agent::{
    cluster::{ContainerPort, Labels},
    policy::cluster_policy::{
        ClusterNetworkPolicy, Connection, Decision, ParsedClusterPolicy, PodView, Remote, decide,
    },
};
use policy_common::{direction, proto};

/// Parses one ClusterNetworkPolicy from YAML (the manifest as written).
pub fn cnp(yaml: &str) -> ParsedClusterPolicy {
    let wire: ClusterNetworkPolicy =
        serde_yaml::from_str(yaml).expect("YAML of a ClusterNetworkPolicy");
    ParsedClusterPolicy::parse(&wire)
}

/// The upstream conformance world: a namespace per house, its label
/// `conformance-house` and the automatic `kubernetes.io/metadata.name`;
/// pods labelled with their house, serving web (TCP 80) and dns (UDP 53).
pub struct House {
    pub namespace: String,
    pub namespace_labels: Labels,
    pub labels: Labels,
    pub ports: Vec<ContainerPort>,
}

pub fn house(name: &str) -> House {
    let namespace = format!("network-policy-conformance-{name}");
    House {
        namespace_labels: BTreeMap::from([
            ("kubernetes.io/metadata.name".to_owned(), namespace.clone()),
            ("conformance-house".to_owned(), name.to_owned()),
        ]),
        labels: BTreeMap::from([("conformance-house".to_owned(), name.to_owned())]),
        ports: vec![
            ContainerPort {
                name: Some("web".into()),
                port: 80,
                protocol: proto::TCP,
            },
            ContainerPort {
                name: Some("dns".into()),
                port: 53,
                protocol: proto::UDP,
            },
        ],
        namespace,
    }
}

impl House {
    pub fn view(&self) -> PodView<'_> {
        PodView {
            namespace: &self.namespace,
            namespace_labels: &self.namespace_labels,
            labels: &self.labels,
            ports: &self.ports,
        }
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an address")
}

/// The decision for a connection from `client` to `server` (both pods),
/// judged at the server's ingress and the client's egress: a connection
/// passes when both do. `np_ingress` / `np_egress`: the NetworkPolicy
/// tier's word at each end (None: no NetworkPolicy isolates it).
pub fn pod_to_pod(
    policies: &[ParsedClusterPolicy],
    client: &House,
    server: &House,
    protocol: u8,
    port: u16,
    np_egress: Option<bool>,
    np_ingress: Option<bool>,
) -> (Decision, Decision) {
    let egress = Connection {
        direction: direction::EGRESS,
        subject: client.view(),
        remote: Remote::Pod {
            pod: server.view(),
            ip: ip("10.0.0.2"),
        },
        protocol,
        port,
    };
    let ingress = Connection {
        direction: direction::INGRESS,
        subject: server.view(),
        remote: Remote::Pod {
            pod: client.view(),
            ip: ip("10.0.0.1"),
        },
        protocol,
        port,
    };
    (
        decide(policies, &egress, np_egress).0,
        decide(policies, &ingress, np_ingress).0,
    )
}

/// Whether the connection passes both ends.
pub fn passes(d: (Decision, Decision)) -> bool {
    d.0.allows() && d.1.allows()
}
