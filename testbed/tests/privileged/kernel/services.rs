//! Services in the classifier through BPF_PROG_TEST_RUN: a pod's flow to a
//! frontend deferred with the mark, the client's egress judged after DNAT
//! at the backend's veth (`to_pod`) or the uplink (`to_uplink`), and the
//! client's later packets. Each test runs in a network namespace of its
//! own whose devices give the interfaces (the kernel requires
//! `__sk_buff.ifindex` to name one). Needs root.

use std::net::IpAddr;

use aya::maps::{HashMap as BpfHashMap, RingBuf};
use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    conntrack::{
        CT_FLAG_PENDING, CT_FLAG_SERVICE, CT_FLAG_SYN_ONLY, CT_OPENER_EITHER, CtEntry, CtKey,
    },
    direction::{EGRESS, INGRESS},
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    event::FlowRecord,
    family,
    identity::WORLD,
    policy::PolicyKey,
    proto::TCP,
    service::{SERVICE_FLOW_RESOLVED, ServiceFlow, ServiceFlowKey, mark},
    verdict::Reason,
};
use policy_testbed::fixtures::{
    harness::{Harness, Run, Verdict, ip},
    testns::TestNs,
};
use policy_testbed::packet::{L4, Packet, TCP_ACK, TCP_SYN};

const CLIENT_IF: u32 = 10;
const BACKEND_IF: u32 = 11;
const BAD_IF: u32 = 13;
const UPLINK_IF: u32 = 12;
const CLIENT: u32 = 300;
const GOOD: u32 = 301;
const BAD: u32 = 302;
/// Mark bits that are not ours (kube-proxy's 0x4000 among them).
const FOREIGN: u32 = 0x8000_40ff;

const CLIENT_IP: &str = "10.0.0.5";
const FRONTEND: &str = "10.96.0.10";
const OTHER_FRONTEND: &str = "10.96.0.11";
/// A local backend the client may reach on TCP 8080, and one it may not.
const GOOD_IP: &str = "10.0.1.1";
const BAD_IP: &str = "10.0.1.2";
/// The same, on another node.
const REMOTE_GOOD: &str = "10.1.0.1";
const REMOTE_BAD: &str = "10.1.0.2";

/// A node in a namespace of its own: the client pod (isolated as
/// `client_flags` says), two backend pods, an uplink; the frontend
/// 10.96.0.10 and the Service range 10.96.0.0/12.
struct Node {
    h: Harness,
    ns: TestNs,
}

fn node(tag: &str, client_flags: u32) -> Node {
    let ns = TestNs::enter(tag);
    for (name, ifindex) in [
        ("client", CLIENT_IF),
        ("backend", BACKEND_IF),
        ("uplink", UPLINK_IF),
        ("bad", BAD_IF),
    ] {
        ns.device(name, ifindex);
    }
    let mut h = Harness::new();
    h.endpoint_at(CLIENT_IF, CLIENT, client_flags, 1, &[ip(CLIENT_IP)]);
    h.endpoint_at(BACKEND_IF, GOOD, 0, 1, &[ip(GOOD_IP)]);
    h.endpoint_at(BAD_IF, BAD, 0, 1, &[ip(BAD_IP)]);
    for (addr, id) in [
        (CLIENT_IP, CLIENT),
        (GOOD_IP, GOOD),
        (BAD_IP, BAD),
        (REMOTE_GOOD, GOOD),
        (REMOTE_BAD, BAD),
    ] {
        h.ipcache(&format!("{addr}/32"), id, WORLD);
    }
    h.frontend(&format!("{FRONTEND}/32"));
    h.frontend("10.96.0.0/12");
    h.allow(PolicyKey::new(CLIENT, EGRESS, GOOD, TCP, 16, 8080));
    h.sync();
    Node { h, ns }
}

/// What the client sends to a frontend, from `sport`.
fn sent_to(frontend: &str, sport: u16, flags: u8) -> Vec<u8> {
    Packet::tcp(ip(CLIENT_IP), sport, ip(frontend), 80, flags).frame()
}

fn sent(sport: u16, flags: u8) -> Vec<u8> {
    sent_to(FRONTEND, sport, flags)
}

/// The client's packet after DNAT to `backend`:8080.
fn dnat(sport: u16, backend: &str) -> Vec<u8> {
    Packet::tcp(ip(CLIENT_IP), sport, ip(backend), 8080, TCP_SYN).frame()
}

