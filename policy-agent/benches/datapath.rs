//! Per-packet cost of the classifier via BPF_PROG_TEST_RUN, as the number
//! of policy entries grows (10 → 10,000) with 10,000 ipcache entries
//! loaded. Needs root. `cargo bench -p policy-agent --bench datapath`
//!
//! The kernel runs the program `REPEAT` times per call and reports the
//! mean; each figure is the median of `ROUNDS` calls. Every ratio is the
//! median of per-round ratios against the one-lookup floor measured in the
//! same round, so drift of the machine cancels. Printed figures, not
//! pass/fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr};

use aya::programs::{TestRun as _, TestRunOptions};
use ipnet::IpNet;
use policy_agent::{
    datapath::bpf::{Hook, Unpinned},
    mapstate::{MapState, diff},
    sim::packet::{Packet, TCP_ACK, TCP_SYN},
};
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED, EndpointInfo},
    identity::{FIRST_LABEL, WORLD},
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    proto,
};
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

fn run_once(prog: &mut aya::programs::SchedClassifier, frame: &[u8]) -> f64 {
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            repeat: REPEAT,
            ..TestRunOptions::default()
        })
        .unwrap();
    r.duration.as_nanos() as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3));
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200));
    let allowed_peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    // Denied: every probe misses, the longest path a new flow takes.
    let new_denied = Packet::tcp(peer, 40000, pod, 80, TCP_SYN).frame();
    // Established: after the first run, a conntrack hit.
    let established = Packet::tcp(allowed_peer, 40001, pod, 80, TCP_ACK).frame();
    // The floors, loaded the same way, with the same maps behind them.
    let mut floors = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
    println!("policy entries | new flow (all probes miss) ns/pkt | established ns/pkt");
    let mut base: Option<(f64, f64)> = None;
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let (mut all_empty, mut all_floor) = (Vec::new(), Vec::new());
    for policies in [10usize, 100, 1_000, 10_000] {
        let mut dp = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
        let s = state(policies);
        let old = dp.maps.read_state().unwrap();
        dp.maps.apply(&diff(&old, &s)).unwrap();
        // Each round measures the floors and both paths back to back, and
        // ratios are taken within a round: a shared VM drifts by 20% and
        // more between minutes, far less between neighbouring calls.
        let (mut new, mut est, mut floor) = (Vec::new(), Vec::new(), Vec::new());
        let (mut new_r, mut est_r) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let e = run_once(floors.extra_program("floor_empty").unwrap(), &established);
            let f = run_once(
                floors.extra_program("floor_one_lookup").unwrap(),
                &established,
            );
            let n = run_once(dp.program(Hook::Egress).unwrap(), &new_denied);
            let x = run_once(dp.program(Hook::Egress).unwrap(), &established);
            all_empty.push(e);
            all_floor.push(f);
            floor.push(f);
            new.push(n);
            est.push(x);
            new_r.push(n / f);
            est_r.push(x / f);
        }
        let (new, est, floor) = (median(new), median(est), median(floor));
        let (new_r, est_r) = (median(new_r), median(est_r));
        let (b_new, b_est) = *base.get_or_insert((new_r, est_r));
        println!(
            "{policies:>14} | {new:>8.1} ({:.2}x) | {est:>8.1} ({:.2}x, {est_r:.2}x the one-lookup floor of {floor:.0} ns)",
            new_r / b_new,
            est_r / b_est,
        );
        rows.push(serde_json::json!({
            "policies": policies, "new_flow_ns": new, "established_ns": est,
            "floor_one_lookup_ns": floor,
            "new_flow_ratio_to_10": new_r / b_new, "established_ratio_to_10": est_r / b_est,
            "established_over_floor": est_r,
        }));
    }
    let (empty, one_lookup) = (median(all_empty), median(all_floor));
    println!(
        "floor: empty program {empty:.1} ns/pkt; parse + one hash lookup {one_lookup:.1} ns/pkt"
    );
    let json = serde_json::json!({
        "ipcache_entries": IPCACHE_ENTRIES, "repeat": REPEAT,
        "floor_empty_ns": empty, "floor_one_lookup_ns": one_lookup, "rows": rows,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("datapath.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
}
