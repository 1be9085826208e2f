//! The differential test for Services: a client pod, a backend pod and an
//! uplink in a namespace of their own (BPF_PROG_TEST_RUN takes the
//! interface and the mark from the context), random frontends, and
//! packets that follow a flow the way the node would carry it: the
//! client's packet to a frontend (deferred, leaving with the mark), the
//! same packet after DNAT at the backend's veth or the uplink with the
//! mark it left with (or another), replies from the frontend, ICMP errors
//! quoting service flows, SERVICE_FLOWS entries evicted, policy changes.
//! At every hook the kernel's verdict, every verdict counter that moved
//! and the mark it leaves with must equal the model's.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    identity::{ANY, FIRST_CIDR, WORLD},
    model::{Datapath, ServiceKey},
    policy::PolicyKey,
    proto,
    service::{ServiceFlowKey, mark},
};
use policy_testbed::packet::{L4, Packet, TCP_ACK, TCP_SYN};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::IndexedRandom};

use super::{RecordCheck, Seen, number_rules, pod_v4, pod_v6, records_unlimited, to_model_at};
use policy_testbed::fixtures::{
    harness::{Harness, Verdict, hook_direction},
    testns::TestNs,
};

const CLIENT_IF: u32 = 10;
const BACKEND_IF: u32 = 11;
const UPLINK_IF: u32 = 12;
/// A device with no endpoint: a mark naming it names a client gone.
const GONE_IF: u32 = 13;
const CLIENT: u32 = 300;
const BACKEND: u32 = 301;
const REMOTE: u32 = 302;
/// Mark bits that are not ours (kube-proxy's masquerade bit among them).
const FOREIGN: u32 = 0x4000;
/// Few ports, so flows to two frontends from one source port happen.
const SPORTS: [u16; 3] = [30000, 30001, 30002];
const FRONT_PORTS: [u16; 3] = [53, 80, 443];
const BACKEND_PORTS: [u16; 4] = [53, 80, 8080, 8443];

fn backend_v4() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 1, 1))
}
fn backend_v6() -> IpAddr {
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 1, 0, 0, 0, 1))
}

/// Frontend candidates: in SERVICES or not, as the round draws.
fn frontends(v6: bool) -> Vec<IpAddr> {
    let v: &[&str] = if v6 {
        &["fd00:96::a", "fd00:96::b", "fd00:97::1:5"]
    } else {
        &["10.96.0.10", "10.96.0.11", "10.97.3.4", "192.168.0.1"]
    };
    v.iter().map(|s| s.parse().unwrap()).collect()
}

/// Where DNAT may send a flow: the local backend pod, pods on other
/// nodes, the world.
fn backends(v6: bool) -> Vec<IpAddr> {
    let v: &[&str] = if v6 {
        &["fd00:0:0:1::1", "fd00:0:0:2::7", "2001:db8::1"]
    } else {
        &["10.0.1.1", "10.1.1.7", "10.1.2.7", "203.0.113.5"]
    };
    v.iter().map(|s| s.parse().unwrap()).collect()
}

fn random_state(h: &mut Harness, rng: &mut StdRng) {
    h.state = Default::default();
    let flags = [
        0,
        ENDPOINT_INGRESS_ISOLATED,
        ENDPOINT_EGRESS_ISOLATED,
        ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED,
    ];
    // The client mostly isolated for egress: the case Services change.
    let client_flags = if rng.random_bool(0.8) {
        ENDPOINT_EGRESS_ISOLATED | *flags.choose(rng).unwrap()
    } else {
        *flags.choose(rng).unwrap()
    };
    h.endpoint_at(CLIENT_IF, CLIENT, client_flags, 1, &[pod_v4(), pod_v6()]);
    h.endpoint_at(
        BACKEND_IF,
        BACKEND,
        *flags.choose(rng).unwrap(),
        1,
        &[backend_v4(), backend_v6()],
    );
    h.ipcache("10.0.0.10/32", CLIENT, WORLD);
    h.ipcache("fd00::10/128", CLIENT, WORLD);
    h.ipcache("10.0.1.1/32", BACKEND, WORLD);
    h.ipcache("fd00:0:0:1::1/128", BACKEND, WORLD);
    for (net, id) in [
        ("10.1.1.0/24", REMOTE),
        ("10.1.2.0/24", BACKEND),
        ("fd00:0:0:2::/64", REMOTE),
        ("10.96.0.0/12", ANY),
    ] {
        if rng.random_bool(0.7) {
            h.ipcache(net, id, *[FIRST_CIDR, WORLD].choose(rng).unwrap());
        }
    }
    for net in [
        "10.96.0.10/32",
        "10.96.0.11/32",
        "10.97.0.0/16",
        "192.168.0.1/32",
        "fd00:96::/112",
        "fd00:97::/32",
    ] {
        if rng.random_bool(0.6) {
            h.frontend(net);
        }
    }
    let peers = [CLIENT, BACKEND, REMOTE, WORLD, FIRST_CIDR, ANY];
    for _ in 0..rng.random_range(4..20) {
        let (ep, dir) = if rng.random_bool(0.75) {
            (CLIENT, direction::EGRESS)
        } else if rng.random_bool(0.5) {
            (BACKEND, direction::INGRESS)
        } else {
            (
                *[CLIENT, BACKEND].choose(rng).unwrap(),
                *[direction::INGRESS, direction::EGRESS].choose(rng).unwrap(),
            )
        };
        let protocol = *[proto::TCP, proto::UDP, proto::SCTP].choose(rng).unwrap();
        let port = *BACKEND_PORTS
            .iter()
            .chain(&FRONT_PORTS)
            .collect::<Vec<_>>()
            .choose(rng)
            .unwrap();
        let len = *[16u8, 16, 0].choose(rng).unwrap();
        h.allow(PolicyKey::new(
            ep,
            dir,
            *peers.choose(rng).unwrap(),
            protocol,
            len,
            *port,
        ));
    }
    number_rules(h);
    h.sync();
}