/// A reply reaching the client, reverse-NATed to come from the frontend.
fn reply(sport: u16) -> Vec<u8> {
    Packet::tcp(ip(FRONTEND), 80, ip(CLIENT_IP), sport, TCP_SYN | TCP_ACK).frame()
}

fn pending() -> u32 {
    mark::pending(CLIENT_IF).unwrap()
}

fn counted(list: &[(Reason, u8)]) -> Vec<(Reason, u8)> {
    let mut v = list.to_vec();
    v.sort();
    v
}

fn run(verdict: Verdict, mark: u32, list: &[(Reason, u8)]) -> Run {
    Run {
        verdict,
        mark,
        counted: counted(list),
    }
}

fn bytes16(addr: &str) -> [u8; 16] {
    let mut b = [0u8; 16];
    match ip(addr) {
        IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => b = a.octets(),
    }
    b
}

impl Node {
    /// The client's conntrack entry for its flow to `frontend`:80.
    fn ct_to(&self, frontend: &str, sport: u16) -> Option<CtEntry> {
        let key = CtKey {
            ifindex: CLIENT_IF,
            local: bytes16(CLIENT_IP),
            remote: bytes16(frontend),
            local_port: sport,
            remote_port: 80,
            protocol: TCP,
            family: family::IPV4,
            opener: CT_OPENER_EITHER,
            _pad: 0,
        };
        self.h.dp.maps.conntrack.get(&key, 0).ok()
    }

    fn ct(&self, sport: u16) -> Option<CtEntry> {
        self.ct_to(FRONTEND, sport)
    }

    fn flow_key(sport: u16) -> ServiceFlowKey {
        ServiceFlowKey {
            ifindex: CLIENT_IF,
            src: bytes16(CLIENT_IP),
            sport,
            protocol: TCP,
            family: family::IPV4,
        }
    }

    /// The client's `SERVICE_FLOWS` entry for `sport`.
    fn flow(&self, sport: u16) -> Option<ServiceFlow> {
        let map = self.h.dp.ebpf.map("SERVICE_FLOWS").unwrap();
        let flows: BpfHashMap<_, ServiceFlowKey, ServiceFlow> = BpfHashMap::try_from(map).unwrap();
        flows.get(&Self::flow_key(sport), 0).ok()
    }

    /// Forgets the `SERVICE_FLOWS` entry, as an LRU eviction would.
    fn evict_flow(&mut self, sport: u16) {
        let map = self.h.dp.ebpf.map_mut("SERVICE_FLOWS").unwrap();
        let mut flows: BpfHashMap<_, ServiceFlowKey, ServiceFlow> =
            BpfHashMap::try_from(map).unwrap();
        flows.remove(&Self::flow_key(sport)).unwrap();
    }

    fn client_sends(&mut self, frame: &[u8], mark: u32) -> Run {
        self.h.run_at(Hook::Ingress, frame, CLIENT_IF, mark)
    }

    fn client_gets(&mut self, frame: &[u8]) -> Run {
        self.h.run_at(Hook::Egress, frame, CLIENT_IF, 0)
    }

    fn bump_client(&mut self) {
        self.h.state.endpoints.get_mut(&CLIENT_IF).unwrap().revision += 1;
        self.h.sync();
    }
}

#[test]
fn a_flow_to_a_frontend_is_deferred_with_the_mark() {
    let mut n = node("defer", ENDPOINT_EGRESS_ISOLATED);
    assert_eq!(
        n.client_sends(&sent(40000, TCP_SYN), 0),
        run(Verdict::Pass, pending(), &[(Reason::PassService, EGRESS)])
    );
    let ct = n.ct(40000).expect("the client's entry");
    assert_eq!(
        ct.flags & (CT_FLAG_SERVICE | CT_FLAG_PENDING),
        CT_FLAG_SERVICE | CT_FLAG_PENDING
    );
    let flow = n.flow(40000).expect("the service flow");
    assert_eq!((flow.frontend, flow.frontend_port), (bytes16(FRONTEND), 80));
    assert_eq!(flow.flags & SERVICE_FLOW_RESOLVED, 0);
    // An address of the Service range is a frontend too.
    let in_range = Packet::tcp(ip(CLIENT_IP), 40001, ip("10.100.7.7"), 80, TCP_SYN).frame();
    assert_eq!(
        n.client_sends(&in_range, 0).counted,
        counted(&[(Reason::PassService, EGRESS)])
    );
    // Still pending: the next packet is deferred again, a reply passes.
    assert_eq!(n.client_sends(&sent(40000, TCP_ACK), 0).mark, pending());
    assert_eq!(
        n.client_gets(&reply(40000)),
        run(Verdict::Pass, 0, &[(Reason::AllowReply, INGRESS)])
    );
    // Anything else is judged on the spot.
    let direct = Packet::tcp(ip(CLIENT_IP), 40002, ip(GOOD_IP), 8080, TCP_SYN).frame();
    assert_eq!(
        n.client_sends(&direct, 0),
        run(Verdict::Pass, 0, &[(Reason::AllowPolicy, EGRESS)])
    );
}

