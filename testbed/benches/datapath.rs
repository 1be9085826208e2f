//! Per-packet cost of the classifier via BPF_PROG_TEST_RUN, as the number
//! of policy entries grows (10 → 10,000) with 10,000 ipcache entries
//! loaded. Needs root. `cargo bench -p policy-testbed --bench datapath`
//!
//! Three paths: an established flow (a conntrack hit); a new flow denied
//! with the typical shape (every entry of the endpoint TCP one-port, one
//! of them an ipBlock's, so two probes: the peer's label identity and its
//! class; an endpoint whose entries name no class skips the second); and a new flow
//! denied with the worst shape the agent writes: every lookup bit set
//! (every port-prefix length the agent writes, `PORT_PREFIX_LENGTHS`,
//! any-protocol, any-peer: port blocks of every such length, as endPort
//! ranges compile to), and a peer whose label identity and ipBlock class
//! both have no entry, so all 3 × 8 = 24 probes run and miss. The probe
//! counts are taken from the model (`policy_common::model`) and printed.
//! Beside it, in the same rounds, the worst shape the classifier can take
//! at all (all 17 lengths: 54 probes, what the agent wrote before ranges
//! were split into the lengths it probes) and the worst of strides of 4
//! bits (five lengths, 18 probes; `every_length`).
//!
//! Then flow records: a denied new flow with records off, on and read,
//! on with the ring full, and on with the budget spent (`records`); what
//! a staged policy costs an endpoint it touches (`staged`); and the paths
//! the table leaves out, with the catch-all on: the reply direction, an
//! allowed new flow, a revision bump (`paths`).
//!
//! With `POLICY_AGENT_BENCH_BASE_OBJECT`, the main table's paths for
//! another build of the object beside this one (`against_base`).
//!
//! Then ClusterNetworkPolicy: 100 of them in both tiers over 10,000 pods,
//! compiled, beside the NetworkPolicy state of 10,000 entries, a denied new
//! flow and an established one each (`tiers`).
//!
//! The kernel runs the program `REPEAT` times per call and reports the
//! mean; each figure is the median of `ROUNDS` calls. Every ratio is the
//! median of per-round ratios against the one-lookup floor measured in the
//! same round, so drift of the machine cancels. Printed figures, not
//! pass/fail.
//!
//! `POLICY_AGENT_BENCH_REPEAT` and `POLICY_AGENT_BENCH_ROUNDS` override
//! `REPEAT` and `ROUNDS`, and `POLICY_AGENT_BENCH_OUT` the JSON's path:
//! `cargo xtask bench --only datapath-guest` runs this binary inside the
//! emulated 6.1 guest (far slower, its target directory read-only there).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "datapath/against_base.rs"]
mod against_base;
#[path = "datapath/every_length.rs"]
mod every_length;
#[path = "datapath/paths.rs"]
mod paths;
#[path = "datapath/records.rs"]
mod records;
#[path = "datapath/staged.rs"]
mod staged;

use std::net::{IpAddr, Ipv4Addr};

use aya::programs::{TestRun as _, TestRunOptions};
use ipnet::IpNet;
use policy_agent::{
    datapath::bpf::{pins::Hook, unpinned::Unpinned},
    mapstate::{MapState, diff},
};
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED, EndpointInfo, lookups},
    identity::{ANY, FIRST_CIDR, FIRST_LABEL, WORLD},
    ipcache::IpcacheEntry,
    model::Maps,
    policy::{PORT_PREFIX_LENGTHS, PolicyEntry, PolicyKey},
    proto,
};
use policy_testbed::packet::{Packet, TCP_ACK, TCP_SYN};
use rand::{Rng, SeedableRng, rngs::StdRng};

const REPEAT: u32 = 200_000;
const ROUNDS: usize = 7;
const IPCACHE_ENTRIES: u32 = 10_000;
const ME: u32 = FIRST_LABEL;

