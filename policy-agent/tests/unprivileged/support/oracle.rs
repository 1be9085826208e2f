//! An independent, line-by-line evaluator of NetworkPolicy v1, written
//! against the API types only (no compiler code), and generators of random
//! small clusters and policies.
//!
//! Where the compiler documents a deliberate (fail-closed) choice the spec
//! leaves open, the oracle states it too, marked "DOCUMENTED CHOICE".
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::{
        IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule,
        NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
    },
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use policy_agent::cluster::{
    ClusterState, ContainerPort, NamespaceInfo, ObjectRef, PodFields, PodInfo,
};
use policy_common::proto;
use proptest::prelude::*;

pub const NODE: &str = "node-a";
pub const NODE_IP: &str = "192.168.0.1";

// ---------------------------------------------------------------- oracle

type Labels = BTreeMap<String, String>;

/// "A label selector is a label query over a set of resources. The result
/// of matchLabels and matchExpressions are ANDed. An empty label selector
/// matches all objects." Returns None if the selector is invalid.
fn selector_matches(sel: &LabelSelector, labels: &Labels) -> Option<bool> {
    let mut ok = true;
    for (k, v) in sel.match_labels.iter().flatten() {
        if k.is_empty() {
            return None;
        }
        ok &= labels.get(k) == Some(v);
    }
    for r in sel.match_expressions.iter().flatten() {
        if r.key.is_empty() {
            return None;
        }
        let values: Vec<&String> = r.values.iter().flatten().collect();
        let has = labels.get(&r.key);
        // "If the operator is In or NotIn, the values array must be
        // non-empty. If the operator is Exists or DoesNotExist, the values
        // array must be empty."
        ok &= match r.operator.as_str() {
            "In" if !values.is_empty() => has.is_some_and(|v| values.contains(&v)),
            // NotIn: a missing key is "not in".
            "NotIn" if !values.is_empty() => has.is_none_or(|v| !values.contains(&v)),
            "Exists" if values.is_empty() => has.is_some(),
            "DoesNotExist" if values.is_empty() => has.is_none(),
            _ => return None,
        };
    }
    Some(ok)
}

fn selector_valid(sel: &LabelSelector) -> bool {
    selector_matches(sel, &Labels::new()).is_some()
}

fn cidr(s: &str) -> Option<IpNet> {
    s.trim().parse::<IpNet>().ok().map(|n| n.trunc())
}

