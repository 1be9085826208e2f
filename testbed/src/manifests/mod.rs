//! Manifests for Service tests, one source of truth for the agent and the
//! kube-proxy stand-in: Pods, Services (ClusterIP, NodePort, LoadBalancer;
//! dual-stack ClusterIPs, externalIPs, named target ports, traffic
//! policies) and the EndpointSlices the EndpointSlice controller would
//! write for them, rendered as YAML documents (v1 Pod, v1 Service,
//! discovery.k8s.io/v1 EndpointSlice) and read back into a
//! [`ClusterState`] with the agent's own conversions.
use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::{
    api::{
        core::v1::{
            Container, ContainerPort as K8sContainerPort, LoadBalancerIngress, LoadBalancerStatus,
            ObjectReference, Pod, PodCondition, PodIP, PodSpec, PodStatus, Service,
            ServicePort as K8sServicePort, ServiceSpec, ServiceStatus,
        },
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{
        apis::meta::v1::{ObjectMeta, Time},
        util::intstr::IntOrString,
    },
    jiff::Timestamp,
};
use policy_common::proto;

use crate::{Error, SimPod};
use policy_agent::cluster::{
    ClusterState, SERVICE_NAME_LABEL, endpoint_slice_info, pod_info, service_info,
};

fn protocol_text(protocol: u8) -> &'static str {
    match protocol {
        proto::UDP => "UDP",
        proto::SCTP => "SCTP",
        _ => "TCP",
    }
}

fn family_name(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
}

/// A container port of a pod (what a named `targetPort` resolves to).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedPort {
    pub name: Option<String>,
    pub protocol: u8,
    pub port: u16,
}

/// A pod: where it runs, its labels, addresses and container ports, and
/// its readiness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodManifest {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub labels: BTreeMap<String, String>,
    pub ips: Vec<IpAddr>,
    pub ports: Vec<NamedPort>,
    /// The Ready condition.
    pub ready: bool,
    /// Being deleted (deletionTimestamp set).
    pub terminating: bool,
}

impl PodManifest {
    /// A ready pod without labels or ports.
    pub fn new(namespace: &str, name: &str, node: &str, ips: &[IpAddr]) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            node: node.into(),
            labels: BTreeMap::new(),
            ips: ips.to_vec(),
            ports: Vec::new(),
            ready: true,
            terminating: false,
        }
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// A container port; `name` empty for an unnamed one.
    pub fn port(mut self, name: &str, protocol: u8, port: u16) -> Self {
        self.ports.push(NamedPort {
            name: (!name.is_empty()).then(|| name.to_owned()),
            protocol,
            port,
        });
        self
    }

    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The pod for the simulated node (serving its container ports).
    pub fn sim_pod(&self) -> SimPod {
        let of = |p: u8| {
            self.ports
                .iter()
                .filter(|c| c.protocol == p)
                .map(|c| c.port)
                .collect()
        };
        SimPod {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            ips: self.ips.clone(),
            tcp_ports: of(proto::TCP),
            udp_ports: of(proto::UDP),
        }
    }

    pub fn to_pod(&self) -> Pod {
        let ports: Vec<K8sContainerPort> = self
            .ports
            .iter()
            .map(|p| K8sContainerPort {
                name: p.name.clone(),
                container_port: i32::from(p.port),
                protocol: Some(protocol_text(p.protocol).into()),
                ..Default::default()
            })
            .collect();
        Pod {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: (!self.labels.is_empty()).then(|| self.labels.clone()),
                deletion_timestamp: self.terminating.then_some(Time(Timestamp::UNIX_EPOCH)),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(self.node.clone()),
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("sim".into()),
                    ports: (!ports.is_empty()).then_some(ports),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: self.ips.first().map(ToString::to_string),
                pod_ips: Some(
                    self.ips
                        .iter()
                        .map(|ip| PodIP { ip: ip.to_string() })
                        .collect(),
                ),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if self.ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }
}

/// `spec.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
}

