//! Builders and verdict helpers shared by the semantics tests.
//!
//! A [`World`] is a small cluster (node `node-a`, addresses 192.168.0.1 and
//! fd00::1); policies are written as YAML. [`Run::allows`] judges a flow
//! the way the datapath does: egress at the source if it is a local
//! endpoint, ingress at the destination if it is one, both through
//! `policy_common::model::Maps::judge` over the compiled maps. It also
//! asks `explain` and checks it agrees.
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use policy_agent::{
    cluster::{ClusterState, ContainerPort, NamespaceInfo, ObjectRef, PodFields, PodInfo},
    identity::IdentityAllocator,
    policy::{self, CompileOptions, Compiled, ExplainQuery, FlowEnd},
};
use policy_common::{
    direction,
    model::{Datapath, Maps, Packet, TCP_SYN},
    proto,
    verdict::Reason,
};

#[allow(unused_imports)]
pub use policy_common::proto::{ICMP, SCTP, TCP, UDP};

pub const NODE: &str = "node-a";
pub const NODE_V4: &str = "192.168.0.1";
pub const NODE_V6: &str = "fd00::1";

pub struct World {
    pub state: ClusterState,
    pub ids: IdentityAllocator,
    next_created: i64,
}

impl Default for World {
    fn default() -> Self {
        Self::new()
    }
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap_or_else(|_| panic!("bad ip {s}"))
}

pub fn obj(s: &str) -> ObjectRef {
    let (ns, name) = s
        .split_once('/')
        .unwrap_or_else(|| panic!("want ns/name, got {s}"));
    ObjectRef::new(ns, name)
}

impl World {
    pub fn new() -> Self {
        let mut w = Self {
            state: ClusterState {
                node_name: NODE.into(),
                node_ips: vec![ip(NODE_V4), ip(NODE_V6)],
                ..Default::default()
            },
            ids: IdentityAllocator::new(),
            next_created: 1,
        };
        w.ns("default", &[]);
        w
    }

    /// Adds or relabels a namespace (the name label is added as the API
    /// server does).
    pub fn ns(&mut self, name: &str, labels: &[(&str, &str)]) -> &mut Self {
        let mut l: std::collections::BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        l.insert("kubernetes.io/metadata.name".into(), name.into());
        self.state
            .namespaces
            .insert(name.into(), NamespaceInfo { labels: l });
        self
    }

    /// Adds a running pod on this node ("ns/name"), newer than every pod
    /// added before.
    pub fn pod(&mut self, name: &str, labels: &[(&str, &str)], ips: &[&str]) -> &mut PodInfo {
        let created = self.next_created;
        self.next_created += 1;
        let key = obj(name);
        self.state
            .namespaces
            .entry(key.namespace.to_string())
            .or_insert_with(|| NamespaceInfo {
                labels: [(
                    "kubernetes.io/metadata.name".to_owned(),
                    key.namespace.to_string(),
                )]
                .into(),
            });
        let info = PodFields {
            labels: std::sync::Arc::new(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect(),
            ),
            node_name: Some(NODE.into()),
            ips: ips.iter().map(|s| ip(s)).collect(),
            created,
            ..Default::default()
        }
        .into();
        self.state.pods.insert(key.clone(), info);
        self.state.pods.get_mut(&key).unwrap()
    }

    pub fn pod_mut(&mut self, name: &str) -> &mut PodInfo {
        self.state.pods.get_mut(&obj(name)).unwrap()
    }