/// "IANA_SVC_NAME": at most 15 characters, lower-case letters, digits and
/// hyphens, at least one letter, hyphens not at either end nor adjacent.
fn port_name_valid(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && s.chars().any(|c| c.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

fn protocol(p: &Option<String>) -> Option<u8> {
    match p.as_deref() {
        None | Some("TCP") => Some(proto::TCP),
        Some("UDP") => Some(proto::UDP),
        Some("SCTP") => Some(proto::SCTP),
        _ => None,
    }
}

fn port_valid(p: &NetworkPolicyPort) -> bool {
    if protocol(&p.protocol).is_none() {
        return false;
    }
    let in_range = |n: i32| (1..=65535).contains(&n);
    match (&p.port, p.end_port) {
        (None, None) => true,
        (None, Some(_)) => false,
        (Some(IntOrString::String(s)), e) => e.is_none() && port_name_valid(s),
        (Some(IntOrString::Int(n)), None) => in_range(*n),
        (Some(IntOrString::Int(n)), Some(e)) => in_range(*n) && in_range(e) && e >= *n,
    }
}

fn peer_valid(p: &NetworkPolicyPeer) -> bool {
    match (&p.ip_block, &p.pod_selector, &p.namespace_selector) {
        (Some(b), None, None) => {
            let Some(c) = cidr(&b.cidr) else { return false };
            b.except
                .iter()
                .flatten()
                .all(|e| cidr(e).is_some_and(|e| c.contains(&e) && e.prefix_len() > c.prefix_len()))
        }
        (Some(_), _, _) => false,
        (None, None, None) => false,
        (None, ps, ns) => ps.iter().chain(ns.iter()).all(selector_valid),
    }
}

fn rule_valid(
    peers: &Option<Vec<NetworkPolicyPeer>>,
    ports: &Option<Vec<NetworkPolicyPort>>,
) -> bool {
    peers.iter().flatten().all(peer_valid) && ports.iter().flatten().all(port_valid)
}

/// Whether the API would accept the policy (as far as the compiler checks).
pub fn policy_valid(np: &NetworkPolicy) -> bool {
    let spec = np.spec.clone().unwrap_or_default();
    spec.pod_selector.as_ref().is_none_or(selector_valid)
        && spec
            .policy_types
            .iter()
            .flatten()
            .all(|t| t == "Ingress" || t == "Egress")
        && spec
            .ingress
            .iter()
            .flatten()
            .all(|r| rule_valid(&r.from, &r.ports))
        && spec
            .egress
            .iter()
            .flatten()
            .all(|r| rule_valid(&r.to, &r.ports))
}

/// "If this field is not specified, it will default based on the existence
/// of ingress or egress rules; policies that contain an egress section are
/// assumed to affect egress, and all policies (whether or not they contain
/// an ingress section) are assumed to affect ingress."
/// DOCUMENTED CHOICE: an unknown type isolates both directions.
fn policy_types(spec: &NetworkPolicySpec) -> (bool, bool) {
    match spec.policy_types.as_ref().filter(|t| !t.is_empty()) {
        None => (true, spec.egress.as_ref().is_some_and(|e| !e.is_empty())),
        Some(t) if t.iter().any(|x| x != "Ingress" && x != "Egress") => (true, true),
        Some(t) => (
            t.iter().any(|x| x == "Ingress"),
            t.iter().any(|x| x == "Egress"),
        ),
    }
}

/// What the NetworkPolicies say of one new flow at one pod (see
/// [`World::network_policies`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkPolicyWord {
    /// The policies isolating the pod in the flow's direction.
    pub isolating: BTreeSet<ObjectRef>,
    /// The rules admitting the flow: (policy, index in its list).
    pub admitting: BTreeSet<(ObjectRef, usize)>,
}

/// What the oracle knows about an address.
pub struct World<'a> {
    pub state: &'a ClusterState,
    pub local_all: bool,
    /// Address → pod holding it.
    holders: BTreeMap<IpAddr, ObjectRef>,
}

pub fn ns_labels(state: &ClusterState, ns: &str) -> Labels {
    state
        .namespaces
        .get(ns)
        .map(|n| n.labels.clone())
        .unwrap_or_else(|| [("kubernetes.io/metadata.name".to_owned(), ns.to_owned())].into())
}

impl<'a> World<'a> {
    pub fn new(state: &'a ClusterState, local_all: bool) -> Self {
        // A pod that is not running (terminal) or uses the host network
        // holds no pod address; of two claimants the newer one (then the
        // first name) holds it; node addresses are the node's.
        let mut holders: BTreeMap<IpAddr, (i64, ObjectRef)> = BTreeMap::new();
        for (name, p) in &state.pods {
            if p.terminal || p.host_network {
                continue;
            }
            for ip in &p.ips {
                if state.node_ips.contains(ip) {
                    continue;
                }
                let better = match holders.get(ip) {
                    None => true,
                    Some((c, n)) => p.created > *c || (p.created == *c && name < n),
                };
                if better {
                    holders.insert(*ip, (p.created, name.clone()));
                }
            }
        }
        Self {
            state,
            local_all,
            holders: holders.into_iter().map(|(ip, (_, n))| (ip, n)).collect(),
        }
    }

    fn pod(&self, ip: IpAddr) -> Option<(&ObjectRef, &PodInfo)> {
        self.holders.get(&ip).map(|n| (n, &self.state.pods[n]))
    }

    fn local_endpoint(&self, ip: IpAddr) -> Option<(&ObjectRef, &PodInfo)> {
        self.pod(ip).filter(|(_, p)| {
            self.local_all || p.node_name.as_deref() == Some(self.state.node_name.as_str())
        })
    }