#[test]
fn only_egress_isolated_clients_are_deferred() {
    for (tag, flags) in [("noiso", 0), ("ingiso", ENDPOINT_INGRESS_ISOLATED)] {
        let mut n = node(tag, flags);
        assert_eq!(
            n.client_sends(&sent(40000, TCP_SYN), 0),
            run(Verdict::Pass, 0, &[(Reason::AllowNotIsolated, EGRESS)]),
            "{tag}"
        );
        assert!(n.flow(40000).is_none(), "{tag}");
    }
}

#[test]
fn an_allowed_backend_passes_and_the_client_is_established() {
    let mut n = node("allow", ENDPOINT_EGRESS_ISOLATED);
    let m = n.client_sends(&sent(40000, TCP_SYN), 0).mark;
    // At the backend's veth: the client's egress, then the backend's own
    // ingress.
    assert_eq!(
        n.h.run_at(Hook::Egress, &dnat(40000, GOOD_IP), BACKEND_IF, m),
        run(
            Verdict::Pass,
            0,
            &[
                (Reason::AllowPolicy, EGRESS),
                (Reason::AllowNotIsolated, INGRESS)
            ]
        )
    );
    let ct = n.ct(40000).unwrap();
    assert_eq!(ct.flags & CT_FLAG_PENDING, 0, "no longer pending");
    let flow = n.flow(40000).unwrap();
    assert_ne!(flow.flags & SERVICE_FLOW_RESOLVED, 0);
    assert_eq!((flow.backend, flow.backend_port), (bytes16(GOOD_IP), 8080));
    // Judged: still sent on with the mark (DNAT may choose anew), and
    // established on the backend it learnt.
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Pass, m, &[(Reason::PassService, EGRESS)])
    );
    assert_eq!(
        n.h.run_at(Hook::Egress, &dnat(40000, GOOD_IP), BACKEND_IF, m),
        run(
            Verdict::Pass,
            0,
            &[
                (Reason::AllowEstablished, EGRESS),
                (Reason::AllowNotIsolated, INGRESS)
            ]
        )
    );
    assert_eq!(
        n.client_gets(&reply(40000)),
        run(Verdict::Pass, 0, &[(Reason::AllowReply, INGRESS)])
    );
    // An established connection is not half-open (its lifetime is TCP's,
    // not a SYN's).
    assert_eq!(n.ct(40000).unwrap().flags & CT_FLAG_SYN_ONLY, 0);
}

/// A pod to its own Service (hairpin: kube-proxy chose the client itself
/// as the backend): traffic a pod sends to itself is allowed, whatever
/// its egress policy — as the iptables datapath passes it (its self rule
/// in FORWARD) and as a packet to its own address never leaves the pod.
#[test]
fn a_pod_through_its_own_service_is_self_traffic() {
    let mut n = node("self", ENDPOINT_EGRESS_ISOLATED);
    let m = n.client_sends(&sent(40000, TCP_SYN), 0).mark;
    assert_eq!(m, pending());
    let back_to_itself = dnat(40000, CLIENT_IP);
    let r = n.h.run_at(Hook::Egress, &back_to_itself, CLIENT_IF, m);
    assert_eq!(r.verdict, Verdict::Pass, "{r:?}");
    assert!(r.counted.contains(&(Reason::AllowSelf, EGRESS)), "{r:?}");
    // Judged: the flow learnt its backend, itself.
    let flow = n.flow(40000).unwrap();
    assert_ne!(flow.flags & SERVICE_FLOW_RESOLVED, 0);
    assert_eq!(flow.backend, bytes16(CLIENT_IP));
    // Another backend the policy denies is still denied.
    let m = n.client_sends(&sent(40001, TCP_SYN), 0).mark;
    assert_eq!(
        n.h.run_at(Hook::Egress, &dnat(40001, BAD_IP), BAD_IF, m)
            .verdict,
        Verdict::Drop
    );
}

