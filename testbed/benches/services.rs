//! Per-packet cost of a pod's flows to a Service address via
//! BPF_PROG_TEST_RUN, as the number of Service frontends grows (10 →
//! 10,000), beside a direct flow to the same backend. Needs root.
//! `cargo bench -p policy-testbed --bench services`
//!
//! The client is egress-isolated and allowed to the backend on TCP 8080.
//! Four paths, each at the interface where the kernel runs it:
//! - direct new: the client's first packet to the backend's own address
//!   (the client's egress judged at its veth);
//! - service new: the client's first packet to a frontend (deferred at
//!   its veth: a conntrack entry, a `SERVICE_FLOWS` entry, the mark), and
//!   the same packet after DNAT at the uplink (judged as the client's
//!   egress against the backend it reached), each reported;
//! - service established: a later packet of that flow at the client's veth.
//!
//! New flows run once per packet (repeat 1, a new source port each: a
//! repeated packet would be a conntrack hit after its first run), so the
//! figure includes the kernel's per-call overhead; the floor (the
//! one-lookup program) is measured the same way beside them, and every
//! ratio is the median of per-round ratios to the floor of that round.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr};

use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions};
use ipnet::IpNet;
use policy_agent::{
    datapath::bpf::{pins::Hook, unpinned::Unpinned},
    mapstate::{MapState, diff},
};
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, EndpointInfo},
    identity::{FIRST_LABEL, WORLD},
    ipcache::IpcacheEntry,
    maps,
    policy::{PolicyEntry, PolicyKey},
    proto,
    service::{ServiceEntry, mark},
};
use policy_testbed::{
    fixtures::testns::TestNs,
    packet::{Packet, TCP_ACK, TCP_SYN},
};

const CLIENT_IF: u32 = 10;
const UPLINK_IF: u32 = 20;
const NEW_PER_ROUND: u16 = 1000;
const REPEAT: u32 = 200_000;
const ROUNDS: usize = 5;
const ME: u32 = FIRST_LABEL;
const BACKEND_ID: u32 = FIRST_LABEL + 1;
const BACKEND_PORT: u16 = 8080;
/// `struct __sk_buff`: its size, and the offsets of mark and ifindex.
const SKB_CTX: usize = 192;
const SKB_MARK: usize = 8;
const SKB_IFINDEX: usize = 40;

fn client() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, 10))
}
fn backend() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 1, 0, 5))
}
/// Frontend `i`: 10.96.x.y.
fn frontend(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a60_0000u32 + i + 1))
}

fn state(services: u32) -> MapState<u32> {
    let mut s = MapState::default();
    s.endpoints.insert(
        CLIENT_IF,
        EndpointInfo {
            identity: ME,
            flags: ENDPOINT_EGRESS_ISOLATED,
            revision: 1,
            ..Default::default()
        }
        .with_addresses(&[client()]),
    );
    s.ipcache.insert(
        IpNet::new(backend(), 32).unwrap(),
        IpcacheEntry {
            identity: BACKEND_ID,
            cidr_identity: WORLD,
        },
    );
    s.policy.insert(
        PolicyKey::new(
            ME,
            direction::EGRESS,
            BACKEND_ID,
            proto::TCP,
            16,
            BACKEND_PORT,
        ),
        PolicyEntry::default(),
    );
    for i in 0..services {
        s.services.insert(
            IpNet::new(frontend(i), 32).unwrap(),
            ServiceEntry::default(),
        );
    }
    s.finalize();
    s
}

/// One run at `ifindex` carrying `mark`: (kernel ns per run, verdict,
/// mark left).
fn run_at(
    prog: &mut SchedClassifier,
    frame: &[u8],
    ifindex: u32,
    mark: u32,
    repeat: u32,
) -> (f64, u32, u32) {
    let mut ctx_in = [0u8; SKB_CTX];
    ctx_in[SKB_MARK..SKB_MARK + 4].copy_from_slice(&mark.to_ne_bytes());
    ctx_in[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifindex.to_ne_bytes());
    let mut ctx_out = [0u8; 2 * SKB_CTX];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            repeat,
            ..TestRunOptions::default()
        })
        .unwrap();
    let left = u32::from_ne_bytes(ctx_out[SKB_MARK..SKB_MARK + 4].try_into().unwrap());
    (r.duration.as_nanos() as f64, r.return_value, left)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The classifier's pass: TC_ACT_UNSPEC (-1), the next program or the
