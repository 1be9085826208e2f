//! Service frontends as the compiler writes them (`SERVICES`): from input
//! kube-proxy reads but a strict parser would not (an address with
//! leading zeros is the frontend kube-proxy makes of it, and one field
//! that does not read costs only that field, never the Service's other
//! frontends), and the Service ranges as a change of the cluster model.
use std::path::PathBuf;

use ipnet::IpNet;
use policy_agent::{
    cluster::{Change, ClusterState, Subject, changes_between},
    identity::IdentityAllocator,
    mapstate::MapOp,
    policy::{CompileOptions, Compiler},
    source::manifests::load_dir,
};
use policy_common::service::SERVICE_RANGE;

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

/// The Service ranges are part of the cluster model: each is one
/// frontend beside the addresses in it (`SERVICE_RANGE`), and a change of
/// them while the agent runs is a change like any other, written as the
/// few ops it takes.
#[test]
fn the_service_ranges_are_frontends_and_change_at_run_time() {
    let dir = Scratch::with(
        "ranges",
        &service("web", "{clusterIPs: [10.96.0.50], ports: [{port: 80}]}"),
    );
    let mut state = dir.state();
    state.service_ranges = vec!["10.96.0.0/12".parse().unwrap()];
    let mut ids = IdentityAllocator::new();
    let mut c = Compiler::new(CompileOptions::default());
    c.apply(changes_between(&ClusterState::default(), &state), &mut ids);
    let flags = |c: &Compiler| -> Vec<(String, bool)> {
        c.maps()
            .services
            .iter()
            .map(|(n, e)| (n.to_string(), e.flags & SERVICE_RANGE != 0))
            .collect()
    };
    assert_eq!(
        flags(&c),
        [
            ("10.96.0.0/12".into(), true),
            ("10.96.0.50/32".into(), false)
        ]
    );
    let ranges: Vec<IpNet> = vec![
        "10.96.0.0/16".parse().unwrap(),
        "fd00:96::/108".parse().unwrap(),
    ];
    let ops = c.apply([Change::ServiceRanges(ranges.clone())], &mut ids);
    let touched: Vec<String> = ops
        .iter()
        .map(|op| match op {
            MapOp::UpsertService(n, _) => format!("+{n}"),
            MapOp::DeleteService(n) => format!("-{n}"),
            other => panic!("only frontends change: {other:?}"),
        })
        .collect();
    assert_eq!(
        touched,
        ["+10.96.0.0/16", "+fd00:96::/108", "-10.96.0.0/12"]
    );
    state.service_ranges = ranges;
    let full = compile(&state);
    assert_eq!(
        c.maps().services,
        full.maps().services,
        "same as a full compile"
    );
}
