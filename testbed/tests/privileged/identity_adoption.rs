//! Identity numbers across a restart, on pinned maps and real traffic
//! (needs root): a number whose name a full map dropped from
//! `IDENTITY_NAMES` but a `POLICY` row still keys is never handed to a new
//! identity. Its row survives until the policy removals of the first sync
//! (write order step 6), after the new identity's ipcache entries (step 5).

use std::{net::SocketAddr, time::Duration};

use ipnet::IpNet;
use policy_agent::{
    cluster::{ClusterState, changes_between},
    datapath::bpf::maps::BpfMaps,
    mapstate::MapOp,
    policy::{CompileOptions, Compiler},
    source::manifests::load_dir,
};
use policy_testbed::{
    connectivity::connect,
    fixtures::{
        conformance::{Backend, Conformance, NODE},
        deadline::scaled,
    },
};

/// beta/db admits beta/web only.
const POLICY: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: beta}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n";

fn opens(c: &Conformance, from: &str, to: &str) -> bool {
    let from = c.node().pod(from).unwrap();
    let to = c.pods.iter().find(|p| p.id() == to).unwrap();
    let addr = SocketAddr::new(to.ips[0], 80);
    connect(&from.netns, addr, scaled(Duration::from_millis(1000))).is_ok()
}

fn identity_of(maps: &BpfMaps, c: &Conformance, pod: &str) -> u32 {
    let ip = c.pods.iter().find(|p| p.id() == pod).unwrap().ips[0];
    maps.read_state().unwrap().ipcache[&IpNet::from(ip)].identity
}

#[test]
fn a_number_still_keyed_in_policy_is_not_reused_after_a_restart() {
    let mut c = Conformance::new("idadopt", Backend::Bpf);
    c.write_policies(POLICY);
    c.apply_ok();
    assert!(opens(&c, "beta/web", "beta/db"));
    assert!(!opens(&c, "beta/api", "beta/db"));

    // The pins as a full map leaves them: web's name is gone, the row
    // admitting web into db stays.
    let mut maps = BpfMaps::from_pins(&c.layout).unwrap();
    let web = identity_of(&maps, &c, "beta/web");
    let db = identity_of(&maps, &c, "beta/db");
    let rows = |maps: &BpfMaps, peer: u32| {
        maps.read_state()
            .unwrap()
            .policy
            .keys()
            .filter(|k| k.endpoint_identity == db && k.peer_identity == peer)
            .count()
    };
    assert_eq!(rows(&maps, web), 1, "db admits web");
    maps.apply(&[MapOp::DeleteIdentity(web)]).unwrap();

    // The restarted agent finds web gone and api relabelled (a new key).
    c.pods.retain(|p| p.id() != "beta/web");
    c.pod_mut("beta/api")
        .labels
        .insert("app".into(), "api2".into());
    c.write_cluster();
    let mut ids = policy_agent::datapath::bpf::maps::adopt_from(&maps.read_state().unwrap());
    let node_ips = c
        .node()
        .node
        .spawn(policy_agent::netlink::local_addresses)
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
        .unwrap();
    let state = load_dir(&c.dir).cluster_state(NODE, node_ips);
    let mut compiler = Compiler::new(CompileOptions::default());
    let ops = compiler.apply(changes_between(&ClusterState::default(), &state), &mut ids);
    let api_ip = c.pods.iter().find(|p| p.id() == "beta/api").unwrap().ips[0];
    let api = compiler.maps().ipcache[&IpNet::from(api_ip)].identity;
    eprintln!("web had {web}; api2 gets {api}");

    // What that sync writes before it removes stale policy rows: names,
    // new allows, ipcache entries (endpoints aside: db's is unchanged).
    let before_removals: Vec<MapOp<u32>> = ops
        .into_iter()
        .filter_map(|op| match op {
            MapOp::UpsertIdentity(id, name) => Some(MapOp::UpsertIdentity(id, name)),
            MapOp::UpsertPolicy(k, v) => Some(MapOp::UpsertPolicy(k, v)),
            MapOp::UpsertIpcache(net, e) => Some(MapOp::UpsertIpcache(net, e)),
            _ => None,
        })
        .collect();
    maps.apply(&before_removals).unwrap();
    let inherited = rows(&maps, api);
    let open = opens(&c, "beta/api", "beta/db");
    assert!(
        api != web && inherited == 0 && !open,
        "api2 got {api} (web had {web}): {inherited} stale row(s) of db admit it; beta/api -> beta/db {}",
        if open { "open" } else { "blocked" }
    );
}
