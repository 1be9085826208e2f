//! What a staged policy costs the endpoints it touches. An endpoint only
//! a staged policy would judge is tracked (`ENDPOINT_STAGED`) so each new
//! flow is recorded once: its packets take the conntrack path instead of
//! the untracked one. Both measured at the same endpoint (1,000 policy
//! entries, not isolated): an established packet (each run the same
//! frame: for the tracked endpoint a conntrack hit), and a new flow (a
//! SYN of its own per run, one run per call: the conntrack miss, insert
//! and record), each over the one-lookup floor measured the same way in
//! the same round. Then the daemon's work: each record judged again
//! against the staged view.
use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Instant, SystemTime},
};

use aya::maps::RingBuf;
use policy_agent::{
    cluster::{PodRef, staged::StagedPolicy},
    datapath::bpf::{
        flows::{
            record::{Flow, Peer, Verdict},
            staged::StagedJudge,
        },
        pins::Hook,
        unpinned::Unpinned,
    },
    mapstate::{MapState, StagedView, diff},
};
use policy_common::{
    direction,
    endpoint::{ENDPOINT_HAS_V4, ENDPOINT_HAS_V6, ENDPOINT_STAGED},
    event::{FlowBudget, FlowRecord, RECORD_NEW_FLOW},
    family, maps as names, proto,
    verdict::Reason,
};
use policy_testbed::packet::{Packet, TCP_ACK, TCP_SYN};

use super::{drain_ring, median, once_each, records::set_budget, run_once, state};

/// New flows measured per round (one SYN each).
const NEW_FLOWS: u16 = 1_000;

/// `state(1_000)` with our endpoint judged in no direction, `flags` its
/// only flags.
fn endpoint_with(flags: u32) -> MapState<u32> {
    let mut s = state(1_000);
    if let Some(ep) = s.endpoints.get_mut(&1) {
        ep.flags = (ep.flags & (ENDPOINT_HAS_V4 | ENDPOINT_HAS_V6)) | flags;
    }
    s
}

fn loaded(s: &MapState<u32>) -> (Unpinned, RingBuf<aya::maps::MapData>) {
    let mut dp = Unpinned::load_with(&[(names::CONNTRACK, 65536)]).unwrap();
    let old = dp.maps.read_state().unwrap();
    dp.maps.apply(&diff(&old, s)).unwrap();
    set_budget(&mut dp, FlowBudget::new(0, 0));
    let ring = RingBuf::try_from(dp.ebpf.take_map(names::DROP_EVENTS).unwrap()).unwrap();
    (dp, ring)
}