/// stack decides.
const PASS: u32 = u32::MAX;
/// TC_ACT_SHOT.
const DROP: u32 = 2;

/// `direct`, `deferred`, `after_dnat`: medians of per-run ratios to the
/// floor run just before; `floor`: the floor's median (ns).
struct Round {
    floor: f64,
    /// The floor repeated like the established packet (a mean per run).
    floor_repeated: f64,
    direct: f64,
    deferred: f64,
    after_dnat: f64,
    established: f64,
}

fn round(dp: &mut Unpinned, floors: &mut Unpinned, services: u32, round: u16) -> Round {
    let target = frontend(services / 2);
    let base = 1024 + round * 3 * NEW_PER_ROUND;
    // Each measured run follows a run of the floor on the same frame, so
    // both find the caches in the same state; ratios are per pair.
    let (mut floor, mut direct, mut deferred, mut after_dnat) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut floor_before = |frame: &[u8], ifindex: u32, mark: u32| -> f64 {
        let f = floors.extra_program("floor_one_lookup").unwrap();
        run_at(f, frame, ifindex, mark, 1).0
    };
    for n in 0..NEW_PER_ROUND {
        let sport = base + n;
        let frame = Packet::tcp(client(), sport, target, 80, TCP_SYN).frame();
        // Deferred at the client's veth: passed with the pending mark.
        let fl = floor_before(&frame, CLIENT_IF, 0);
        let (t, verdict, left) =
            run_at(dp.program(Hook::Ingress).unwrap(), &frame, CLIENT_IF, 0, 1);
        assert_eq!(verdict, PASS, "a new service flow is passed on");
        let pending = mark::pending(CLIENT_IF).unwrap();
        assert_eq!(left & mark::MASK, pending, "and marked for after DNAT");
        deferred.push(t / fl);
        floor.push(fl);
        // After DNAT, at the uplink: judged against the backend (allowed).
        let dnat = Packet::tcp(client(), sport, backend(), BACKEND_PORT, TCP_SYN).frame();
        let fl = floor_before(&dnat, UPLINK_IF, pending);
        let (t, verdict, _) = run_at(
            dp.program(Hook::Uplink).unwrap(),
            &dnat,
            UPLINK_IF,
            pending,
            1,
        );
        assert_eq!(verdict, PASS, "the allowed backend passes after DNAT");
        after_dnat.push(t / fl);
        // The same client straight to the backend, a port of its own.
        let frame = Packet::tcp(
            client(),
            sport + NEW_PER_ROUND,
            backend(),
            BACKEND_PORT,
            TCP_SYN,
        )
        .frame();
        let fl = floor_before(&frame, CLIENT_IF, 0);
        let (t, verdict, _) = run_at(dp.program(Hook::Ingress).unwrap(), &frame, CLIENT_IF, 0, 1);
        assert_eq!(verdict, PASS, "the direct flow is allowed");
        direct.push(t / fl);
    }
    // A later packet of the first flow of this round: a conntrack hit.
    let est = Packet::tcp(client(), base, target, 80, TCP_ACK).frame();
    let (established, verdict, _) = run_at(
        dp.program(Hook::Ingress).unwrap(),
        &est,
        CLIENT_IF,
        0,
        REPEAT,
    );
    assert_eq!(verdict, PASS);
    let f = floors.extra_program("floor_one_lookup").unwrap();
    let floor_repeated = run_at(f, &est, CLIENT_IF, 0, REPEAT).0;
    Round {
        floor: median(floor),
        floor_repeated,
        direct: median(direct),
        deferred: median(deferred),
        after_dnat: median(after_dnat),
        established,
    }
}