/// `targetPort`: a number, or a container port's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortManifest {
    /// "" for a single unnamed port.
    pub name: String,
    pub protocol: u8,
    pub port: u16,
    pub target: TargetPort,
    pub node_port: Option<u16>,
}

/// A Service: frontends, ports, selector, traffic policies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceManifest {
    pub namespace: String,
    pub name: String,
    pub kind: ServiceType,
    /// `spec.clusterIPs` (the first is `spec.clusterIP`), one per family.
    pub cluster_ips: Vec<IpAddr>,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`.
    pub load_balancer_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePortManifest>,
    pub selector: BTreeMap<String, String>,
    pub internal_local: bool,
    pub external_local: bool,
    /// How the object spells an address, where not as Rust prints it
    /// (`010.096.000.050`: what an older API server stored). kube-proxy
    /// reads such a spelling as the address (see [`Manifests::canonical`]).
    pub spelled: BTreeMap<IpAddr, String>,
}

impl ServiceManifest {
    /// A ClusterIP Service without ports or selector.
    pub fn new(namespace: &str, name: &str, cluster_ips: &[IpAddr]) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            kind: ServiceType::ClusterIp,
            cluster_ips: cluster_ips.to_vec(),
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            ports: Vec::new(),
            selector: BTreeMap::new(),
            internal_local: false,
            external_local: false,
            spelled: BTreeMap::new(),
        }
    }

    /// Spells `ip` as `text` in the object.
    pub fn spell(mut self, ip: IpAddr, text: &str) -> Self {
        self.spelled.insert(ip, text.into());
        self
    }

    fn text(&self, ip: &IpAddr) -> String {
        self.spelled
            .get(ip)
            .cloned()
            .unwrap_or_else(|| ip.to_string())
    }

    pub fn select(mut self, key: &str, value: &str) -> Self {
        self.selector.insert(key.into(), value.into());
        self
    }

    pub fn port(mut self, name: &str, protocol: u8, port: u16, target: TargetPort) -> Self {
        self.ports.push(ServicePortManifest {
            name: name.into(),
            protocol,
            port,
            target,
            node_port: None,
        });
        self
    }

    /// Makes it a NodePort Service (if it is a ClusterIP one) and gives
    /// the port named `name` the node port.
    pub fn node_port(mut self, name: &str, node_port: u16) -> Self {
        if self.kind == ServiceType::ClusterIp {
            self.kind = ServiceType::NodePort;
        }
        for p in self.ports.iter_mut().filter(|p| p.name == name) {
            p.node_port = Some(node_port);
        }
        self
    }

    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn to_service(&self) -> Service {
        let families: Vec<String> = self
            .cluster_ips
            .iter()
            .map(|ip| family_name(ip).to_owned())
            .collect();
        let external = self.kind != ServiceType::ClusterIp || !self.external_ips.is_empty();
        Service {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some(
                    match self.kind {
                        ServiceType::ClusterIp => "ClusterIP",
                        ServiceType::NodePort => "NodePort",
                        ServiceType::LoadBalancer => "LoadBalancer",
                    }
                    .into(),
                ),
                cluster_ip: self.cluster_ips.first().map(|ip| self.text(ip)),
                cluster_ips: Some(self.cluster_ips.iter().map(|ip| self.text(ip)).collect()),
                ip_families: Some(families),
                ip_family_policy: Some(
                    if self.cluster_ips.len() > 1 {
                        "RequireDualStack"
                    } else {
                        "SingleStack"
                    }
                    .into(),
                ),
                ports: Some(
                    self.ports
                        .iter()
                        .map(|p| K8sServicePort {
                            name: (!p.name.is_empty()).then(|| p.name.clone()),
                            protocol: Some(protocol_text(p.protocol).into()),
                            port: i32::from(p.port),
                            target_port: Some(match &p.target {
                                TargetPort::Number(n) => IntOrString::Int(i32::from(*n)),
                                TargetPort::Name(s) => IntOrString::String(s.clone()),
                            }),
                            node_port: p.node_port.map(i32::from),
                            ..Default::default()
                        })
                        .collect(),
                ),
                selector: (!self.selector.is_empty()).then(|| self.selector.clone()),
                external_ips: (!self.external_ips.is_empty())
                    .then(|| self.external_ips.iter().map(|ip| self.text(ip)).collect()),
                internal_traffic_policy: Some(
                    if self.internal_local {
                        "Local"
                    } else {
                        "Cluster"
                    }
                    .into(),
                ),
                external_traffic_policy: external.then(|| {
                    if self.external_local {
                        "Local"
                    } else {
                        "Cluster"
                    }
                    .into()
                }),
                ..Default::default()
            }),
            status: (!self.load_balancer_ips.is_empty()).then(|| ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(
                        self.load_balancer_ips
                            .iter()
                            .map(|ip| LoadBalancerIngress {
                                ip: Some(self.text(ip)),
                                ..Default::default()
                            })
                            .collect(),
                    ),
                }),
                ..Default::default()
            }),
        }
    }

    fn selects(&self, pod: &PodManifest) -> bool {
        !self.selector.is_empty()
            && pod.namespace == self.namespace
            && self
                .selector
                .iter()
                .all(|(k, v)| pod.labels.get(k) == Some(v))
    }

    /// The EndpointSlices the EndpointSlice controller writes for `pods`:
    /// one address type per ClusterIP family; per pod, every Service port
    /// resolved on that pod (`findPort`: a name is looked up among the
    /// pod's container ports of the same protocol; a pod lacking it is
    /// left out of that port); pods whose ports resolve alike share a
    /// slice. Conditions as the controller sets them: ready = Ready and
    /// not terminating, serving = Ready, terminating = being deleted. A
    /// family without endpoints gets an empty placeholder slice.
    pub fn endpoint_slices(&self, pods: &[PodManifest]) -> Vec<EndpointSlice> {
        let mut out = Vec::new();
        let mut families: Vec<&'static str> = self.cluster_ips.iter().map(family_name).collect();
        families.dedup();
        for family in families {
            let short = if family == "IPv4" { "v4" } else { "v6" };
            // Resolved port lists → endpoints.
            let mut groups: Vec<(Vec<EndpointPort>, Vec<Endpoint>)> = Vec::new();
            for pod in pods.iter().filter(|p| self.selects(p)) {
                let Some(ip) = pod.ips.iter().find(|ip| family_name(ip) == family) else {
                    continue;
                };
                let ports: Vec<EndpointPort> = self
                    .ports
                    .iter()
                    .filter_map(|sp| {
                        let number = match &sp.target {
                            TargetPort::Number(n) => Some(*n),
                            TargetPort::Name(name) => pod
                                .ports
                                .iter()
                                .find(|c| {
                                    c.name.as_deref() == Some(name.as_str())
                                        && c.protocol == sp.protocol
                                })
                                .map(|c| c.port),
                        }?;
                        Some(EndpointPort {
                            name: Some(sp.name.clone()),
                            port: Some(i32::from(number)),
                            protocol: Some(protocol_text(sp.protocol).into()),
                            ..Default::default()
                        })
                    })
                    .collect();
                let endpoint = Endpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(pod.ready && !pod.terminating),
                        serving: Some(pod.ready),
                        terminating: Some(pod.terminating),
                    }),
                    node_name: Some(pod.node.clone()),
                    target_ref: Some(ObjectReference {
                        kind: Some("Pod".into()),
                        namespace: Some(pod.namespace.clone()),
                        name: Some(pod.name.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                match groups.iter_mut().find(|(p, _)| *p == ports) {
                    Some((_, eps)) => eps.push(endpoint),
                    None => groups.push((ports, vec![endpoint])),
                }
            }
            if groups.is_empty() {
                groups.push((Vec::new(), Vec::new()));
            }
            for (i, (ports, endpoints)) in groups.into_iter().enumerate() {
                let mut labels = BTreeMap::new();
                labels.insert(SERVICE_NAME_LABEL.to_owned(), self.name.clone());
                labels.insert(
                    "endpointslice.kubernetes.io/managed-by".to_owned(),
                    "endpointslice-controller.k8s.io".to_owned(),
                );
                out.push(EndpointSlice {
                    metadata: ObjectMeta {
                        name: Some(format!("{}-{short}-{i}", self.name)),
                        namespace: Some(self.namespace.clone()),
                        labels: Some(labels),
                        ..Default::default()
                    },
                    address_type: family.into(),
                    endpoints,
                    ports: Some(ports),
                });
            }
        }
        out
    }
}

/// Pods and Services: renders them (and their EndpointSlices) as YAML
/// and reads that YAML back into the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifests {
    pub pods: Vec<PodManifest>,
    pub services: Vec<ServiceManifest>,
}

impl Manifests {
    /// Every address spelled as Rust prints it: the objects as kube-proxy
    /// reads them (`ParseIPSloppy`), whatever the agent under test makes
    /// of the spellings.
    pub fn canonical(&self) -> Self {
        let mut out = self.clone();
        for s in &mut out.services {
            s.spelled.clear();
        }
        out
    }

    pub fn pod_mut(&mut self, id: &str) -> Option<&mut PodManifest> {
        self.pods.iter_mut().find(|p| p.id() == id)
    }

    pub fn slices(&self) -> Vec<EndpointSlice> {
        self.services
            .iter()
            .flat_map(|s| s.endpoint_slices(&self.pods))
            .collect()
    }

    /// Every object as one multi-document YAML text: Pods, Services,
    /// EndpointSlices.
    pub fn to_yaml(&self) -> Result<String, Error> {
        let yaml_err = |e: serde_yaml::Error| Error::Invalid(format!("rendering YAML: {e}"));
        let mut docs = Vec::new();
        for p in &self.pods {
            docs.push(serde_yaml::to_string(&p.to_pod()).map_err(yaml_err)?);
        }
        for s in &self.services {
            docs.push(serde_yaml::to_string(&s.to_service()).map_err(yaml_err)?);
        }
        for s in self.slices() {
            docs.push(serde_yaml::to_string(&s).map_err(yaml_err)?);
        }
        Ok(docs.join("---\n"))
    }

    /// The model as the stand-in and the agent see it: the YAML read back.
    pub fn cluster_state(
        &self,
        node_name: &str,
        node_ips: &[IpAddr],
    ) -> Result<ClusterState, Error> {
        let mut state = ClusterState {
            node_name: node_name.into(),
            node_ips: node_ips.to_vec(),
            ..Default::default()
        };
        load(&self.to_yaml()?, &mut state)?;
        Ok(state)
    }
}

/// Reads the Pods, Services and EndpointSlices of a multi-document YAML
/// text into `state` (other kinds are skipped), with the agent's own
/// conversions (`pod_info`, `service_info`, `endpoint_slice_info`).
pub fn load(yaml: &str, state: &mut ClusterState) -> Result<(), Error> {
    use serde::Deserialize;
    let bad = |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("{what}: {e}"));
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(doc).map_err(|e| bad("reading YAML", &e))?;
        if value.is_null() {
            continue;
        }
        let field = |k: &str| {
            value
                .get(k)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned()
        };
        match (field("apiVersion").as_str(), field("kind").as_str()) {
            ("v1", "Pod") => {
                let pod: Pod = serde_yaml::from_value(value).map_err(|e| bad("Pod", &e))?;
                let (key, info) = pod_info(&pod).map_err(|e| bad("Pod", &e))?;
                state.pods.insert(key, info);
            }
            ("v1", "Service") => {
                let svc: Service = serde_yaml::from_value(value).map_err(|e| bad("Service", &e))?;
                let (key, info) = service_info(&svc).map_err(|e| bad("Service", &e))?;
                state.services.insert(key, info);
            }
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                let slice: EndpointSlice =
                    serde_yaml::from_value(value).map_err(|e| bad("EndpointSlice", &e))?;
                let (key, info) =
                    endpoint_slice_info(&slice).map_err(|e| bad("EndpointSlice", &e))?;
                state.endpoint_slices.insert(key, info);
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