    /// Addresses held by pods "indistinguishable" from `pod` (same
    /// namespace, namespace labels, labels and named ports).
    fn twin_addresses(&self, pod: &ObjectRef) -> Vec<IpAddr> {
        let sig = |n: &ObjectRef| {
            let p = &self.state.pods[n];
            let named: BTreeSet<(String, u8, u16)> = p
                .ports
                .iter()
                .filter_map(|c| {
                    c.name
                        .clone()
                        .filter(|s| !s.is_empty())
                        .map(|s| (s.to_string(), c.protocol, c.port))
                })
                .collect();
            (
                n.namespace.clone(),
                ns_labels(self.state, &n.namespace),
                p.labels.clone(),
                named,
            )
        };
        let mine = sig(pod);
        self.holders
            .iter()
            .filter(|(_, n)| sig(n) == mine)
            .map(|(ip, _)| *ip)
            .collect()
    }

    /// The verdict for a new flow src → dst: egress judged at src if it is
    /// a local pod, ingress at dst if it is one.
    pub fn allows(&self, src: IpAddr, dst: IpAddr, proto_: u8, port: u16) -> bool {
        // A pod "cannot block access to itself".
        if src == dst {
            return true;
        }
        let out = match self.local_endpoint(src) {
            Some((name, _)) => self.judge(name, false, dst, proto_, port),
            None => true,
        };
        let inn = match self.local_endpoint(dst) {
            Some((name, _)) => self.judge(name, true, src, proto_, port),
            None => true,
        };
        out && inn
    }

    /// The verdict for a packet a local pod at `src` sends to the node's
    /// own address `node`: node traffic, always allowed, but for an
    /// encapsulation.
    /// DOCUMENTED CHOICE (the design's, the spec says nothing of it): an
    /// encapsulation a pod sends to a node address (IP-in-IP 4, IPv6-in-IP
    /// 41, GRE 47, EtherIP 97, MPLS-in-IP 137; UDP to VXLAN's 4789 and
    /// 8472, GENEVE's 6081) is not node traffic: decapsulated, its inner
    /// packet travels on with a source the pod chose. It is judged by the
    /// pod's egress rules as a packet to any other address.
    pub fn to_node(&self, src: IpAddr, node: IpAddr, proto_: u8, port: u16) -> bool {
        assert!(
            self.state.node_ips.contains(&node),
            "{node} is no node address"
        );
        let encapsulation = matches!(proto_, 4 | 41 | 47 | 97 | 137)
            || (proto_ == proto::UDP && matches!(port, 4789 | 8472 | 6081));
        match self.local_endpoint(src) {
            Some((name, _)) if encapsulation => {
                self.judge_peer(name, false, node, proto_, port, false)
            }
            _ => true,
        }
    }

    fn judge(
        &self,
        endpoint: &ObjectRef,
        ingress: bool,
        peer: IpAddr,
        proto_: u8,
        port: u16,
    ) -> bool {
        self.judge_peer(endpoint, ingress, peer, proto_, port, true)
    }

    /// [`Self::judge`]; `node_traffic`: whether a node address as `peer`
    /// makes it node traffic.
    fn judge_peer(
        &self,
        endpoint: &ObjectRef,
        ingress: bool,
        peer: IpAddr,
        proto_: u8,
        port: u16,
        node_traffic: bool,
    ) -> bool {
        // "traffic to and from the node where a Pod is running is always
        // allowed, regardless of the IP address of the Pod or the node."
        // DOCUMENTED CHOICE: that is the NetworkPolicy tier's word; what a
        // pod sends the node meets the ClusterNetworkPolicy tiers (nodes
        // and networks peers) like any other egress.
        let to_node = node_traffic && self.state.node_ips.contains(&peer);
        if to_node && (ingress || self.state.cluster_policies.is_empty()) {
            return true;
        }
        let word = self.network_policies(endpoint, ingress, peer, proto_, port);
        let isolated = !word.isolating.is_empty();
        let allowed_by_np = !word.admitting.is_empty();
        let ep = &self.state.pods[endpoint];
        // "the only allowed connections are those allowed by the union of
        // the policies' rules".
        let np_word = isolated.then_some(allowed_by_np || to_node);
        if self.state.cluster_policies.is_empty() {
            return np_word.unwrap_or(true);
        }
        // ClusterNetworkPolicy tiers around the NetworkPolicy tier, by the
        // reference evaluator (written from the API text, apart from the
        // compiler).
        super::cnp_oracle::decide(
            self.state,
            endpoint,
            ep,
            ingress,
            self.pod(peer),
            peer,
            proto_,
            port,
            np_word,
        )
    }