fn measure() -> serde_json::Value {
    let mut floors = Unpinned::load().unwrap();
    let mut rows = Vec::new();
    println!(
        "services | direct new ns (x floor) | service new at the veth | after DNAT at the uplink | established | floor ns"
    );
    let mut base: Option<f64> = None;
    for services in [10u32, 100, 1_000, 10_000] {
        let mut dp =
            Unpinned::load_with(&[(maps::CONNTRACK, 65536), (maps::SERVICE_FLOWS, 65536)]).unwrap();
        let s = state(services);
        let old = dp.maps.read_state().unwrap();
        dp.maps.apply(&diff(&old, &s)).unwrap();
        // Judged, not passed, after DNAT: a backend the policy does not
        // allow is dropped there (a flow of its own, deferred first).
        let denied = IpAddr::V4(Ipv4Addr::new(10, 1, 0, 6));
        let frame = Packet::tcp(client(), 999, frontend(0), 80, TCP_SYN).frame();
        let pending = mark::pending(CLIENT_IF).unwrap();
        assert_eq!(
            run_at(dp.program(Hook::Ingress).unwrap(), &frame, CLIENT_IF, 0, 1).1,
            PASS
        );
        let dnat = Packet::tcp(client(), 999, denied, BACKEND_PORT, TCP_SYN).frame();
        assert_eq!(
            run_at(
                dp.program(Hook::Uplink).unwrap(),
                &dnat,
                UPLINK_IF,
                pending,
                1
            )
            .1,
            DROP,
            "a denied backend is dropped after DNAT"
        );
        let rounds: Vec<Round> = (0..ROUNDS as u16)
            .map(|r| round(&mut dp, &mut floors, services, r))
            .collect();
        let ratio = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
        let abs = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
        let (direct, deferred, after, est) = (
            ratio(&|r| r.direct),
            ratio(&|r| r.deferred),
            ratio(&|r| r.after_dnat),
            median(
                rounds
                    .iter()
                    .map(|r| r.established / r.floor_repeated)
                    .collect(),
            ),
        );
        let first = *base.get_or_insert(deferred + after);
        println!(
            "{services:>8} | {:>6.0} ({direct:.2}x) | {:>6.0} ({deferred:.2}x) | {:>6.0} ({after:.2}x) | {:>6.1} ({est:.2}x the repeated floor) | {:>6.0}; service new (both halves) {:.2}x its cost at 10 Services",
            abs(&|r| r.direct * r.floor),
            abs(&|r| r.deferred * r.floor),
            abs(&|r| r.after_dnat * r.floor),
            abs(&|r| r.established),
            abs(&|r| r.floor),
            (deferred + after) / first,
        );
        rows.push(serde_json::json!({
            "services": services,
            "direct_new_ns": abs(&|r| r.direct * r.floor),
            "service_new_deferred_ns": abs(&|r| r.deferred * r.floor),
            "service_new_after_dnat_ns": abs(&|r| r.after_dnat * r.floor),
            "service_established_ns": abs(&|r| r.established),
            "floor_one_lookup_single_run_ns": abs(&|r| r.floor),
            "direct_new_over_floor": direct,
            "service_new_deferred_over_floor": deferred,
            "service_new_after_dnat_over_floor": after,
            "service_established_over_floor": est,
            "service_new_ratio_to_10": (deferred + after) / first,
        }));
    }
    serde_json::json!({
        "new_per_round": NEW_PER_ROUND, "rounds": ROUNDS, "repeat_established": REPEAT,
        "rows": rows,
    })
}

fn main() {
    // Devices at the ifindexes the runs name, in a namespace this thread
    // enters (removed when `ns` drops).
    let ns = TestNs::enter("bench-svc");
    ns.device("client", CLIENT_IF);
    ns.device("uplink", UPLINK_IF);
    let json = measure();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("services.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
}