fn random_ports(rng: &mut StdRng) -> L4 {
    let sport = *SPORTS.choose(rng).unwrap();
    let dport = *FRONT_PORTS.choose(rng).unwrap();
    match rng.random_range(0..6) {
        0..=2 => L4::Tcp {
            sport,
            dport,
            flags: *[TCP_SYN, TCP_SYN, TCP_ACK].choose(rng).unwrap(),
        },
        3 | 4 => L4::Udp { sport, dport },
        _ => L4::Sctp { sport, dport },
    }
}

/// `p` with its destination rewritten by DNAT.
fn dnat(p: &Packet, to: IpAddr, port: u16) -> Packet {
    let l4 = match &p.l4 {
        L4::Tcp { sport, flags, .. } => L4::Tcp {
            sport: *sport,
            dport: port,
            flags: *flags,
        },
        L4::Udp { sport, .. } => L4::Udp {
            sport: *sport,
            dport: port,
        },
        L4::Sctp { sport, .. } => L4::Sctp {
            sport: *sport,
            dport: port,
        },
        other => other.clone(),
    };
    Packet::new(p.src, to, l4)
}

/// A client packet the node carried on: what the client sent and the
/// mark it left with.
struct Sent {
    pkt: Packet,
    mark: u32,
}

/// The next packet, the hook and interface it crosses and its mark.
fn next_packet(rng: &mut StdRng, sent: &[Sent]) -> (Packet, Hook, u32, u32) {
    let earlier = sent.choose(rng);
    match (rng.random_range(0..10), earlier) {
        // After DNAT, with the mark the client's packet left with (or a
        // stray one), at the backend's veth or the uplink.
        (0..=2, Some(s)) => {
            let v6 = s.pkt.src.is_ipv6();
            let mut to = *backends(v6).choose(rng).unwrap();
            if rng.random_bool(0.2) {
                to = s.pkt.dst;
            }
            let port = if rng.random_bool(0.2) {
                match &s.pkt.l4 {
                    L4::Tcp { dport, .. } | L4::Udp { dport, .. } | L4::Sctp { dport, .. } => {
                        *dport
                    }
                    _ => 80,
                }
            } else {
                *BACKEND_PORTS.choose(rng).unwrap()
            };
            let mut m = s.mark;
            if rng.random_bool(0.1) {
                m = [
                    mark::pending(BACKEND_IF).unwrap(),
                    mark::pending(GONE_IF).unwrap(),
                    FOREIGN,
                    0,
                ]
                .choose(rng)
                .copied()
                .unwrap();
            }
            let local = to == backend_v4() || to == backend_v6();
            let (hook, ifindex) = if local && rng.random_bool(0.9) {
                (Hook::Egress, BACKEND_IF)
            } else {
                (Hook::Uplink, UPLINK_IF)
            };
            (dnat(&s.pkt, to, port), hook, ifindex, m)
        }
        // A reply reaching the client, from where it sent (un-DNATed).
        (3 | 4, Some(s)) => {
            let (p, _) = super::reply(&s.pkt, Hook::Ingress);
            (p, Hook::Egress, CLIENT_IF, 0)
        }
        // An ICMP error about a client's packet, back to the client.
        (5, Some(s)) => {
            let from = *backends(s.pkt.src.is_ipv6()).choose(rng).unwrap();
            let p = Packet::new(
                from,
                s.pkt.src,
                L4::Unreachable {
                    quoted: Box::new(s.pkt.clone()),
                },
            );
            (p, Hook::Egress, CLIENT_IF, 0)
        }
        // The client sends again on a flow (its next segment).
        (6 | 7, Some(s)) => {
            let mut p = s.pkt.clone();
            if let L4::Tcp { flags, .. } = &mut p.l4 {
                *flags = *[TCP_ACK, TCP_ACK, TCP_SYN].choose(rng).unwrap();
            }
            (p, Hook::Ingress, CLIENT_IF, 0)
        }
        // A new flow of the client, mostly to a frontend.
        _ => {
            let v6 = rng.random_bool(0.3);
            let dst = if rng.random_bool(0.8) {
                *frontends(v6).choose(rng).unwrap()
            } else {
                *backends(v6).choose(rng).unwrap()
            };
            let src = if v6 { pod_v6() } else { pod_v4() };
            let m = if rng.random_bool(0.2) { FOREIGN } else { 0 };
            (
                Packet::new(src, dst, random_ports(rng)),
                Hook::Ingress,
                CLIENT_IF,
                m,
            )
        }
    }
}

