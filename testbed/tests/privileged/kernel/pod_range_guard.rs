//! The pod-range guard (`--pod-cidr`) on the real kernel through
//! BPF_PROG_TEST_RUN, at every hook: an address in the node's pod ranges
//! that is not enforced is unreachable from a pod, cannot reach one, and
//! neither leaves nor enters the node. Needs root (CAP_BPF, CAP_NET_ADMIN).

use aya::maps::RingBuf;
use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction::EGRESS,
    event::FlowRecord,
    identity::{NODE, WORLD},
    verdict::Reason::{self, *},
};
use policy_testbed::fixtures::harness::{
    Expect, Harness, TEST_IFINDEX,
    Verdict::{self, Drop, Pass},
    ip,
};
use policy_testbed::packet::{Packet, TCP_SYN};

const POD: u32 = 300;
const PEER: u32 = 301;

/// The pod at 10.0.0.10 / fd00::10 (TEST_IFINDEX, isolated nowhere) in
/// the node's ranges 10.0.0.0/24 and fd00::/64 with the gateway 10.0.0.1
/// (a node address) and an enforced neighbour 10.0.0.11 / fd00::11;
/// 10.0.0.99 / fd00::99 are a new pod the agent does not enforce yet.
fn node(guard: bool) -> Harness {
    let mut h = Harness::new();
    h.endpoint(POD, 0, 1);
    h.ipcache("10.0.0.10/32", POD, WORLD);
    h.ipcache("10.0.0.11/32", PEER, WORLD);
    h.ipcache("10.0.0.1/32", NODE, WORLD);
    h.sync();
    h.enforce("10.0.0.10", Some(TEST_IFINDEX));
    h.enforce("fd00::10", Some(TEST_IFINDEX));
    h.enforce("10.0.0.11", Some(7));
    h.enforce("fd00::11", Some(7));
    h.enforce("10.0.0.1", Some(0));
    if guard {
        h.pod_range("10.0.0.0/24");
        h.pod_range("fd00::/64");
    }
    h
}

fn tcp(src: &str, dst: &str) -> Vec<u8> {
    Packet::tcp(ip(src), 40000, ip(dst), 80, TCP_SYN).frame()
}

/// Runs every row, a [`tcp`] SYN `src` -> `dst` at `hook` (its label),
/// and reports at once every row that differs from what it expects (see
/// [`Harness::check`]).
#[track_caller]
fn check<E: Into<Expect> + Copy>(h: &mut Harness, rows: &[(Hook, &str, &str, E)]) {
    let frames: Vec<Vec<u8>> = rows.iter().map(|&(_, src, dst, _)| tcp(src, dst)).collect();
    let table: Vec<_> = rows
        .iter()
        .zip(&frames)
        .map(|(&(hook, src, dst, want), frame)| (format!("{src} -> {dst}"), hook, &frame[..], want))
        .collect();
    h.check(&table);
}

const UNENFORCED: (Verdict, Reason) = (Drop, DropUnenforced);
const NOT_ISOLATED: (Verdict, Reason) = (Pass, AllowNotIsolated);

#[test]
fn a_pod_cannot_reach_an_unenforced_neighbour() {
    let mut h = node(true);
    check(
        &mut h,
        &[
            (Hook::Ingress, "10.0.0.10", "10.0.0.99", UNENFORCED),
            (Hook::Ingress, "fd00::10", "fd00::99", UNENFORCED),
            // Enforced neighbours, the gateway, addresses outside the
            // ranges: as before.
            (Hook::Ingress, "10.0.0.10", "10.0.0.11", NOT_ISOLATED),
            (Hook::Ingress, "fd00::10", "fd00::11", NOT_ISOLATED),
            (Hook::Ingress, "10.0.0.10", "192.0.2.1", NOT_ISOLATED),
            (Hook::Ingress, "10.0.0.10", "10.0.1.99", NOT_ISOLATED),
            (Hook::Ingress, "10.0.0.10", "10.0.0.1", (Pass, AllowNode)),
        ],
    );
    // Once the agent writes its entry, the new pod is reachable.
    h.enforce("10.0.0.99", Some(9));
    assert_eq!(
        h.run_reason(Hook::Ingress, &tcp("10.0.0.10", "10.0.0.99")),
        (Verdict::Pass, Reason::AllowNotIsolated)
    );
    // And unreachable again once it is withdrawn.
    h.enforce("10.0.0.99", None);
    assert_eq!(
        h.run(Hook::Ingress, &tcp("10.0.0.10", "10.0.0.99")),
        Verdict::Drop
    );
}

#[test]
fn an_unenforced_neighbour_cannot_reach_a_pod() {
    let mut h = node(true);
    check(
        &mut h,
        &[
            (Hook::Egress, "10.0.0.99", "10.0.0.10", UNENFORCED),
            (Hook::Egress, "fd00::99", "fd00::10", UNENFORCED),
            (Hook::Egress, "10.0.0.11", "10.0.0.10", NOT_ISOLATED),
            (Hook::Egress, "10.0.0.1", "10.0.0.10", (Pass, AllowNode)),
        ],
    );
}