/// 10,000 pod /32s, `policies` entries spread over 500 endpoint identities
/// (ours among them), seeded.
fn state(policies: usize) -> MapState<u32> {
    let mut rng = StdRng::seed_from_u64(7);
    let mut s = MapState::default();
    s.endpoints.insert(
        1,
        EndpointInfo {
            identity: ME,
            flags: ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED,
            revision: 1,
            ..Default::default()
        }
        .with_addresses(&[IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200))]),
    );
    for i in 0..IPCACHE_ENTRIES {
        let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000u32 + i + 1));
        s.ipcache.insert(
            IpNet::new(ip, 32).unwrap(),
            IpcacheEntry {
                identity: FIRST_LABEL + 1 + (i % 2000),
                cidr_identity: WORLD,
            },
        );
    }
    // Our own allow: 10.0.0.1 (identity FIRST_LABEL + 1) on TCP 80.
    s.policy.insert(
        PolicyKey::new(ME, direction::INGRESS, FIRST_LABEL + 1, proto::TCP, 16, 80),
        PolicyEntry::default(),
    );
    // And an ipBlock allow on another port, so the address class is
    // probed too (an endpoint without one skips that probe).
    s.policy.insert(
        PolicyKey::new(ME, direction::INGRESS, FIRST_CIDR, proto::TCP, 16, 443),
        PolicyEntry::default(),
    );
    while s.policy.len() < policies {
        let ep = FIRST_LABEL + rng.random_range(0..500);
        let peer = FIRST_LABEL + 1 + rng.random_range(0..2000);
        let port = rng.random_range(1..65535);
        s.policy.insert(
            PolicyKey::new(ep, direction::INGRESS, peer, proto::TCP, 16, port),
            PolicyEntry::default(),
        );
    }
    s.finalize();
    s
}

/// The worst peer: a label identity and an ipBlock class, neither of
/// which the endpoint has entries for.
fn worst_peer() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 200, 0, 7))
}

/// `state(policies)` with our endpoint's entries replaced by the worst
/// lookup shape the agent writes: a block of every port-prefix length it
/// writes, an any-protocol entry (all for the allowed peer), and an
/// any-peer entry on UDP 53, so every lookup bit it can set is set and
/// none of them matches the worst peer's TCP 80.
fn worst_state(policies: usize) -> MapState<u32> {
    worst_state_of(policies, &PORT_PREFIX_LENGTHS)
}

/// [`worst_state`] with port blocks of `lengths`.
fn worst_state_of(policies: usize, lengths: &[u8]) -> MapState<u32> {
    let mut s = state(policies);
    s.policy.retain(|k, _| k.endpoint_identity != ME);
    let allowed = FIRST_LABEL + 1;
    for &len in lengths {
        // A block of 2^(16-len) ports above 32768 (len 0: every TCP port).
        let port = if len == 0 { 0 } else { 0x8000 };
        s.policy.insert(
            PolicyKey::new(ME, direction::INGRESS, allowed, proto::TCP, len, port),
            PolicyEntry::default(),
        );
    }
    s.policy.insert(
        PolicyKey::new(ME, direction::INGRESS, allowed, proto::ANY, 0, 0),
        PolicyEntry::default(),
    );
    s.policy.insert(
        PolicyKey::new(ME, direction::INGRESS, ANY, proto::UDP, 16, 53),
        PolicyEntry::default(),
    );
    // A class other than the worst peer's: the class probe runs and misses.
    s.policy.insert(
        PolicyKey::new(ME, direction::INGRESS, FIRST_CIDR + 6, proto::UDP, 16, 53),
        PolicyEntry::default(),
    );
    s.ipcache.insert(
        IpNet::new(worst_peer(), 32).unwrap(),
        IpcacheEntry {
            identity: FIRST_LABEL + 2001,
            cidr_identity: FIRST_CIDR + 5,
        },
    );
    s.finalize();
    s
}

/// How many policy probes the model makes for a new TCP flow from `peer`
/// to our endpoint's port `port`, and its verdict.
fn probes(s: &MapState<u32>, peer: IpAddr, port: u16) -> (usize, policy_common::verdict::Reason) {
    let m = s.to_model(|k| *k);
    let ep = m.endpoints[&1];
    let entry = m.ipcache_lookup(peer);
    let n = Maps::peers_to_probe(&ep, direction::INGRESS, entry)
        .into_iter()
        .map(|id| Maps::probes_for_peer(&ep, direction::INGRESS, id, proto::TCP, port).len())
        .sum();
    (
        n,
        m.judge(&ep, direction::INGRESS, peer, proto::TCP, port)
            .reason,
    )
}

/// `name` from the environment, else `default`.
fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run_once(prog: &mut aya::programs::SchedClassifier, frame: &[u8], repeat: u32) -> f64 {
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::default()
        })
        .unwrap();
    r.duration.as_nanos() as f64
}

/// The median per-run time of `frames`, each run once (one call each).
fn once_each(prog: &mut aya::programs::SchedClassifier, frames: &[Vec<u8>]) -> f64 {
    median(frames.iter().map(|f| run_once(prog, f, 1)).collect())
}