    /// Adds (or replaces) a policy written in YAML; namespace defaults to
    /// "default".
    pub fn policy(&mut self, yaml: &str) -> &mut Self {
        let np: NetworkPolicy =
            serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("bad yaml: {e}\n{yaml}"));
        let name = np.metadata.name.clone().expect("policy name");
        let ns = np
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        self.state
            .policies
            .insert(ObjectRef::new(ns, name), np.into());
        self
    }

    /// Adds (or replaces) a ClusterNetworkPolicy written in YAML.
    pub fn cluster_policy(&mut self, yaml: &str) -> &mut Self {
        let cnp: policy_agent::cluster::ClusterNetworkPolicy =
            serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("bad yaml: {e}\n{yaml}"));
        let name = cnp.metadata.name.clone().expect("policy name");
        self.state.cluster_policies.insert(name, cnp.into());
        self
    }

    pub fn remove_policy(&mut self, name: &str) -> &mut Self {
        self.state.policies.remove(&obj(name));
        self
    }

    pub fn compile(&mut self) -> Run {
        let compiled = policy::compile(&self.state, &mut self.ids);
        Run {
            state: self.state.clone(),
            compiled,
        }
    }

    pub fn compile_with(&mut self, options: CompileOptions) -> Run {
        let compiled = policy::compile_with(&self.state, &mut self.ids, options);
        Run {
            state: self.state.clone(),
            compiled,
        }
    }

    pub fn compile_all_local(&mut self) -> Run {
        let compiled = policy::compile_with(
            &self.state,
            &mut self.ids,
            CompileOptions {
                all_pods_local: true,
                ..CompileOptions::default()
            },
        );
        Run {
            state: self.state.clone(),
            compiled,
        }
    }
}

/// A policy `web` whose one ingress rule admits to the pods labelled
/// `app: web` the peers `from` lists (YAML list items, indented four).
pub fn web_from(from: &str) -> String {
    format!(
        "metadata: {{name: web}}\nspec:\n  podSelector: {{matchLabels: {{app: web}}}}\n  ingress:\n  - from:\n{from}"
    )
}

pub fn named_port(name: &str, protocol: u8, port: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        port,
        protocol,
    }
}

pub struct Run {
    pub state: ClusterState,
    pub compiled: Compiled,
}

/// A flow end: "ns/pod" or an address.
fn end(s: &str) -> FlowEnd {
    match s.parse::<IpAddr>() {
        Ok(a) => FlowEnd::Ip(a),
        Err(_) => FlowEnd::Pod(obj(s)),
    }
}

impl Run {
    /// The addresses a flow end stands for (a pod: the ones it holds).
    fn addresses(&self, s: &str) -> Vec<IpAddr> {
        match end(s) {
            FlowEnd::Ip(a) => vec![a],
            FlowEnd::Pod(p) => match self.compiled.local_pods.get(&p) {
                Some(ips) => ips.clone(),
                None => self
                    .state
                    .pods
                    .get(&p)
                    .map(|i| i.ips.to_vec())
                    .unwrap_or_default(),
            },
        }
    }