#[test]
fn nothing_leaves_the_node_from_an_unenforced_address() {
    let mut h = node(true);
    let (unenforced, pass) = (Expect::from(UNENFORCED), Expect::Verdict(Pass));
    check(
        &mut h,
        &[
            (Hook::Uplink, "10.0.0.99", "192.0.2.1", unenforced),
            (Hook::Uplink, "fd00::99", "2001:db8::1", unenforced),
            (Hook::Uplink, "10.0.0.10", "192.0.2.1", pass),
            (Hook::Uplink, "10.0.0.1", "192.0.2.1", pass),
            (Hook::Uplink, "192.0.2.7", "192.0.2.1", pass),
            (Hook::Uplink, "fd00::11", "2001:db8::1", pass),
            // The destination does not matter at egress (the next node judges).
            (Hook::Uplink, "192.0.2.1", "10.0.0.99", pass),
        ],
    );
}

#[test]
fn nothing_enters_the_node_for_an_unenforced_address() {
    let mut h = node(true);
    let (unenforced, pass) = (Expect::from(UNENFORCED), Expect::Verdict(Pass));
    check(
        &mut h,
        &[
            (Hook::UplinkIngress, "192.0.2.1", "10.0.0.99", unenforced),
            (Hook::UplinkIngress, "2001:db8::1", "fd00::99", unenforced),
            (Hook::UplinkIngress, "192.0.2.1", "10.0.0.10", pass),
            (Hook::UplinkIngress, "192.0.2.1", "10.0.0.1", pass),
            (Hook::UplinkIngress, "2001:db8::1", "fd00::11", pass),
            (Hook::UplinkIngress, "192.0.2.1", "192.0.2.9", pass),
            (Hook::UplinkIngress, "10.0.0.99", "192.0.2.1", pass),
        ],
    );
}

#[test]
fn without_the_config_bit_nothing_is_looked_up() {
    // The ranges and entries are there but the bit is clear (the agent
    // sets it only once ENFORCED is filled; without --pod-cidr never).
    let mut h = node(true);
    h.pod_range_guard(false);
    let (not_isolated, pass) = (Expect::from(NOT_ISOLATED), Expect::Verdict(Pass));
    check(
        &mut h,
        &[
            (Hook::Ingress, "10.0.0.10", "10.0.0.99", not_isolated),
            (Hook::Egress, "10.0.0.99", "10.0.0.10", not_isolated),
            (Hook::Uplink, "10.0.0.99", "192.0.2.1", pass),
            (Hook::UplinkIngress, "192.0.2.1", "10.0.0.99", pass),
        ],
    );
}

#[test]
fn a_drop_of_an_unenforced_peer_is_reported() {
    let mut h = node(true);
    let mut ring = RingBuf::try_from(h.dp.ebpf.take_map("DROP_EVENTS").unwrap()).unwrap();
    assert_eq!(
        h.run(Hook::Ingress, &tcp("10.0.0.10", "10.0.0.99")),
        Verdict::Drop
    );
    let item = ring.next().expect("one drop event");
    let ev: FlowRecord = *bytemuck::from_bytes(&item[..std::mem::size_of::<FlowRecord>()]);
    assert_eq!(ev.ifindex, TEST_IFINDEX);
    assert_eq!(ev.endpoint_identity, POD);
    assert_eq!(ev.direction, EGRESS);
    assert_eq!(ev.reason, Reason::DropUnenforced as u8);
    assert_eq!(&ev.dst[..4], &[10, 0, 0, 99]);
}

/// A flow tracked at the endpoint's current revision skips the guard (it
/// costs an LPM lookup on every packet otherwise); the agent moves every
/// revision when an address leaves ENFORCED, and the flow judged again
/// checks its peer first: both ways of it drop from then on, the entry
/// goes, and a new flow to the address stays refused.
#[test]
fn a_tracked_flow_meets_the_guard_again_once_the_revision_moves() {
    use policy_common::{
        direction::EGRESS, endpoint::ENDPOINT_EGRESS_ISOLATED, policy::PolicyKey, proto::TCP,
    };
    use policy_testbed::packet::TCP_ACK;
    let mut h = node(true);
    h.endpoint(POD, ENDPOINT_EGRESS_ISOLATED, 1);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, TCP, 16, 80));
    h.sync();
    let syn = tcp("10.0.0.10", "10.0.0.11");
    let ack = Packet::tcp(ip("10.0.0.10"), 40000, ip("10.0.0.11"), 80, TCP_ACK).frame();
    let reply = Packet::tcp(ip("10.0.0.11"), 80, ip("10.0.0.10"), 40000, TCP_ACK).frame();
    assert_eq!(h.run_reason(Hook::Ingress, &syn), (Pass, AllowPolicy));
    assert_eq!(h.run_reason(Hook::Egress, &reply), (Pass, AllowReply));
    // The peer's address leaves ENFORCED; the revision has not moved yet.
    h.enforce("10.0.0.11", None);
    assert_eq!(h.run_reason(Hook::Ingress, &ack), (Pass, AllowEstablished));
    // The revision moves: the flow is judged again, its peer first.
    h.endpoint(POD, ENDPOINT_EGRESS_ISOLATED, 2);
    h.sync();
    assert_eq!(h.run_reason(Hook::Egress, &reply), UNENFORCED);
    // Its entry is gone: the other way is a new, refused flow as well.
    assert_eq!(h.run_reason(Hook::Ingress, &ack), UNENFORCED);
    assert_eq!(h.run_reason(Hook::Ingress, &syn), UNENFORCED);
}