    /// What the NetworkPolicies say of a new flow of `endpoint` with
    /// `peer` (`ingress`: the peer sends): the policies isolating it in
    /// that direction, and the rules (policy, index in its list) that
    /// admit the flow.
    pub fn network_policies(
        &self,
        endpoint: &ObjectRef,
        ingress: bool,
        peer: IpAddr,
        proto_: u8,
        port: u16,
    ) -> NetworkPolicyWord {
        let ep = &self.state.pods[endpoint];
        let mut word = NetworkPolicyWord::default();
        for (name, np) in &self.state.policies {
            if name.namespace != endpoint.namespace {
                continue;
            }
            let spec = np.spec.clone().unwrap_or_default();
            // "An empty podSelector selects all pods in this namespace."
            // DOCUMENTED CHOICE: an invalid podSelector selects them all.
            let selected = spec
                .pod_selector
                .as_ref()
                .map_or(Some(true), |s| selector_matches(s, &ep.labels))
                .unwrap_or(true);
            if !selected {
                continue;
            }
            let (ti, te) = policy_types(&spec);
            if (ingress && !ti) || (!ingress && !te) {
                continue;
            }
            // "a pod is isolated for ingress if there is any NetworkPolicy
            // that both selects the pod and has "Ingress" in its policyTypes".
            word.isolating.insert(name.clone());
            // DOCUMENTED CHOICE: an invalid policy isolates but allows nothing.
            if !policy_valid(np) {
                continue;
            }
            let admitting: Vec<usize> = if ingress {
                spec.ingress
                    .iter()
                    .flatten()
                    .enumerate()
                    .filter(|(_, r): &(usize, &NetworkPolicyIngressRule)| {
                        self.rule(name, &r.from, &r.ports, true, endpoint, peer, proto_, port)
                    })
                    .map(|(i, _)| i)
                    .collect()
            } else {
                spec.egress
                    .iter()
                    .flatten()
                    .enumerate()
                    .filter(|(_, r): &(usize, &NetworkPolicyEgressRule)| {
                        self.rule(name, &r.to, &r.ports, false, endpoint, peer, proto_, port)
                    })
                    .map(|(i, _)| i)
                    .collect()
            };
            word.admitting
                .extend(admitting.into_iter().map(|i| (name.clone(), i)));
        }
        word
    }

    /// The ClusterNetworkPolicy rule that decides a new flow of `endpoint`
    /// with `peer` (its policy's name and the rule's index), when a tier's
    /// Accept or Deny does.
    pub fn tier_rule(
        &self,
        endpoint: &ObjectRef,
        ingress: bool,
        peer: IpAddr,
        proto_: u8,
        port: u16,
    ) -> Option<(String, usize)> {
        let word = self.network_policies(endpoint, ingress, peer, proto_, port);
        let np_word = (!word.isolating.is_empty()).then_some(!word.admitting.is_empty());
        super::cnp_oracle::decide_by(
            self.state,
            endpoint,
            &self.state.pods[endpoint],
            ingress,
            self.pod(peer),
            peer,
            proto_,
            port,
            np_word,
        )
        .1
    }