#[test]
fn a_denied_backend_drops_and_the_client_entry_is_gone() {
    let mut n = node("deny", ENDPOINT_EGRESS_ISOLATED);
    let mut ring = RingBuf::try_from(n.h.dp.ebpf.take_map("DROP_EVENTS").unwrap()).unwrap();
    let m = n.client_sends(&sent(40000, TCP_SYN), 0).mark;
    // The backend's own ingress is not even judged.
    assert_eq!(
        n.h.run_at(Hook::Egress, &dnat(40000, BAD_IP), BAD_IF, m),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
    assert!(n.ct(40000).is_none());
    assert!(n.flow(40000).is_none());
    let item = ring.next().expect("a drop event");
    let ev: FlowRecord = *bytemuck::from_bytes(&item[..std::mem::size_of::<FlowRecord>()]);
    assert_eq!((ev.ifindex, ev.endpoint_identity), (CLIENT_IF, CLIENT));
    assert_eq!((ev.peer_identity, ev.direction), (BAD, EGRESS));
    assert_eq!(ev.reason, Reason::DropPolicy as u8);
    assert_eq!(ev.dst, bytes16(BAD_IP));
    drop(item);
    // The next packet is a new flow: deferred again.
    assert_eq!(n.client_sends(&sent(40000, TCP_ACK), 0).mark, pending());
    // A mark naming an interface without an endpoint cannot be judged.
    let stranger = mark::pending(UPLINK_IF).unwrap();
    assert_eq!(
        n.h.run_at(Hook::Egress, &dnat(40000, GOOD_IP), BACKEND_IF, stranger),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
}

#[test]
fn the_uplink_judges_a_remote_backend() {
    let mut n = node("uplink", ENDPOINT_EGRESS_ISOLATED);
    let m = n.client_sends(&sent(40000, TCP_SYN), 0).mark;
    assert_eq!(
        n.h.run_at(Hook::Uplink, &dnat(40000, REMOTE_GOOD), UPLINK_IF, m),
        run(Verdict::Pass, 0, &[(Reason::AllowPolicy, EGRESS)])
    );
    assert_eq!(n.ct(40000).unwrap().flags & CT_FLAG_PENDING, 0);
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Pass, m, &[(Reason::PassService, EGRESS)])
    );
    assert_eq!(
        n.h.run_at(Hook::Uplink, &dnat(40000, REMOTE_GOOD), UPLINK_IF, m),
        run(Verdict::Pass, 0, &[(Reason::AllowEstablished, EGRESS)])
    );
    // A judged flow DNAT sends elsewhere (kube-proxy deleted a UDP flow's
    // conntrack entry when its endpoint left): judged there.
    assert_eq!(
        n.h.run_at(Hook::Uplink, &dnat(40000, REMOTE_BAD), UPLINK_IF, m),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
    assert!(n.ct(40000).is_none() && n.flow(40000).is_none());
    let m = n.client_sends(&sent(40001, TCP_SYN), 0).mark;
    assert_eq!(
        n.h.run_at(Hook::Uplink, &dnat(40001, REMOTE_BAD), UPLINK_IF, m),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
    assert!(n.ct(40001).is_none() && n.flow(40001).is_none());
}

#[test]
fn unmarked_packets_pass_the_uplink_untouched() {
    let mut n = node("unmarked", ENDPOINT_EGRESS_ISOLATED);
    // Our interface bits without the pending bit are no mark of ours.
    for m in [0, FOREIGN, FOREIGN | (0x1234 << mark::IFINDEX_SHIFT)] {
        assert_eq!(
            n.h.run_at(Hook::Uplink, &dnat(40000, REMOTE_BAD), UPLINK_IF, m),
            run(Verdict::Pass, m, &[]),
            "mark {m:#x}"
        );
    }
    // Not IP: nothing to judge; a mark of ours on it is cleared.
    let arp = policy_testbed::packet::ethernet(0x0806, &[0u8; 28]);
    assert_eq!(
        n.h.run_at(Hook::Uplink, &arp, UPLINK_IF, FOREIGN | pending()),
        run(Verdict::Pass, FOREIGN, &[])
    );
}

#[test]
fn foreign_mark_bits_survive() {
    let mut n = node("foreign", ENDPOINT_EGRESS_ISOLATED);
    // Our bits, set by someone else, are replaced; the rest kept.
    let stray = FOREIGN | mark::pending(mark::IFINDEX_MASK).unwrap();
    let out = n.client_sends(&sent(40000, TCP_SYN), stray);
    assert_eq!(out.mark, FOREIGN | pending());
    let at_backend =
        n.h.run_at(Hook::Egress, &dnat(40000, GOOD_IP), BACKEND_IF, out.mark);
    assert_eq!(at_backend.mark, FOREIGN);
    let out = n.client_sends(&sent(40001, TCP_SYN), FOREIGN);
    assert_eq!(out.mark, FOREIGN | pending());
    let at_uplink =
        n.h.run_at(Hook::Uplink, &dnat(40001, REMOTE_GOOD), UPLINK_IF, out.mark);
    assert_eq!(
        (at_uplink.verdict, at_uplink.mark),
        (Verdict::Pass, FOREIGN)
    );
    // Judged here and not deferred: the mark is left as it came.
    let direct = Packet::tcp(ip(CLIENT_IP), 40002, ip(GOOD_IP), 8080, TCP_SYN).frame();
    assert_eq!(n.client_sends(&direct, FOREIGN).mark, FOREIGN);
    let to_client = n.h.run_at(Hook::Egress, &reply(40000), CLIENT_IF, FOREIGN);
    assert_eq!(to_client.mark, FOREIGN);
}

#[test]
fn a_stale_revision_rejudges_against_the_resolved_backend() {
    let mut n = node("stale", ENDPOINT_EGRESS_ISOLATED);
    for sport in [40000, 40001] {
        let m = n.client_sends(&sent(sport, TCP_SYN), 0).mark;
        n.h.run_at(Hook::Egress, &dnat(sport, GOOD_IP), BACKEND_IF, m);
    }
    // Still allowed under the new revision: on to DNAT.
    n.bump_client();
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Pass, pending(), &[(Reason::PassService, EGRESS)])
    );
    assert_eq!(n.ct(40000).unwrap().revision, 2);
    // The backend is denied now: cut both ways, entries gone.
    n.h.state.policy.clear();
    n.bump_client();
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Drop, 0, &[(Reason::DropPolicyChanged, EGRESS)])
    );
    assert!(n.ct(40000).is_none() && n.flow(40000).is_none());
    assert_eq!(
        n.client_gets(&reply(40001)),
        run(Verdict::Drop, 0, &[(Reason::DropPolicyChanged, INGRESS)])
    );
    assert!(n.ct(40001).is_none() && n.flow(40001).is_none());
}