/// Forgets one service flow's SERVICE_FLOWS entry in both, as an LRU
/// eviction would.
fn evict(h: &mut Harness, model: &mut Datapath, rng: &mut StdRng) {
    let keys: Vec<ServiceKey> = model.services.keys().copied().collect();
    let Some(key) = keys.choose(rng).copied() else {
        return;
    };
    model.services.remove(&key);
    let (src, family) = match key.src {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            (b, policy_common::family::IPV4)
        }
        IpAddr::V6(a) => (a.octets(), policy_common::family::IPV6),
    };
    let map = h.dp.ebpf.map_mut("SERVICE_FLOWS").unwrap();
    let mut flows: aya::maps::HashMap<_, ServiceFlowKey, policy_common::service::ServiceFlow> =
        aya::maps::HashMap::try_from(map).unwrap();
    flows
        .remove(&ServiceFlowKey {
            ifindex: key.ifindex,
            src,
            sport: key.sport,
            protocol: key.protocol,
            family,
        })
        .expect("the model's service flow is in SERVICE_FLOWS");
}

pub fn run_seed(
    seed: u64,
    packets: usize,
    seen: &mut Seen,
    record_check: &mut RecordCheck,
) -> usize {
    let _ns = {
        let ns = TestNs::enter(&format!("svc{seed}"));
        for (name, ifindex) in [
            ("client", CLIENT_IF),
            ("backend", BACKEND_IF),
            ("uplink", UPLINK_IF),
            ("gone", GONE_IF),
        ] {
            ns.device(name, ifindex);
        }
        ns
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut h = Harness::new();
    random_state(&mut h, &mut rng);
    let mut model = Datapath::new(h.state.to_model(|k| *k));
    let mut records = records_unlimited(&h);
    let mut sent: Vec<Sent> = Vec::new();
    let mut clock = super::HeldClock::new();
    for i in 0..packets {
        clock.hold(&mut h, &mut model);
        if i % 100 == 99 {
            // The policy changes under live flows.
            let keys: Vec<PolicyKey> = h.state.policy.keys().copied().collect();
            for k in keys {
                if rng.random_bool(0.4) {
                    h.state.policy.remove(&k);
                }
            }
            for ifindex in [CLIENT_IF, BACKEND_IF] {
                h.state.endpoints.get_mut(&ifindex).unwrap().revision += 1;
            }
            number_rules(&mut h);
            h.sync();
            model.maps = h.state.to_model(|k| *k);
        }
        if rng.random_bool(0.03) {
            evict(&mut h, &mut model, &mut rng);
        }
        let (pkt, hook, ifindex, m) = next_packet(&mut rng, &sent);
        let mp = to_model_at(&pkt, hook, ifindex, m);
        let want = if hook == Hook::Uplink {
            model.uplink(&mp)
        } else {
            model.classify(&mp)
        };
        let got = h.run_at(hook, &pkt.frame(), ifindex, m);
        let mut counted: Vec<_> = want
            .after_dnat
            .map(|j| (j.reason, direction::EGRESS))
            .into_iter()
            .chain(want.judgement.map(|j| (j.reason, hook_direction(hook))))
            .collect();
        counted.sort();
        counted.dedup();
        let verdict = if want.passes() {
            Verdict::Pass
        } else {
            Verdict::Drop
        };
        assert_eq!(
            (got.verdict, got.mark, &got.counted),
            (verdict, want.mark, &counted),
            "seed {seed}, packet {i}: {pkt:?} at {hook:?} of {ifindex}, mark {m:#x}\nmodel: {want:?}\nflows: {:#?}\nservices: {:#?}\nmaps: {:#?}",
            model.flows,
            model.services,
            h.state
        );
        let pod_hook = hook != Hook::Uplink;
        record_check.check(
            &mut records,
            &super::wanted(&model, &mp, &want, pod_hook),
            || {
                format!(
                    "seed {seed}, packet {i}: {pkt:?} at {hook:?} of {ifindex}, mark {m:#x}\nmodel: {want:?}\nflows: {:#?}",
                    model.flows
                )
            },
        );
        for (reason, _) in &counted {
            *seen.entry(*reason).or_default() += 1;
        }
        if hook == Hook::Ingress && ifindex == CLIENT_IF {
            sent.push(Sent {
                pkt,
                mark: want.mark,
            });
        }
    }
    super::assert_no_record_lost(&h, seed);
    packets
}
