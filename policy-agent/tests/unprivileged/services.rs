//! Service frontends as the compiler writes them (`SERVICES`) from input
//! kube-proxy reads but a strict parser would not: an address with
//! leading zeros is the frontend kube-proxy makes of it, and one field
//! that does not read costs only that field, never the Service's other
//! frontends.
use std::path::PathBuf;

use ipnet::IpNet;
use policy_agent::{
    cluster::{ClusterState, Subject},
    identity::IdentityAllocator,
    policy::{CompileOptions, Compiler},
    source::manifests::load_dir,
};

/// A scratch directory of manifests, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn with(name: &str, yaml: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "policy-agent-services-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cluster.yaml"), yaml).unwrap();
        Self(dir)
    }

    /// The manifests as the agent's manifest source reads them.
    fn state(&self) -> ClusterState {
        load_dir(&self.0).cluster_state("n1", Vec::new())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn compile(state: &ClusterState) -> Compiler {
    Compiler::build(
        state,
        &mut IdentityAllocator::new(),
        CompileOptions::default(),
    )
}

fn frontends(c: &Compiler) -> Vec<String> {
    c.maps().services.keys().map(IpNet::to_string).collect()
}

fn service(name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {spec}\n"
    )
}

/// The API server accepted IPv4 addresses with leading zeros for years,
/// and kube-proxy (`ParseIPSloppy`) reads them in decimal: `010.096.000.050`
/// is 10.96.0.50 to it, so it is the frontend here too. Read strictly, the
/// whole Service was left out, and its ClusterIP judged at the client as
/// an ordinary address (an ipBlock covering it reached the backends
/// unjudged).
#[test]
fn a_cluster_ip_with_leading_zeros_is_the_frontend_kube_proxy_makes_of_it() {
    let dir = Scratch::with(
        "zeros",
        &service(
            "web",
            "{clusterIP: 010.096.000.050, clusterIPs: [010.096.000.050], ports: [{port: 80}]}",
        ),
    );
    let c = compile(&dir.state());
    assert_eq!(frontends(&c), ["10.96.0.50/32"]);
    assert!(c.problems().is_empty(), "{:?}", c.problems());
}

/// One field that does not read (an external IP, a port, the IPv4
/// ClusterIP itself) is reported on that field; every other frontend of
/// the Service stays a frontend.
#[test]
fn one_unreadable_field_keeps_the_rest_of_the_service() {
    let dir = Scratch::with(
        "partial",
        &format!(
            "{}{}",
            service(
                "web",
                "{clusterIPs: [10.96.0.50], externalIPs: [203.0.113.7, not-an-ip], ports: [{port: 80}, {port: 70000}]}",
            ),
            service(
                "dual",
                "{clusterIPs: [10.96.0.500, \"fd00:96::60\"], externalIPs: [203.0.113.8], ports: [{port: 80}]}",
            ),
        ),
    );
    let c = compile(&dir.state());
    assert_eq!(
        frontends(&c),
        [
            "10.96.0.50/32",
            "203.0.113.7/32",
            "203.0.113.8/32",
            "fd00:96::60/128"
        ]
    );
    let fields: Vec<String> = c
        .problems()
        .iter()
        .filter_map(|p| match &p.subject {
            Subject::Field { name, field, .. } => Some(format!("{name} {field}")),
            _ => None,
        })
        .collect();
    assert_eq!(
        fields,
        [
            "shop/dual spec.clusterIPs[0]",
            "shop/web spec.ports[1].port",
            "shop/web spec.externalIPs[1]",
        ]
    );
}