#[test]
fn a_flow_whose_backend_is_unknown_is_judged_after_dnat_again() {
    let mut n = node("unknown", ENDPOINT_EGRESS_ISOLATED);
    // The verdict never came back (the marked packet went nowhere a hook
    // sees), and the revision moved.
    let m = n.client_sends(&sent(40000, TCP_SYN), 0).mark;
    n.bump_client();
    assert_eq!(
        n.client_gets(&reply(40000)),
        run(Verdict::Pass, 0, &[(Reason::AllowReply, INGRESS)])
    );
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Pass, m, &[(Reason::PassService, EGRESS)])
    );
    assert_ne!(n.ct(40000).unwrap().flags & CT_FLAG_PENDING, 0);
    // Judged, then the backend forgotten (evicted) and the revision moved:
    // a reply passes, what the client sends is judged after DNAT again.
    n.h.run_at(Hook::Egress, &dnat(40000, GOOD_IP), BACKEND_IF, m);
    n.evict_flow(40000);
    n.bump_client();
    assert_eq!(
        n.client_gets(&reply(40000)),
        run(Verdict::Pass, 0, &[(Reason::AllowReply, INGRESS)])
    );
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Pass, m, &[(Reason::PassService, EGRESS)])
    );
    assert_eq!(
        n.h.run_at(Hook::Egress, &dnat(40000, BAD_IP), BAD_IF, m),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
    assert!(n.ct(40000).is_none());
}