/// Prints the per-packet cost of the pod-range guard at a pod's hook (no
/// assertion: timings are printed, never asserted). Run with
/// `-- --ignored --nocapture`.
/// The median of `samples` timings of `frame` at `from_pod`, each the
/// mean of 20,000 runs (for the ignored cost tests).
fn ns_per_packet(h: &mut Harness, frame: &[u8], samples: usize) -> f64 {
    use aya::programs::{TestRun as _, TestRunOptions};
    let prog = h.dp.program(Hook::Ingress).unwrap();
    let mut v: Vec<f64> = (0..samples)
        .map(|_| {
            let r = prog
                .test_run(TestRunOptions {
                    data_in: Some(frame),
                    repeat: 20_000,
                    ..TestRunOptions::default()
                })
                .unwrap();
            r.duration.as_nanos() as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore]
fn cost_of_the_pod_range_guard() {
    let mut h = node(true);
    let ns = |h: &mut Harness, frame: &[u8]| ns_per_packet(h, frame, 15);
    let outside = tcp("10.0.0.10", "192.0.2.1");
    let inside = tcp("10.0.0.10", "10.0.0.11");
    h.pod_range_guard(false);
    let off_out = ns(&mut h, &outside);
    let off_in = ns(&mut h, &inside);
    h.pod_range_guard(true);
    let on_out = ns(&mut h, &outside);
    let on_in = ns(&mut h, &inside);
    println!(
        "ns/packet at from_pod (pod isolated nowhere): pod-range guard off {off_out:.1} / {off_in:.1}; on, peer outside the ranges {on_out:.1}; on, peer inside and enforced {on_in:.1}"
    );
}

/// Prints the per-packet cost of the pod-range guard on an established
/// packet (a tracked flow at its endpoint's current revision) to a peer
/// inside the ranges: the guard off, then on. Run with
/// `-- --ignored --nocapture`.
#[test]
#[ignore]
fn cost_of_the_pod_range_guard_on_an_established_packet() {
    use policy_common::{
        direction::EGRESS, endpoint::ENDPOINT_EGRESS_ISOLATED, policy::PolicyKey, proto::TCP,
    };
    use policy_testbed::packet::TCP_ACK;
    let mut h = node(true);
    h.endpoint(POD, ENDPOINT_EGRESS_ISOLATED, 1);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, TCP, 16, 80));
    h.sync();
    assert_eq!(
        h.run_reason(Hook::Ingress, &tcp("10.0.0.10", "10.0.0.11")),
        (Pass, AllowPolicy)
    );
    let ack = Packet::tcp(ip("10.0.0.10"), 40000, ip("10.0.0.11"), 80, TCP_ACK).frame();
    let ns = |h: &mut Harness, frame: &[u8]| ns_per_packet(h, frame, 31);
    let mut off = Vec::new();
    let mut on = Vec::new();
    // Alternating which goes first: the first measure after a map write
    // runs colder.
    for i in 0..6 {
        for guard in [i % 2 == 0, i % 2 != 0] {
            h.pod_range_guard(guard);
            let t = ns(&mut h, &ack);
            if guard { on.push(t) } else { off.push(t) }
        }
    }
    assert_eq!(h.run_reason(Hook::Ingress, &ack), (Pass, AllowEstablished));
    // The same with the peer's ENFORCED entry gone: where the established
    // packet skips the guard it still passes, at the same cost.
    h.enforce("10.0.0.11", None);
    let withdrawn = ns(&mut h, &ack);
    assert_eq!(h.run_reason(Hook::Ingress, &ack), (Pass, AllowEstablished));
    off.sort_by(f64::total_cmp);
    on.sort_by(f64::total_cmp);
    println!(
        "ns/packet, established, peer inside the ranges and enforced: pod-range guard off {:.1}, on {:.1}; on with the peer withdrawn {withdrawn:.1}",
        off[3], on[3]
    );
}