/// Empties a record ring; how many records it held.
fn drain_ring(ring: &mut aya::maps::RingBuf<aya::maps::MapData>) -> usize {
    let mut n = 0;
    while ring.next().is_some() {
        n += 1;
    }
    n
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let repeat: u32 = setting("POLICY_AGENT_BENCH_REPEAT", REPEAT);
    let rounds: usize = setting("POLICY_AGENT_BENCH_ROUNDS", ROUNDS).max(1);
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3));
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200));
    let allowed_peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    // Denied: every probe misses, the longest path a new flow takes.
    let new_denied = Packet::tcp(peer, 40000, pod, 80, TCP_SYN).frame();
    // Established: an ACK of a flow whose SYN opened a conntrack entry (a
    // segment without SYN opens none), so every run is a conntrack hit.
    let opening = Packet::tcp(allowed_peer, 40001, pod, 80, TCP_SYN).frame();
    let established = Packet::tcp(allowed_peer, 40001, pod, 80, TCP_ACK).frame();
    // Denied with the worst lookup shape: 24 probes, all missing.
    let new_worst = Packet::tcp(worst_peer(), 40002, pod, 80, TCP_SYN).frame();
    // The floors, loaded the same way, with the same maps behind them.
    let mut floors = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
    let (typical_probes, typical_verdict) = probes(&state(10), peer, 80);
    let (worst_probes, worst_verdict) = probes(&worst_state(10), worst_peer(), 80);
    let worst_bits = worst_state(10).endpoints[&1].lookups(direction::INGRESS);
    let given = PORT_PREFIX_LENGTHS
        .iter()
        .fold(0, |bits, &len| bits | lookups::port_prefix(len));
    assert_eq!(
        worst_bits,
        given | lookups::ANY_PROTOCOL | lookups::ANY_PEER | lookups::CLASS_PEER,
        "every lookup bit the agent sets"
    );
    assert_eq!((typical_probes, worst_probes), (2, 24));
    for v in [typical_verdict, worst_verdict] {
        assert_eq!(v, policy_common::verdict::Reason::DropPolicy);
    }
    println!(
        "new flows denied: typical shape {typical_probes} probes, worst shape {worst_probes} probes (all lookup bits set, label identity and class both without entries)"
    );
    println!(
        "policy entries | new flow, typical miss ns/pkt | new flow, worst shape ns/pkt | established ns/pkt"
    );
    let mut base: Option<(f64, f64, f64)> = None;
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let (mut all_empty, mut all_floor) = (Vec::new(), Vec::new());
    for policies in [10usize, 100, 1_000, 10_000] {
        let mut dp = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
        let s = state(policies);
        let old = dp.maps.read_state().unwrap();
        dp.maps.apply(&diff(&old, &s)).unwrap();
        let mut worst = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
        let w = worst_state(policies);
        let old = worst.maps.read_state().unwrap();
        worst.maps.apply(&diff(&old, &w)).unwrap();
        // The worst packet is dropped (every probe missed).
        let r = worst
            .program(Hook::Egress)
            .unwrap()
            .test_run(TestRunOptions {
                data_in: Some(&new_worst),
                ..TestRunOptions::default()
            })
            .unwrap();
        assert_eq!(r.return_value, 2, "the worst-shape packet is dropped");
        let r = dp
            .program(Hook::Egress)
            .unwrap()
            .test_run(TestRunOptions {
                data_in: Some(&opening),
                ..TestRunOptions::default()
            })
            .unwrap();
        assert_ne!(r.return_value, 2, "the established flow's SYN is allowed");
        // Each round measures the floors and both paths back to back, and
        // ratios are taken within a round: a shared VM drifts by 20% and
        // more between minutes, far less between neighbouring calls.
        let (mut new, mut est, mut floor, mut wst) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut new_r, mut est_r, mut wst_r) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let e = run_once(
                floors.extra_program("floor_empty").unwrap(),
                &established,
                repeat,
            );
            let f = run_once(
                floors.extra_program("floor_one_lookup").unwrap(),
                &established,
                repeat,
            );
            let n = run_once(dp.program(Hook::Egress).unwrap(), &new_denied, repeat);
            let x = run_once(dp.program(Hook::Egress).unwrap(), &established, repeat);
            let wc = run_once(worst.program(Hook::Egress).unwrap(), &new_worst, repeat);
            wst.push(wc);
            wst_r.push(wc / f);
            all_empty.push(e);
            all_floor.push(f);
            floor.push(f);
            new.push(n);
            est.push(x);
            new_r.push(n / f);
            est_r.push(x / f);
        }
        let (new, est, floor, wst) = (median(new), median(est), median(floor), median(wst));
        let (new_r, est_r, wst_r) = (median(new_r), median(est_r), median(wst_r));
        let (b_new, b_est, b_wst) = *base.get_or_insert((new_r, est_r, wst_r));
        println!(
            "{policies:>14} | {new:>8.1} ({:.2}x) | {wst:>8.1} ({:.2}x) | {est:>8.1} ({:.2}x, {est_r:.2}x the one-lookup floor of {floor:.0} ns)",
            new_r / b_new,
            wst_r / b_wst,
            est_r / b_est,
        );
        rows.push(serde_json::json!({
            "policies": policies, "new_flow_ns": new, "established_ns": est,
            "new_flow_worst_ns": wst,
            "floor_one_lookup_ns": floor,
            "new_flow_ratio_to_10": new_r / b_new, "established_ratio_to_10": est_r / b_est,
            "new_flow_worst_ratio_to_10": wst_r / b_wst,
            "established_over_floor": est_r, "new_flow_worst_over_floor": wst_r,
            "new_flow_over_floor": new_r,
        }));
    }
    let (empty, one_lookup) = (median(all_empty), median(all_floor));
    println!(
        "floor: empty program {empty:.1} ns/pkt; parse + one hash lookup {one_lookup:.1} ns/pkt"
    );
    let tiers = tiers(&mut floors, repeat, rounds);
    let records = records::records(
        &mut floors,
        (&new_denied, &new_worst),
        &established,
        repeat,
        rounds,
    );
    let base = against_base::against_base(
        &state(1_000),
        &worst_state(1_000),
        &against_base::Frames {
            opening: &opening,
            established: &established,
            reply: &Packet::tcp(pod, 80, allowed_peer, 40001, TCP_ACK).frame(),
            new_denied: &new_denied,
            new_worst: &new_worst,
        },
        repeat,
        rounds,
    );
    let every_length = every_length::every_length(&mut floors, &new_worst, repeat, rounds);
    let staged = staged::staged(&mut floors, repeat, rounds);
    let paths = paths::paths(&mut floors, repeat, rounds);
    let json = serde_json::json!({
        "ipcache_entries": IPCACHE_ENTRIES, "repeat": repeat, "rounds": rounds,
        "typical_probes": typical_probes, "worst_probes": worst_probes,
        "floor_empty_ns": empty, "floor_one_lookup_ns": one_lookup, "rows": rows,
        "tiers": tiers, "records": records, "staged": staged, "paths": paths,
        "against_base": base, "every_length": every_length,
    });
    let out = std::env::var_os("POLICY_AGENT_BENCH_OUT").map_or_else(
        || {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/bench-results/datapath.json")
        },
        std::path::PathBuf::from,
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(&out, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// 10,000 pods in 100 namespaces (teams t0-t9) on other nodes, ours
/// (`ns0/me`, 10.0.0.200) on this one, and `cnps` ClusterNetworkPolicies
/// on team t0, half Admin and half Baseline, each with three ingress and
/// two egress rules of every kind of peer and port.
fn tier_cluster(cnps: usize) -> policy_agent::cluster::ClusterState {
    use policy_agent::cluster::{ClusterState, NamespaceInfo, ObjectRef, PodFields};
    let mut s = ClusterState {
        node_name: "node-a".into(),
        node_ips: vec![IpAddr::V4(Ipv4Addr::new(192, 168, 0, 1))],
        ..Default::default()
    };
    for n in 0..100 {
        let name = format!("ns{n}");
        s.namespaces.insert(
            name.clone(),
            NamespaceInfo {
                labels: [
                    ("kubernetes.io/metadata.name".to_owned(), name),
                    ("team".to_owned(), format!("t{}", n % 10)),
                ]
                .into(),
            },
        );
    }
    for i in 0..10_000u32 {
        s.pods.insert(
            ObjectRef::new(format!("ns{}", i % 100), format!("p{i}")),
            PodFields {
                labels: policy_agent::cluster::pod_labels(
                    [("app".to_owned(), format!("a{}", i % 20))].into(),
                ),
                node_name: Some("node-b".into()),
                ips: vec![IpAddr::V4(Ipv4Addr::from(0x0a01_0000u32 + i))].into(),
                ..Default::default()
            }
            .into(),
        );
    }
    s.pods.insert(
        ObjectRef::new("ns0", "me"),
        PodFields {
            labels: policy_agent::cluster::pod_labels([("app".to_owned(), "me".to_owned())].into()),
            node_name: Some("node-a".into()),
            ips: vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200))].into(),
            ..Default::default()
        }
        .into(),
    );
    let cnps = policy_testbed::fixtures::tier_load::cluster_policies(
        cnps,
        |i| format!("t{i}"),
        |i| format!("a{i}"),
    );
    s.cluster_policies
        .extend(cnps.into_iter().map(|(name, cnp)| (name, cnp.into())));
    s
}

