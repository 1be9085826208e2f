//! What the control-plane bench enforces: namespaces of pods with a few
//! labels and named ports, and policies of five shapes over them, seeded.
use std::{fmt::Write as _, net::IpAddr};

use rand::{Rng, rngs::StdRng};
use serde_json::Value;

pub const NAMESPACES: usize = 100;
pub const PODS_PER_NS: usize = 100;
pub const POLICIES_PER_NS: usize = 10;
pub const LOCAL: usize = 50;

pub fn pod_ip(ns: usize, i: usize) -> IpAddr {
    let n = (ns * PODS_PER_NS + i) as u32;
    if n < LOCAL as u32 {
        IpAddr::from([10, 244, 0, 10 + n as u8])
    } else {
        IpAddr::V4(std::net::Ipv4Addr::from(0x0a64_0000u32 + n))
    }
}

pub fn namespace_file(ns: usize, relabel: Option<usize>) -> String {
    let mut out = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: ns{ns:03}, labels: {{team: t{}, env: {}}}}}\n",
        ns % 10,
        if ns.is_multiple_of(3) { "prod" } else { "dev" }
    );
    for i in 0..PODS_PER_NS {
        let node = if ns * PODS_PER_NS + i < LOCAL {
            "node-1".to_owned()
        } else {
            format!("node-{}", 2 + (ns * PODS_PER_NS + i) % 19)
        };
        let app = if relabel == Some(i) {
            "relabelled".to_owned()
        } else {
            format!("app{}", i % 10)
        };
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p{i:03}, namespace: ns{ns:03}, labels: {{app: {app}, tier: {}, version: v{}}}}}\nspec: {{nodeName: {node}, containers: [{{name: c, image: x, ports: [{{name: http, containerPort: {}}}, {{name: metrics, containerPort: 9100}}]}}]}}\nstatus: {{phase: Running, podIPs: [{{ip: {}}}]}}\n",
            if i.is_multiple_of(3) { "front" } else { "back" },
            i % 2,
            if i.is_multiple_of(2) { 80 } else { 8080 },
            pod_ip(ns, i)
        );
    }
    out
}

pub fn policy_file(ns: usize, rng: &mut StdRng) -> String {
    let mut out = String::new();
    for k in 0..POLICIES_PER_NS {
        let target = rng.random_range(0..10);
        let peer = rng.random_range(0..10);
        let spec = match k % 5 {
            0 => format!(
                "podSelector: {{matchLabels: {{app: app{target}}}}}\n  ingress:\n    - from: [{{podSelector: {{matchLabels: {{app: app{peer}}}}}}}]\n      ports: [{{port: http}}]"
            ),
            1 => format!(
                "podSelector: {{matchLabels: {{app: app{target}}}}}\n  ingress:\n    - from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}, podSelector: {{matchLabels: {{tier: front}}}}}}]\n      ports: [{{port: 8000, endPort: 8100}}]",
                peer
            ),
            2 => format!(
                "podSelector: {{matchExpressions: [{{key: app, operator: In, values: [app{target}, app{peer}]}}]}}\n  ingress:\n    - from: [{{ipBlock: {{cidr: 10.100.0.0/16, except: [10.100.{}.0/24]}}}}]",
                rng.random_range(0..40)
            ),
            3 => format!(
                "podSelector: {{matchLabels: {{app: app{target}}}}}\n  policyTypes: [Egress]\n  egress:\n    - to: [{{namespaceSelector: {{matchLabels: {{env: prod}}}}}}]\n      ports: [{{port: metrics}}, {{protocol: UDP, port: 53}}]"
            ),
            _ => format!(
                "podSelector: {{matchLabels: {{tier: back}}}}\n  ingress:\n    - from: [{{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: app{peer}}}}}}}]"
            ),
        };
        let _ = write!(
            out,
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: pol{k:02}, namespace: ns{ns:03}}}\nspec:\n  {spec}\n"
        );
    }
    out
}

/// The API objects of manifest text (one per YAML document), for the
/// fake API server.
pub fn objects(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| {
            <serde_yaml::Value as serde::Deserialize>::deserialize(doc)
                .expect("the bench's own YAML")
        })
        .map(|v| serde_json::to_value(v).expect("YAML the bench wrote is JSON too"))
        .collect()
}