pub fn staged(floors: &mut Unpinned, repeat: u32, rounds: usize) -> serde_json::Value {
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200));
    let untouched = endpoint_with(0);
    let touched = endpoint_with(ENDPOINT_STAGED);
    assert!(!untouched.endpoints[&1].tracks() && touched.endpoints[&1].tracks());
    let (mut plain, mut plain_ring) = loaded(&untouched);
    let (mut staged, mut staged_ring) = loaded(&touched);
    let opening = Packet::tcp(peer, 40001, pod, 80, TCP_SYN).frame();
    let established = Packet::tcp(peer, 40001, pod, 80, TCP_ACK).frame();
    for dp in [&mut plain, &mut staged] {
        let r = run_once(dp.program(Hook::Egress).unwrap(), &opening, 1);
        assert!(r >= 0.0);
    }
    let (mut est_plain, mut est_staged, mut new_plain, mut new_staged) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut floors_once = Vec::new();
    let mut recorded = 0;
    for round in 0..rounds {
        let f = run_once(
            floors.extra_program("floor_one_lookup").unwrap(),
            &established,
            repeat,
        );
        est_plain.push(run_once(plain.program(Hook::Egress).unwrap(), &established, repeat) / f);
        est_staged.push(run_once(staged.program(Hook::Egress).unwrap(), &established, repeat) / f);
        // New flows: a SYN from a source port not used before.
        let base = 10_000 + round as u16 * NEW_FLOWS;
        let syns: Vec<Vec<u8>> = (0..NEW_FLOWS)
            .map(|i| Packet::tcp(peer, base + i, pod, 80, TCP_SYN).frame())
            .collect();
        let floor_once = once_each(floors.extra_program("floor_one_lookup").unwrap(), &syns);
        floors_once.push(floor_once);
        drain_ring(&mut plain_ring);
        drain_ring(&mut staged_ring);
        new_plain.push(once_each(plain.program(Hook::Egress).unwrap(), &syns) / floor_once);
        new_staged.push(once_each(staged.program(Hook::Egress).unwrap(), &syns) / floor_once);
        recorded += drain_ring(&mut staged_ring);
        drain_ring(&mut plain_ring);
    }
    assert!(
        recorded >= rounds * usize::from(NEW_FLOWS) * 9 / 10,
        "each new flow at the touched endpoint is recorded: {recorded}"
    );
    let [est_plain, est_staged, new_plain, new_staged] =
        [est_plain, est_staged, new_plain, new_staged].map(median);
    let floor_once = median(floors_once);
    let judge_ns = judge_ns_per_record(&touched);
    println!(
        "staged policies, at an endpoint only a staged policy judges (tracked) against one none touches: established {est_staged:.2}x against {est_plain:.2}x the floor; new flow (conntrack miss, insert, record) {new_staged:.2}x against {new_plain:.2}x the floor of one run ({floor_once:.0} ns: a single run's timing included), +{:.0} ns; the daemon judges each record against the staged view in {judge_ns:.0} ns",
        (new_staged - new_plain) * floor_once
    );
    serde_json::json!({
        "established_untouched_over_floor": est_plain,
        "established_touched_over_floor": est_staged,
        "new_flow_untouched_over_floor_once": new_plain,
        "new_flow_touched_over_floor_once": new_staged,
        "floor_one_lookup_once_ns": floor_once,
        "new_flow_touched_extra_ns": (new_staged - new_plain) * floor_once,
        "userspace_judge_ns_per_record": judge_ns,
    })
}

/// The daemon's staged judgement per record (the staged view of `s`,
/// 1,000 entries, our endpoint isolated in it), in ns: the median of
/// five runs of 20,000 records.
fn judge_ns_per_record(s: &MapState<u32>) -> f64 {
    let mut view_maps: MapState<PodRef> = MapState {
        policy: s.policy.clone(),
        ipcache: s.ipcache.clone(),
        ..MapState::default()
    };
    let mut ep = s.endpoints[&1];
    ep.flags |= policy_common::endpoint::ENDPOINT_INGRESS_ISOLATED;
    view_maps.endpoints.insert(PodRef::new("shop", "db-0"), ep);
    let view = StagedView::new(
        &view_maps,
        [(
            StagedPolicy::NetworkPolicy {
                namespace: "shop".into(),
                name: "db".into(),
            },
            SystemTime::now(),
        )]
        .into(),
    );
    let mut judge = StagedJudge::default();
    judge.update(Some(view.into()), 0);
    let record = |i: u32| FlowRecord {
        ifindex: 7,
        src: [10, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        dst: [10, 0, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        sport: 30000 + (i % 30000) as u16,
        dport: 80,
        protocol: proto::TCP,
        family: family::IPV4,
        direction: direction::INGRESS,
        reason: Reason::AllowNotIsolated as u8,
        flags: RECORD_NEW_FLOW,
        ..FlowRecord::default()
    };
    let flow = Flow {
        time: String::new(),
        direction: "ingress".into(),
        pod: "shop/db-0".into(),
        peer: Peer::ip("10.0.0.9"),
        peer_identity: None,
        protocol: "TCP".into(),
        port: Some(80),
        verdict: Verdict::Allow,
        reason: "allow_not_isolated".into(),
        policies: Vec::new(),
        staged: None,
    };
    let runs: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            let mut changed = 0;
            let mut f = flow.clone();
            for i in 0..20_000u32 {
                f.staged = None;
                judge.judge(&record(i), &mut f);
                changed += usize::from(f.staged.is_some());
            }
            assert_eq!(changed, 20_000, "every record would be dropped");
            t.elapsed().as_nanos() as f64 / 20_000.0
        })
        .collect();
    median(runs)
}
