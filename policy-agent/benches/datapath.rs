//! Per-packet cost of the classifier via BPF_PROG_TEST_RUN, as the number
//! of policy entries grows (10 → 10,000) with 10,000 ipcache entries
//! loaded. Needs root. `cargo bench -p policy-agent --bench datapath`
//!
//! The kernel runs the program `REPEAT` times per call and reports the
//! mean; each figure is the median of `ROUNDS` calls. Printed figures, not
//! pass/fail: ratios against the 10-entry case are what to compare.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr};

use aya::programs::{TestRun as _, TestRunOptions};
use ipnet::IpNet;
use policy_agent::{
    datapath::bpf::{
        Hook, Unpinned,
        packet::{Packet, TCP_ACK, TCP_SYN},
    },
    mapstate::{MapState, diff},
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
        },
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

fn median_ns(dp: &mut Unpinned, frame: &[u8]) -> f64 {
    median_of(dp.program(Hook::Egress).unwrap(), frame)
}

fn median_of(prog: &mut aya::programs::SchedClassifier, frame: &[u8]) -> f64 {
    let mut samples: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let r = prog
                .test_run(TestRunOptions {
                    data_in: Some(frame),
                    repeat: REPEAT,
                    ..TestRunOptions::default()
                })
                .unwrap();
            r.duration.as_nanos() as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[ROUNDS / 2]
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
    let empty = median_of(floors.extra_program("floor_empty").unwrap(), &established);
    let one_lookup = median_of(
        floors.extra_program("floor_one_lookup").unwrap(),
        &established,
    );
    println!(
        "floor: empty program {empty:.1} ns/pkt; parse + one hash lookup {one_lookup:.1} ns/pkt"
    );
    println!("policy entries | new flow (all probes miss) ns/pkt | established ns/pkt");
    let mut base: Option<(f64, f64)> = None;
    let mut rows: Vec<serde_json::Value> = Vec::new();
    for policies in [10usize, 100, 1_000, 10_000] {
        let mut dp = Unpinned::load_with(&[(policy_common::maps::CONNTRACK, 65536)]).unwrap();
        let s = state(policies);
        let old = dp.maps.read_state().unwrap();
        dp.maps.apply(&diff(&old, &s)).unwrap();
        let new = median_ns(&mut dp, &new_denied);
        let est = median_ns(&mut dp, &established);
        let (b_new, b_est) = *base.get_or_insert((new, est));
        println!(
            "{policies:>14} | {new:>8.1} ({:.2}x) | {est:>8.1} ({:.2}x, {:.2}x the one-lookup floor)",
            new / b_new,
            est / b_est,
            est / one_lookup
        );
        rows.push(serde_json::json!({
            "policies": policies, "new_flow_ns": new, "established_ns": est,
            "new_flow_ratio_to_10": new / b_new, "established_ratio_to_10": est / b_est,
            "established_over_floor": est / one_lookup,
        }));
    }
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