    #[allow(clippy::too_many_arguments)]
    fn rule(
        &self,
        policy: &ObjectRef,
        peers: &Option<Vec<NetworkPolicyPeer>>,
        ports: &Option<Vec<NetworkPolicyPort>>,
        ingress: bool,
        endpoint: &ObjectRef,
        peer: IpAddr,
        proto_: u8,
        port: u16,
    ) -> bool {
        let peer_pod = self.pod(peer);
        // "If this field is empty or missing, this rule matches all
        // sources"; "If this field is present and contains at least one
        // item, this rule allows traffic only if the traffic matches at
        // least one item in the from list."
        let (any_peer, by_selector, by_block) = match peers.as_ref().filter(|l| !l.is_empty()) {
            None => (true, false, false),
            Some(list) => {
                let mut sel = false;
                let mut block = false;
                for p in list {
                    if let Some(b) = &p.ip_block {
                        block |= self.in_block(b, peer);
                    } else if let Some((name, pod)) = peer_pod {
                        // "If namespaceSelector is also set, then the
                        // NetworkPolicyPeer as a whole selects the pods
                        // matching podSelector in the Namespaces selected
                        // by NamespaceSelector. Otherwise it selects the
                        // pods matching podSelector in the policy's own
                        // namespace."
                        let ns_ok = match &p.namespace_selector {
                            None => name.namespace == policy.namespace,
                            Some(s) => {
                                selector_matches(s, &ns_labels(self.state, &name.namespace))
                                    == Some(true)
                            }
                        };
                        let pod_ok = p
                            .pod_selector
                            .as_ref()
                            .is_none_or(|s| selector_matches(s, &pod.labels) == Some(true));
                        sel |= ns_ok && pod_ok;
                    }
                }
                (false, sel, block)
            }
        };
        if !(any_peer || by_selector || by_block) {
            return false;
        }
        // "If this field is empty or missing, this rule matches all ports."
        let Some(list) = ports.as_ref().filter(|l| !l.is_empty()) else {
            return true;
        };
        if !matches!(proto_, proto::TCP | proto::UDP | proto::SCTP) {
            return false;
        }
        list.iter().any(|p| {
            if protocol(&p.protocol) != Some(proto_) {
                return false;
            }
            match (&p.port, p.end_port) {
                // "If this field is not provided, this matches all port names and numbers."
                (None, _) => true,
                (Some(IntOrString::Int(n)), None) => i64::from(port) == i64::from(*n),
                // "endPort indicates that the range of ports from port to endPort if set, inclusive"
                (Some(IntOrString::Int(n)), Some(e)) => {
                    (i64::from(*n)..=i64::from(e)).contains(&i64::from(port))
                }
                (Some(IntOrString::String(name)), _) => {
                    // Named ports resolve on the destination pod: the
                    // selected pod for ingress, the peer pod for egress.
                    let dest = if ingress {
                        Some(endpoint)
                    } else {
                        // DOCUMENTED CHOICE: through an ipBlock alone, the
                        // peer pod's name resolves only if every address of
                        // its indistinguishable pods lies in the rule's
                        // blocks; non-pod addresses never resolve.
                        let through_block_ok = || {
                            peer_pod.is_some_and(|(n, _)| {
                                self.twin_addresses(n).iter().all(|a| {
                                    peers
                                        .iter()
                                        .flatten()
                                        .filter_map(|p| p.ip_block.as_ref())
                                        .any(|b| self.in_block(b, *a))
                                })
                            })
                        };
                        peer_pod
                            .map(|(n, _)| n)
                            .filter(|_| any_peer || by_selector || through_block_ok())
                    };
                    dest.is_some_and(|d| {
                        self.state.pods[d].ports.iter().any(|c| {
                            c.name.as_deref() == Some(name.as_str())
                                && c.protocol == proto_
                                && c.port == port
                        })
                    })
                }
            }
        })
    }

    /// "IPBlock describes a particular CIDR ... Except is a slice of CIDRs
    /// that should not be included within an IPBlock".
    fn in_block(&self, b: &IPBlock, a: IpAddr) -> bool {
        let Some(c) = cidr(&b.cidr) else { return false };
        c.contains(&a)
            && !b
                .except
                .iter()
                .flatten()
                .filter_map(|e| cidr(e))
                .any(|e| e.contains(&a))
    }
}

// ---------------------------------------------------------------- generators