#[test]
fn a_client_beyond_the_marks_range_is_refused() {
    let mut n = node("big", ENDPOINT_EGRESS_ISOLATED);
    let big = n.ns.device("big", mark::IFINDEX_MASK + 1);
    n.h.endpoint_at(big, CLIENT, ENDPOINT_EGRESS_ISOLATED, 1, &[ip(CLIENT_IP)]);
    n.h.sync();
    assert_eq!(
        n.h.run_at(Hook::Ingress, &sent(40000, TCP_SYN), big, FOREIGN),
        run(Verdict::Drop, FOREIGN, &[(Reason::DropPolicy, EGRESS)])
    );
    assert_eq!(n.h.dp.maps.conntrack.keys().count(), 0);
}

/// Two flows from one source port to two frontends look alike after DNAT:
/// the verdict on one must not decide the other.
#[test]
fn a_verdict_after_dnat_lands_only_on_its_own_flow() {
    let mut n = node("collide", ENDPOINT_EGRESS_ISOLATED);
    // A flow to the frontend whose backend is allowed; its first packet
    // never reaches a hook after DNAT (a TTL of 1, an MTU too small).
    let good = sent_to(FRONTEND, 5000, TCP_SYN);
    let bad = sent_to(OTHER_FRONTEND, 5000, TCP_SYN);
    let m = n.client_sends(&good, 0).mark;
    // Another frontend from the same port, while the first lives: refused.
    assert_eq!(
        n.client_sends(&bad, 0),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
    // The first flow's verdict is its own.
    n.h.run_at(Hook::Egress, &dnat(5000, GOOD_IP), BACKEND_IF, m);
    assert!(n.ct_to(OTHER_FRONTEND, 5000).is_none());
    assert_eq!(n.client_sends(&bad, 0).verdict, Verdict::Drop);

    // The key forgotten (evicted) while the first flow waits: a second
    // frontend takes it; the first flow's packets then are new, refused
    // while the second lives, and never decide the second.
    let good = sent_to(FRONTEND, 6000, TCP_SYN);
    let bad = sent_to(OTHER_FRONTEND, 6000, TCP_SYN);
    n.client_sends(&good, 0);
    n.evict_flow(6000);
    assert_eq!(n.client_sends(&bad, 0).mark, m);
    assert_eq!(
        n.client_sends(&good, 0),
        run(Verdict::Drop, 0, &[(Reason::DropPolicy, EGRESS)])
    );
    assert!(n.ct_to(FRONTEND, 6000).is_none());
    let flow = n.flow(6000).unwrap();
    assert_eq!(flow.frontend, bytes16(OTHER_FRONTEND));
    let again = n.client_sends(&bad, 0);
    assert_eq!(
        (again.verdict, again.mark),
        (Verdict::Pass, m),
        "still pending"
    );
}

/// An ICMP error about a service flow, after a policy change: judged
/// against the backend, not the frontend's own address.
#[test]
fn an_icmp_error_about_a_stale_flow_is_judged_against_the_backend() {
    let mut n = node("related", ENDPOINT_EGRESS_ISOLATED);
    // The frontend's address (world) may be reached on port 80.
    let world = PolicyKey::new(CLIENT, EGRESS, WORLD, TCP, 16, 80);
    n.h.allow(world);
    n.h.sync();
    let m = n.client_sends(&sent(40000, TCP_SYN), 0).mark;
    n.h.run_at(Hook::Egress, &dnat(40000, GOOD_IP), BACKEND_IF, m);
    let quoted = Packet::tcp(ip(CLIENT_IP), 40000, ip(FRONTEND), 80, TCP_SYN);
    let error = Packet::new(
        ip("192.0.2.1"),
        ip(CLIENT_IP),
        L4::Unreachable {
            quoted: Box::new(quoted),
        },
    )
    .frame();
    assert_eq!(
        n.client_gets(&error),
        run(Verdict::Pass, 0, &[(Reason::AllowRelated, INGRESS)])
    );
    n.h.state.policy.retain(|k, _| *k == world);
    n.bump_client();
    assert_eq!(
        n.client_gets(&error),
        run(Verdict::Drop, 0, &[(Reason::DropPolicyChanged, INGRESS)])
    );
    assert_eq!(
        n.client_sends(&sent(40000, TCP_ACK), 0),
        run(Verdict::Pass, m, &[(Reason::PassService, EGRESS)])
    );
}