    /// The map verdict for src → dst (both directions judged where there is
    /// a local endpoint). Checked against explain.
    pub fn allows(&self, src: &str, dst: &str, protocol: u8, port: u16) -> bool {
        self.judged(src, dst, protocol, port)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::allows`], with explain's disagreements returned rather
    /// than asserted.
    fn judged(&self, src: &str, dst: &str, protocol: u8, port: u16) -> Result<bool, String> {
        let (s_ips, d_ips) = (self.addresses(src), self.addresses(dst));
        let (s, d) = s_ips
            .iter()
            .find_map(|s| {
                d_ips
                    .iter()
                    .find(|d| d.is_ipv4() == s.is_ipv4())
                    .map(|d| (*s, *d))
            })
            .unwrap_or_else(|| panic!("{src} and {dst} share no address family"));
        let verdict = self.allows_ips(src, s, dst, d, protocol, port);
        let q = ExplainQuery {
            src: end_at(src, s),
            dst: end_at(dst, d),
            protocol,
            port,
        };
        let ex = policy::explain(&self.state, &self.compiled, &q)
            .map_err(|e| format!("explain: {e}"))?;
        if !ex.consistent() {
            return Err(format!("explain disagrees with the maps:\n{ex}"));
        }
        if ex.allowed != verdict {
            return Err(format!("explain verdict differs:\n{ex}"));
        }
        Ok(verdict)
    }

    /// The map verdict for the given addresses: the first packet of the
    /// flow classified, as the kernel does (`policy_common::model`), at
    /// the source's endpoint (its egress) and at the destination's (its
    /// ingress), each over the compiled maps. Nothing is decided here:
    /// traffic of a pod to itself passes because the datapath's egress
    /// hook says so.
    pub fn allows_ips(
        &self,
        src: &str,
        s: IpAddr,
        dst: &str,
        d: IpAddr,
        protocol: u8,
        port: u16,
    ) -> bool {
        let mut ok = true;
        if let FlowEnd::Pod(p) = end(src)
            && self.compiled.maps.endpoints.contains_key(&p)
        {
            ok &= !self
                .classify(&p.to_string(), direction::EGRESS, s, d, protocol, port)
                .is_drop();
        }
        // A pod's packet to its own address is delivered inside its own
        // namespace: it never reaches its ingress hook (and if the pod
        // forces it out of its interface, only the egress hook can tell it
        // sent it itself; at ingress a source equal to the destination
        // proves nothing and is judged).
        let to_itself = src == dst && s == d;
        if let FlowEnd::Pod(p) = end(dst)
            && !to_itself
            && self.compiled.maps.endpoints.contains_key(&p)
        {
            ok &= !self
                .classify(&p.to_string(), direction::INGRESS, s, d, protocol, port)
                .is_drop();
        }
        ok
    }

    /// The reason the datapath gives the first packet of a flow `s` → `d`
    /// at local endpoint `endpoint`'s interface, in `dir` (egress: the
    /// endpoint sends it; ingress: it receives it).
    pub fn classify(
        &self,
        endpoint: &str,
        dir: u8,
        s: IpAddr,
        d: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Reason {
        const IFINDEX: u32 = 7;
        let ep = *self
            .compiled
            .maps
            .endpoints
            .get(&obj(endpoint))
            .expect("local endpoint");
        let mut maps = self.model();
        maps.endpoints = [(IFINDEX, ep)].into();
        let (sport, dport, tcp_flags, icmp_type) = match protocol {
            proto::ICMP => (9, 9, 0, if s.is_ipv4() { 8 } else { 128 }),
            proto::TCP => (40000, port, TCP_SYN, 0),
            _ => (40000, port, 0, 0),
        };
        let protocol = if protocol == proto::ICMP && s.is_ipv6() {
            proto::ICMPV6
        } else {
            protocol
        };
        Datapath::new(maps)
            .classify(&Packet {
                ifindex: IFINDEX,
                direction: dir,
                src: s,
                dst: d,
                protocol,
                sport,
                dport,
                tcp_flags,
                icmp_type,
                hop_limit: 64,
                quoted: None,
                mark: 0,
                ingress_ifindex: 0,
            })
            .judgement
            .expect("an unmarked packet at a pod's hook is judged")
            .reason
    }

    /// The reason of the judgement of one direction at a local endpoint.
    pub fn reason(&self, endpoint: &str, dir: u8, peer: &str, protocol: u8, port: u16) -> Reason {
        let ep = self
            .compiled
            .maps
            .endpoints
            .get(&obj(endpoint))
            .expect("local endpoint");
        let peer_ip = self.addresses(peer)[0];
        self.model().judge(ep, dir, peer_ip, protocol, port).reason
    }

    pub fn model(&self) -> Maps {
        self.compiled.maps.to_model(|_| 0)
    }

    pub fn is_endpoint(&self, pod: &str) -> bool {
        self.compiled.maps.endpoints.contains_key(&obj(pod))
    }

    pub fn isolated(&self, pod: &str, dir: u8) -> bool {
        self.compiled
            .maps
            .endpoints
            .get(&obj(pod))
            .expect("local endpoint")
            .isolated(dir)
    }

    pub fn identity_of(&self, pod: &str) -> u32 {
        self.compiled
            .maps
            .endpoints
            .get(&obj(pod))
            .map(|e| e.identity)
            .unwrap_or_else(|| {
                let a = self.addresses(pod)[0];
                self.model().ipcache_lookup(a).identity
            })
    }

    /// Asserts every (name, src, dst, protocol, port, allowed) case.
    #[track_caller]
    pub fn check(&self, cases: &[Flow<'_>]) {
        let bad = self.wrong_verdicts(cases);
        assert!(
            bad.is_empty(),
            "wrong verdicts:\n{}\nerrors: {:?}",
            bad.join("\n"),
            self.error_strings()
        );
    }

    /// The flows whose verdict is not the one they expect (or that explain
    /// judges otherwise), one line each.
    fn wrong_verdicts(&self, cases: &[Flow<'_>]) -> Vec<String> {
        let mut bad = Vec::new();
        for (name, src, dst, protocol, port, want) in cases {
            let flow = format!("{name}: {src} -> {dst} {}/{port}", proto_name(*protocol));
            match self.judged(src, dst, *protocol, *port) {
                Ok(got) if got == *want => {}
                Ok(got) => bad.push(format!(
                    "{flow}: want {}, got {}",
                    verdict(*want),
                    verdict(got)
                )),
                Err(e) => bad.push(format!("{flow}: {e}")),
            }
        }
        bad
    }

    pub fn error_strings(&self) -> Vec<String> {
        self.compiled
            .errors
            .iter()
            .map(ToString::to_string)
            .collect()
    }
}

/// One flow a table expects: (name, src, dst, protocol, port, allowed).
pub type Flow<'a> = (&'a str, &'a str, &'a str, u8, u16, bool);

/// One case of a table run by [`check_cases`]: policies added to a fresh
/// world, then what the compiled result must do.
#[derive(Default)]
pub struct Case<'a> {
    /// What the case shows; every failure names it.
    pub name: &'a str,
    /// The policies (YAML) added, in order.
    pub policies: &'a [&'a str],
    /// The flows and their expected verdicts.
    pub flows: &'a [Flow<'a>],
    /// (pod, direction, isolated): whether the pod is isolated that way.
    pub isolated: &'a [(&'a str, u8, bool)],
    /// The field the first compile error names, where the case expects one.
    pub first_error: Option<&'a str>,
}

/// Runs every case on a world of its own from `world` and asserts once,
/// naming each case with every flow, isolation or error it got wrong.
#[track_caller]
pub fn check_cases(world: fn() -> World, cases: &[Case<'_>]) {
    let mut bad = Vec::new();
    for case in cases {
        let mut w = world();
        for p in case.policies {
            w.policy(p);
        }
        let run = w.compile();
        let mut wrong = run.wrong_verdicts(case.flows);
        for &(pod, dir, want) in case.isolated {
            let got = run.isolated(pod, dir);
            if got != want {
                let dir = if dir == direction::INGRESS {
                    "ingress"
                } else {
                    "egress"
                };
                wrong.push(format!("{pod} {dir}-isolated: want {want}, got {got}"));
            }
        }
        if let Some(field) = case.first_error {
            let got = run.compiled.errors.first().map(|e| e.field());
            if got != Some(field) {
                wrong.push(format!("first error's field: want {field}, got {got:?}"));
            }
        }
        if !wrong.is_empty() {
            bad.push(format!(
                "{}:\n  {}\n  errors: {:?}",
                case.name,
                wrong.join("\n  "),
                run.error_strings()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} cases wrong:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
}

fn end_at(s: &str, a: IpAddr) -> FlowEnd {
    match end(s) {
        FlowEnd::Ip(a) => FlowEnd::Ip(a),
        FlowEnd::Pod(_) => FlowEnd::Ip(a),
    }
}

fn verdict(b: bool) -> &'static str {
    if b { "allow" } else { "deny" }
}

pub fn proto_name(p: u8) -> &'static str {
    match p {
        proto::TCP => "TCP",
        proto::UDP => "UDP",
        proto::SCTP => "SCTP",
        proto::ICMP => "ICMP",
        _ => "other",
    }
}

pub const ALLOW: bool = true;
pub const DENY: bool = false;