pub const POD_V4: &[&str] = &[
    "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.1.1", "10.0.1.2", "10.1.0.1",
];
pub const POD_V6: &[&str] = &["fd00::1", "fd00::2", "fd00:1::1"];
pub const OTHER_ADDRS: &[&str] = &[
    "10.0.0.9",
    "10.0.1.9",
    "10.2.0.1",
    "203.0.113.1",
    "fd00::9",
    "2001:db8::1",
    NODE_IP,
];
pub const CIDRS: &[&str] = &[
    "10.0.0.0/8",
    "10.0.0.0/16",
    "10.0.0.0/24",
    "10.0.1.0/24",
    "10.0.0.0/30",
    "10.0.0.2/31",
    "10.0.0.1/32",
    "10.0.1.5/24",
    "0.0.0.0/0",
    "fd00::/16",
    "fd00::/64",
    "fd00::2/128",
    "::/0",
    "203.0.113.0/24",
    "10.0.0.0/33",
    "nonsense",
];
pub const KEYS: &[&str] = &["app", "tier"];
pub const VALUES: &[&str] = &["x", "y", "z"];
pub const NS_KEYS: &[&str] = &["team", "env"];
pub const PORTS: &[u16] = &[53, 80, 81, 8080, 8081];
pub const PROTOS: &[u8] = &[proto::TCP, proto::UDP, proto::SCTP, proto::ICMP];

pub fn labels(keys: &'static [&'static str]) -> impl Strategy<Value = Labels> {
    proptest::collection::btree_map(
        proptest::sample::select(keys),
        proptest::sample::select(VALUES),
        0..=2,
    )
    .prop_map(|m| {
        m.into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    })
}

fn container_port() -> impl Strategy<Value = ContainerPort> {
    (
        prop_oneof![
            Just(None),
            Just(Some("http".to_owned())),
            Just(Some("dns".to_owned()))
        ],
        proptest::sample::select(PORTS),
        prop_oneof![Just(proto::TCP), Just(proto::UDP)],
    )
        .prop_map(|(name, port, protocol)| ContainerPort {
            name: name.map(Into::into),
            port,
            protocol,
        })
}

pub fn pod() -> impl Strategy<Value = PodInfo> {
    (
        labels(KEYS),
        prop_oneof![4 => Just(Some(NODE.to_owned())), 1 => Just(Some("node-b".to_owned())), 1 => Just(None)],
        proptest::sample::subsequence(POD_V4, 0..=2),
        proptest::sample::subsequence(POD_V6, 0..=1),
        proptest::collection::vec(container_port(), 0..=2),
        prop_oneof![9 => Just(false), 1 => Just(true)],
        prop_oneof![9 => Just(false), 1 => Just(true)],
        0i64..4,
    )
        .prop_map(|(labels, node_name, v4, v6, ports, host_network, terminal, created)| {
            let mut ips: Vec<IpAddr> = v4.iter().chain(v6.iter()).map(|s| s.parse().unwrap()).collect();
            if host_network {
                ips = vec![NODE_IP.parse().unwrap()];
            }
            PodFields { labels: labels.into(), node_name: node_name.map(Into::into), ips: ips.into(), ports: ports.into(), host_network, terminal, created, uid: None }.into()
        })
}

/// Weight of invalid choices: zero in strict mode.
fn bad(strict: bool) -> u32 {
    if strict { 0 } else { 1 }
}

fn requirement(strict: bool) -> impl Strategy<Value = LabelSelectorRequirement> {
    (
        proptest::sample::select(&["app", "tier", "team", "env"][..]),
        prop_oneof![
            4 => Just("In"), 3 => Just("NotIn"), 2 => Just("Exists"), 2 => Just("DoesNotExist"), bad(strict) => Just("Bogus")
        ],
        proptest::collection::vec(proptest::sample::select(VALUES), 0..=2),
        prop_oneof![9 => Just(false), bad(strict) => Just(true)],
    )
        .prop_map(|(key, op, values, break_it)| {
            let values: Vec<String> = values.into_iter().map(str::to_owned).collect();
            let values = match (op, break_it) {
                ("In" | "NotIn", false) if values.is_empty() => Some(vec!["x".to_owned()]),
                ("Exists" | "DoesNotExist", false) => None,
                _ => Some(values),
            };
            LabelSelectorRequirement { key: key.to_owned(), operator: op.to_owned(), values }
        })
}