/// The tier layer's cost per packet: ours with 100 ClusterNetworkPolicies
/// of both tiers over 10,000 pods, compiled, against the NetworkPolicy
/// state of `state(10_000)` measured in the same rounds. Every figure is
/// taken over the one-lookup floor of its round.
fn tiers(floors: &mut Unpinned, repeat: u32, rounds: usize) -> serde_json::Value {
    use policy_agent::{cluster::ObjectRef, identity::IdentityAllocator, policy};
    let me = ObjectRef::new("ns0", "me");
    let t = std::time::Instant::now();
    let compiled = policy::compile(&tier_cluster(100), &mut IdentityAllocator::new());
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    let mut s = compiled.maps.rekey(|p| (p == &me).then_some(1u32));
    s.finalize();
    let tier_keys = s.policy.len();
    let mut dp = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
    let old = dp.maps.read_state().unwrap();
    dp.maps.apply(&diff(&old, &s)).unwrap();
    let mut np = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
    let old = np.maps.read_state().unwrap();
    np.maps.apply(&diff(&old, &state(10_000))).unwrap();
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200));
    // p1 is in ns1 (team t1): cnp0's Admin Deny on TCP 8000 stops it.
    let denied_peer = IpAddr::V4(Ipv4Addr::from(0x0a01_0001u32));
    let tier_denied = Packet::tcp(denied_peer, 40000, pod, 8000, TCP_SYN).frame();
    // p5 (ns5, team t5, app a5) meets only Baseline Passes: the default.
    let open_peer = IpAddr::V4(Ipv4Addr::from(0x0a01_0005u32));
    let tier_opening = Packet::tcp(open_peer, 40001, pod, 80, TCP_SYN).frame();
    let tier_established = Packet::tcp(open_peer, 40001, pod, 80, TCP_ACK).frame();
    let np_denied = Packet::tcp(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3)),
        40000,
        pod,
        80,
        TCP_SYN,
    )
    .frame();
    let np_opening = Packet::tcp(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
        40001,
        pod,
        80,
        TCP_SYN,
    )
    .frame();
    let np_established = Packet::tcp(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
        40001,
        pod,
        80,
        TCP_ACK,
    )
    .frame();
    let verdict = |d: &mut Unpinned, frame: &[u8]| {
        d.program(Hook::Egress)
            .unwrap()
            .test_run(TestRunOptions {
                data_in: Some(frame),
                ..TestRunOptions::default()
            })
            .unwrap()
            .return_value
    };
    assert_eq!(verdict(&mut dp, &tier_denied), 2, "the Admin Deny drops it");
    assert_ne!(verdict(&mut dp, &tier_opening), 2, "the default admits it");
    assert_ne!(
        verdict(&mut np, &np_opening),
        2,
        "the NetworkPolicy admits it"
    );
    let mut r: [Vec<f64>; 5] = Default::default();
    for _ in 0..rounds {
        let f = run_once(
            floors.extra_program("floor_one_lookup").unwrap(),
            &np_established,
            repeat,
        );
        let prog = |d: &mut Unpinned, frame: &[u8]| {
            run_once(d.program(Hook::Egress).unwrap(), frame, repeat) / f
        };
        r[0].push(prog(&mut np, &np_denied));
        r[1].push(prog(&mut dp, &tier_denied));
        r[2].push(prog(&mut np, &np_established));
        r[3].push(prog(&mut dp, &tier_established));
        r[4].push(f);
    }
    let [np_new, tier_new, np_est, tier_est, floor] = r.map(median);
    println!(
        "tiers: 100 ClusterNetworkPolicies over 10,000 pods ({tier_keys} policy entries, compiled in {compile_ms:.0} ms): new flow denied {tier_new:.2}x the floor (NetworkPolicy {np_new:.2}x), established {tier_est:.2}x (NetworkPolicy {np_est:.2}x); floor {floor:.0} ns"
    );
    serde_json::json!({
        "cluster_policies": 100, "pods": 10_000, "policy_entries": tier_keys,
        "compile_ms": compile_ms, "floor_one_lookup_ns": floor,
        "np_new_denied_over_floor": np_new, "tier_new_denied_over_floor": tier_new,
        "np_established_over_floor": np_est, "tier_established_over_floor": tier_est,
    })
}
