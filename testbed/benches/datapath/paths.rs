//! The paths a user's packets take that the main table leaves out, each
//! over the one-lookup floor of the same round, all with the catch-all
//! on (the node's pod range in `POD_RANGES`, holding our pod and its
//! peers, all in `ENFORCED`: pods of this node, as cluster mode runs by
//! default) and the record ring read:
//!
//! - an established packet in the opener's direction, and its reply (the
//!   pod answering: the same one conntrack lookup, whose entry says the
//!   flow was opened the other way);
//! - an allowed new flow (a SYN of its own per run: a conntrack miss,
//!   the insert and its record) and a denied one (its record), one run
//!   per call, over the floor run the same way;
//! - an established packet right after its endpoint's revision moved (a
//!   policy change: the flow is judged again), one run per call, against
//!   the same packet without the bump.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use aya::maps::RingBuf;
use ipnet::IpNet;
use policy_agent::{
    cluster::PodRef,
    datapath::{
        SyncReport,
        bpf::{pins::Hook, pod_range_guard::Enforcement, unpinned::Unpinned},
    },
    mapstate::{MapOp, diff},
};
use policy_common::{event::FlowBudget, maps as names};
use policy_testbed::packet::{Packet, TCP_ACK, TCP_SYN};

use super::{drain_ring, median, once_each, records::set_budget, run_once, state};

/// One-run samples per round.
const ONCE: u16 = 1_000;

pub fn paths(floors: &mut Unpinned, repeat: u32, rounds: usize) -> serde_json::Value {
    let pod = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 200));
    let allowed = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    let denied = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3));
    let mut dp = Unpinned::load_with(&[(names::CONNTRACK, 65536)]).unwrap();
    let s = state(1_000);
    let old = dp.maps.read_state().unwrap();
    dp.maps.apply(&diff(&old, &s)).unwrap();
    set_budget(&mut dp, FlowBudget::new(0, 0));
    let mut ring = RingBuf::try_from(dp.ebpf.take_map(names::DROP_EVENTS).unwrap()).unwrap();
    // The catch-all: this node's pod range, holding our pod and both
    // peers (pods of this node, enforced), so the guard's checks (its
    // LPM lookup and the ENFORCED hash) are on every path they apply to.
    let mut guard = Enforcement::open(&mut dp.maps).unwrap();
    let mut report = SyncReport::default();
    let range: IpNet = "10.0.0.0/24".parse().unwrap();
    guard.set_ranges(&mut dp.maps, Some(&[range]), &mut report);
    let pods = BTreeMap::from([
        (PodRef::new("bench", "pod"), vec![pod]),
        (PodRef::new("bench", "allowed"), vec![allowed]),
        (PodRef::new("bench", "denied"), vec![denied]),
    ]);
    let ifindex = |p: &PodRef| match &*p.name {
        "pod" => Some(1),
        "allowed" => Some(2),
        _ => Some(3),
    };
    for i in 1..=3 {
        guard.set_attached(i, true);
    }
    guard.grant(&mut dp.maps, &pods, &ifindex, &mut report);
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    let opening = Packet::tcp(allowed, 40001, pod, 80, TCP_SYN).frame();
    let established = Packet::tcp(allowed, 40001, pod, 80, TCP_ACK).frame();
    let reply = Packet::tcp(pod, 80, allowed, 40001, TCP_ACK).frame();
    let r = run_once(dp.program(Hook::Egress).unwrap(), &opening, 1);
    assert!(r >= 0.0);
    let mut ep = dp.maps.endpoint(1).unwrap().unwrap();

    let (mut fwd, mut rep) = (Vec::new(), Vec::new());
    let (mut new_allowed, mut new_denied) = (Vec::new(), Vec::new());
    let (mut est_once, mut bumped_once) = (Vec::new(), Vec::new());
    let mut floors_once = Vec::new();
    for round in 0..rounds {
        let f = run_once(
            floors.extra_program("floor_one_lookup").unwrap(),
            &established,
            repeat,
        );
        fwd.push(run_once(dp.program(Hook::Egress).unwrap(), &established, repeat) / f);
        rep.push(run_once(dp.program(Hook::Ingress).unwrap(), &reply, repeat) / f);

        let base = 20_000 + round as u16 * ONCE;
        let syns = |peer: IpAddr| -> Vec<Vec<u8>> {
            (0..ONCE)
                .map(|i| Packet::tcp(peer, base + i, pod, 80, TCP_SYN).frame())
                .collect()
        };
        let (allowed_syns, denied_syns) = (syns(allowed), syns(denied));
        let floor_once = once_each(
            floors.extra_program("floor_one_lookup").unwrap(),
            &allowed_syns,
        );
        floors_once.push(floor_once);
        drain_ring(&mut ring);
        new_allowed.push(once_each(dp.program(Hook::Egress).unwrap(), &allowed_syns) / floor_once);
        drain_ring(&mut ring);
        new_denied.push(once_each(dp.program(Hook::Egress).unwrap(), &denied_syns) / floor_once);
        drain_ring(&mut ring);

        // The same established packet once per call, with and without a
        // revision bump before it.
        let mut plain = Vec::new();
        let mut bumped = Vec::new();
        for _ in 0..ONCE / 4 {
            plain.push(run_once(dp.program(Hook::Egress).unwrap(), &established, 1));
            ep.revision = ep.revision.wrapping_add(1).max(1);
            dp.maps.apply(&[MapOp::UpsertEndpoint(1, ep)]).unwrap();
            bumped.push(run_once(dp.program(Hook::Egress).unwrap(), &established, 1));
        }
        est_once.push(median(plain) / floor_once);
        bumped_once.push(median(bumped) / floor_once);
        drain_ring(&mut ring);
    }
    let [
        fwd,
        rep,
        new_allowed,
        new_denied,
        est_once,
        bumped_once,
        floor_once,
    ] = [
        fwd,
        rep,
        new_allowed,
        new_denied,
        est_once,
        bumped_once,
        floors_once,
    ]
    .map(median);
    println!(
        "paths, catch-all on, ring read: established {fwd:.2}x the floor, its reply {rep:.2}x; one run per call (floor {floor_once:.0} ns): a new flow allowed {new_allowed:.2}x, denied {new_denied:.2}x; established {est_once:.2}x, right after a revision bump {bumped_once:.2}x"
    );
    serde_json::json!({
        "established_over_floor": fwd, "reply_over_floor": rep,
        "floor_one_lookup_once_ns": floor_once,
        "new_allowed_over_floor_once": new_allowed, "new_denied_over_floor_once": new_denied,
        "established_over_floor_once": est_once, "revision_bumped_over_floor_once": bumped_once,
    })
}