fn selector(keys: &'static [&'static str], strict: bool) -> impl Strategy<Value = LabelSelector> {
    (
        prop_oneof![Just(None), labels(keys).prop_map(Some)],
        prop_oneof![2 => Just(None), 1 => proptest::collection::vec(requirement(strict), 0..=2).prop_map(Some)],
    )
        .prop_map(|(match_labels, match_expressions)| LabelSelector { match_labels, match_expressions })
}

fn ip_block(strict: bool) -> impl Strategy<Value = IPBlock> {
    let cidrs = if strict {
        &CIDRS[..CIDRS.len() - 2]
    } else {
        CIDRS
    };
    (
        proptest::sample::select(cidrs),
        proptest::collection::vec(proptest::sample::select(CIDRS), 0..=2),
    )
        .prop_map(|(c, except)| {
            // Mostly keep excepts that are valid strict subsets.
            let parent = cidr(c);
            let mut ex: Vec<String> = except
                .into_iter()
                .filter(|e| {
                    parent.is_some_and(|p| {
                        cidr(e).is_some_and(|e| p.contains(&e) && e.prefix_len() > p.prefix_len())
                    })
                })
                .map(str::to_owned)
                .collect();
            if ex.is_empty() && c == "10.0.0.0/8" {
                ex.push("10.0.0.2/32".into());
            }
            IPBlock {
                cidr: c.to_owned(),
                except: if ex.is_empty() { None } else { Some(ex) },
            }
        })
}

fn peer(strict: bool) -> impl Strategy<Value = NetworkPolicyPeer> {
    prop_oneof![
        3 => selector(KEYS, strict).prop_map(|s| NetworkPolicyPeer { pod_selector: Some(s), ..Default::default() }),
        2 => selector(NS_KEYS, strict)
            .prop_map(|s| NetworkPolicyPeer { namespace_selector: Some(s), ..Default::default() }),
        2 => (selector(NS_KEYS, strict), selector(KEYS, strict)).prop_map(|(n, p)| NetworkPolicyPeer {
            namespace_selector: Some(n),
            pod_selector: Some(p),
            ..Default::default()
        }),
        3 => ip_block(strict).prop_map(|b| NetworkPolicyPeer { ip_block: Some(b), ..Default::default() }),
        bad(strict) => Just(NetworkPolicyPeer::default()),
        bad(strict) => ip_block(strict).prop_map(|b| NetworkPolicyPeer {
            ip_block: Some(b),
            pod_selector: Some(LabelSelector::default()),
            ..Default::default()
        }),
    ]
}

fn np_port(strict: bool) -> impl Strategy<Value = NetworkPolicyPort> {
    (
        prop_oneof![
            3 => Just(None), 2 => Just(Some("TCP")), 2 => Just(Some("UDP")), 1 => Just(Some("SCTP")),
            bad(strict) => Just(Some("ICMP"))
        ],
        prop_oneof![
            2 => Just(None),
            4 => proptest::sample::select(PORTS).prop_map(|p| Some(IntOrString::Int(i32::from(p)))),
            bad(strict) => Just(Some(IntOrString::Int(0))),
            3 => Just(Some(IntOrString::String("http".into()))),
            1 => Just(Some(IntOrString::String("dns".into()))),
            bad(strict) => Just(Some(IntOrString::String("Bad_Name".into()))),
        ],
        prop_oneof![
            4 => Just(None), 1 => Just(Some(0)), 1 => Just(Some(1)), bad(strict) => Just(Some(8001)),
            bad(strict) => Just(Some(-1))
        ],
    )
        .prop_map(move |(protocol, port, end)| {
            let end_port = match (&port, end) {
                (Some(IntOrString::Int(p)), Some(d)) if (0..8000).contains(&d) => Some(p + d),
                (_, Some(8001)) if !strict => Some(8081),
                (_, Some(-1)) if !strict => Some(1),
                _ => None,
            };
            NetworkPolicyPort { protocol: protocol.map(str::to_owned), port, end_port }
        })
}

fn list<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Option<Vec<T>>> {
    prop_oneof![2 => Just(None), 1 => Just(Some(Vec::new())), 4 => proptest::collection::vec(s, 1..=2).prop_map(Some)]
}

/// A random policy in one of `ns`, mostly valid (a quarter may hold
/// invalid choices).
pub fn policy(ns: &'static [&'static str]) -> impl Strategy<Value = NetworkPolicy> {
    prop_oneof![3 => policy_of(ns, true), 1 => policy_of(ns, false)]
}

/// A random policy; `strict` leaves out every invalid choice.
fn policy_of(ns: &'static [&'static str], strict: bool) -> impl Strategy<Value = NetworkPolicy> {
    (
        proptest::sample::select(ns),
        prop_oneof![1 => Just(None), 3 => selector(KEYS, strict).prop_map(Some)],
        prop_oneof![
            4 => Just(None),
            1 => Just(Some(Vec::new())),
            2 => Just(Some(vec!["Ingress".to_owned()])),
            2 => Just(Some(vec!["Egress".to_owned()])),
            2 => Just(Some(vec!["Ingress".to_owned(), "Egress".to_owned()])),
            bad(strict) => Just(Some(vec!["Sideways".to_owned()])),
        ],
        list((list(peer(strict)), list(np_port(strict)))),
        list((list(peer(strict)), list(np_port(strict)))),
        0u32..1000,
    )
        .prop_map(
            |(ns, pod_selector, policy_types, ingress, egress, n)| NetworkPolicy {
                metadata: ObjectMeta {
                    name: Some(format!("p{n}")),
                    namespace: Some(ns.to_owned()),
                    ..Default::default()
                },
                spec: Some(NetworkPolicySpec {
                    pod_selector,
                    policy_types,
                    ingress: ingress.map(|v| {
                        v.into_iter()
                            .map(|(from, ports)| NetworkPolicyIngressRule { from, ports })
                            .collect()
                    }),
                    egress: egress.map(|v| {
                        v.into_iter()
                            .map(|(to, ports)| NetworkPolicyEgressRule { to, ports })
                            .collect()
                    }),
                }),
            },
        )
}

pub const NAMESPACES: &[&str] = &["ns0", "ns1", "ns2"];

/// A random small cluster on node "node-a" (192.168.0.1).
pub fn cluster() -> impl Strategy<Value = ClusterState> {
    (
        proptest::collection::vec(labels(NS_KEYS), NAMESPACES.len()),
        proptest::collection::vec((proptest::sample::select(NAMESPACES), pod()), 1..=7),
        proptest::collection::vec(policy(NAMESPACES), 0..=4),
    )
        .prop_map(|(ns_labels, pods, policies)| {
            let mut s = ClusterState {
                node_name: NODE.into(),
                node_ips: vec![NODE_IP.parse().unwrap()],
                ..Default::default()
            };
            for (name, mut l) in NAMESPACES.iter().zip(ns_labels) {
                l.insert("kubernetes.io/metadata.name".into(), (*name).into());
                s.namespaces
                    .insert((*name).into(), NamespaceInfo { labels: l });
            }
            for (i, (ns, p)) in pods.into_iter().enumerate() {
                s.pods.insert(ObjectRef::new(ns, format!("pod{i}")), p);
            }
            for (i, mut np) in policies.into_iter().enumerate() {
                let ns = np.metadata.namespace.clone().unwrap_or_default();
                let name = format!("policy{i}");
                np.metadata.name = Some(name.clone());
                s.policies.insert(ObjectRef::new(ns, name), np.into());
            }
            s
        })
}

/// Every address worth probing in `s`.
pub fn addresses(s: &ClusterState) -> Vec<IpAddr> {
    let mut all: BTreeSet<IpAddr> = OTHER_ADDRS.iter().map(|a| a.parse().unwrap()).collect();
    for p in s.pods.values() {
        all.extend(p.ips.iter().copied());
    }
    all.into_iter().collect()
}
