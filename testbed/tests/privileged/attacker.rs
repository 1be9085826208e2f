//! An attacker pod on the simulated node, with raw sockets: spoofed
//! sources, forged replies, ICMP errors quoting real flows, segments of no
//! connection, overlapping fragments, src = dst, long IPv6 header chains.
//! Every case is judged where it would land: a capture on the victim's
//! interface counts what arrived, never the sender's errors. Each runs on
//! both datapaths where the datapath has the defence. Needs root.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use policy_testbed::fixtures::{
    conformance::{Backend, Conformance, NsSpec, PodSpec, labels},
    deadline::scaled,
    raw::send_raw,
};
use policy_testbed::{
    NetNs, Outcome, connect, echo,
    packet::{Fragment, L4, Packet, TCP_ACK, TCP_SYN},
};
use socket2::{Domain, Protocol, Socket, Type};

const ATTACKER: &str = "t/attacker";
const VICTIM: &str = "t/victim";
const TRUSTED: &str = "t/trusted";

fn pod(name: &str, i: u8) -> PodSpec {
    let ports = vec![("data".into(), 9000, "UDP"), ("web".into(), 9001, "TCP")];
    PodSpec::numbered("t", name, 9, i, ports)
}

/// The victim takes UDP 9000 and TCP 9001 from the trusted pod only; the
/// attacker may send anywhere (its egress is not isolated).
fn setup(prefix: &'static str, backend: Backend) -> Conformance {
    let c = Conformance::with_cluster(
        prefix,
        backend,
        vec![NsSpec {
            name: "t".into(),
            labels: labels(&[("team", "t")]),
        }],
        vec![pod("attacker", 11), pod("victim", 12), pod("trusted", 13)],
    );
    c.write_policies(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: victim, namespace: t}\nspec:\n  podSelector: {matchLabels: {app: victim}}\n  ingress:\n    - from: [{podSelector: {matchLabels: {app: trusted}}}]\n      ports: [{protocol: UDP, port: 9000}, {protocol: TCP, port: 9001}]\n",
    );
    c.apply_ok();
    c
}

/// What a packet captured at the victim is: source, destination.
fn endpoints(ip: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match ip.first()? >> 4 {
        4 if ip.len() >= 20 => Some((
            IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?),
            IpAddr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?),
        )),
        6 if ip.len() >= 40 => Some((
            IpAddr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?),
            IpAddr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?),
        )),
        _ => None,
    }
}

/// Runs `send` while capturing on the victim's interface; returns the
/// packets from `from` to `to` that arrived there.
fn arrived(victim: &NetNs, from: IpAddr, to: IpAddr, send: impl FnOnce()) -> usize {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let capture = victim
        .spawn(move || {
            // AF_PACKET, SOCK_DGRAM: every IP packet that reaches this
            // namespace's interfaces, link header removed.
            let s = Socket::new(
                Domain::PACKET,
                Type::DGRAM,
                Some(Protocol::from(i32::from(0x0003u16.to_be()))),
            )
            .unwrap();
            s.set_nonblocking(true).unwrap();
            ready_tx.send(()).unwrap();
            let mut n = 0;
            let mut buf = [0u8; 2048];
            let mut until: Option<Instant> = None;
            loop {
                if until.is_none() && stop_rx.try_recv().is_ok() {
                    // Let late packets land.
                    until = Some(Instant::now() + scaled(Duration::from_millis(300)));
                }
                if until.is_some_and(|u| Instant::now() >= u) {
                    return n;
                }
                // SAFETY: buf is writable for its length.
                let len =
                    unsafe { libc::recv(s.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if len <= 0 {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                if endpoints(&buf[..len as usize]) == Some((from, to)) {
                    n += 1;
                }
            }
        })
        .unwrap();
    ready_rx.recv().unwrap();
    send();
    stop_tx.send(()).unwrap();
    capture.join().unwrap().unwrap()
}

fn udp(src: IpAddr, dst: IpAddr, dport: u16) -> Packet {
    Packet::udp(src, 40000, dst, dport)
}

fn suite(prefix: &'static str, backend: Backend) {
    let c = setup(prefix, backend);
    let node = c.node();
    let ns = |id: &str| &node.pod(id).unwrap().netns;
    let (attacker, victim_ns, trusted_ns) = (ns(ATTACKER), ns(VICTIM), ns(TRUSTED));
    for v6 in [false, true] {
        let fam = if v6 { "IPv6" } else { "IPv4" };
        let (a, v, t) = (
            c.pod_ip(ATTACKER, v6),
            c.pod_ip(VICTIM, v6),
            c.pod_ip(TRUSTED, v6),
        );

        // The capture works: what the policy allows arrives.
        let n = arrived(victim_ns, t, v, || {
            send_raw(trusted_ns, vec![udp(t, v, 9000)])
        });
        assert!(n >= 1, "{fam}: the trusted pod's datagram must arrive");

        // 1. The attacker claims the trusted pod's address.
        let n = arrived(victim_ns, t, v, || {
            send_raw(attacker, vec![udp(t, v, 9000)]);
        });
        assert_eq!(n, 0, "{fam}: a spoofed source reached the victim");

        // 2. src = dst: the victim's own address, sent by the attacker.
        let n = arrived(victim_ns, v, v, || {
            send_raw(attacker, vec![udp(v, v, 9000)])
        });
        assert_eq!(n, 0, "{fam}: src = dst reached the victim");

        // 3. Segments of no connection, and a forged reply to the trusted
        //    pod's flow (the victim answered it; the attacker poses as it).
        let n = arrived(victim_ns, a, v, || {
            send_raw(
                attacker,
                vec![
                    Packet::tcp(a, 40001, v, 9001, TCP_ACK),
                    Packet::tcp(a, 40002, v, 9001, TCP_SYN | TCP_ACK),
                    Packet::tcp(a, 40003, v, 9001, TCP_SYN),
                ],
            );
        });
        assert_eq!(n, 0, "{fam}: segments from the attacker reached the victim");
        send_raw(trusted_ns, vec![Packet::tcp(t, 41000, v, 9001, TCP_SYN)]);
        let n = arrived(victim_ns, t, v, || {
            send_raw(attacker, vec![Packet::tcp(t, 41000, v, 9001, TCP_ACK)]);
        });
        assert_eq!(n, 0, "{fam}: a forged segment of a real flow arrived");

        // 4. ICMP errors quoting the victim's real flow, sent to the victim
        //    but not back to the quoted packet's sender, and an error
        //    quoting someone else's flow.
        let real = Packet::udp(t, 40000, v, 9000);
        let other = Packet::udp(a, 5, t, 9000);
        let n = arrived(victim_ns, a, v, || {
            send_raw(
                attacker,
                [real, other]
                    .into_iter()
                    .map(|q| {
                        Packet::new(
                            a,
                            v,
                            L4::Unreachable {
                                quoted: Box::new(q),
                            },
                        )
                    })
                    .collect(),
            );
        });
        assert_eq!(
            n, 0,
            "{fam}: an ICMP error about a real flow reached the victim"
        );

        // 5. Overlapping fragments: an allowed first fragment from the
        //    trusted pod, a second first fragment to a closed port.
        let frag = |dport, offset, more| {
            let mut p = udp(t, v, dport);
            p.fragment = Some(Fragment {
                id: 0x4242,
                offset,
                more,
            });
            p
        };
        let n = arrived(victim_ns, t, v, || {
            send_raw(trusted_ns, vec![frag(9002, 0, true)]);
        });
        assert_eq!(n, 0, "{fam}: a first fragment to a closed port arrived");
        let n = arrived(victim_ns, a, v, || {
            let mut later = udp(a, v, 9000);
            later.fragment = Some(Fragment {
                id: 0x4343,
                offset: 1,
                more: false,
            });
            send_raw(attacker, vec![later]);
        });
        assert_eq!(n, 0, "{fam}: a later fragment without its first arrived");

        // 6. Header chains (IPv6): six extension headers in front of an
        //    allowed datagram still arrive from the trusted pod; from the
        //    attacker nothing does.
        if v6 {
            let mut p = udp(t, v, 9000);
            p.ipv6_ext_headers = 6;
            let n = arrived(victim_ns, t, v, || send_raw(trusted_ns, vec![p]));
            assert!(n >= 1, "six extension headers before an allowed datagram");
            let mut p = udp(a, v, 9000);
            p.ipv6_ext_headers = 6;
            let n = arrived(victim_ns, a, v, || send_raw(attacker, vec![p]));
            assert_eq!(n, 0, "a header chain from the attacker arrived");
        }
    }
}

#[test]
fn an_attacker_pod_reaches_nothing_its_victims_policy_forbids_bpf() {
    suite("atkb", Backend::Bpf);
}

#[test]
fn an_attacker_pod_reaches_nothing_its_victims_policy_forbids_iptables() {
    suite("atki", Backend::Iptables);
}

/// A connection a policy change cut stays cut when the victim speaks
/// first after the change (a delayed ACK, a retransmission; here data its
/// server writes): that segment must not reopen the flow in the victim's
/// name (its egress is open), or the trusted pod's next segments would
/// pass as its replies.
/// Both datapaths had this hole: the BPF conntrack opened an entry for
/// the victim's segment, the kernel's conntrack picked the deleted flow up
/// again in the victim's name.
fn a_cut_connection_stays_cut(prefix: &'static str, backend: Backend) {
    let c = setup(prefix, backend);
    let node = c.node();
    let ns = |id: &str| &node.pod(id).unwrap().netns;
    let (victim_ns, trusted_ns) = (ns(VICTIM), ns(TRUSTED));
    let mut open = Vec::new();
    for v6 in [false, true] {
        let (v, t) = (c.pod_ip(VICTIM, v6), c.pod_ip(TRUSTED, v6));
        // The victim's server: a listener made in its namespace (the
        // socket stays there), answered from here.
        let listener = victim_ns
            .spawn(move || std::net::TcpListener::bind(SocketAddr::new(v, 9001)))
            .unwrap()
            .join()
            .unwrap()
            .unwrap()
            .unwrap();
        // It greets (as the simulated servers do), then echoes once.
        let answer = std::thread::spawn(move || {
            let (mut served, _) = listener.accept().unwrap();
            served.write_all(b"hi\n").unwrap();
            let mut buf = [0u8; 3];
            served.read_exact(&mut buf).unwrap();
            served.write_all(&buf).unwrap();
            (served, listener)
        });
        let mut s = connect(
            trusted_ns,
            SocketAddr::new(v, 9001),
            scaled(Duration::from_secs(2)),
        )
        .unwrap();
        assert_eq!(
            echo(&mut s, b"one", scaled(Duration::from_secs(1))),
            Outcome::Open
        );
        let (served, listener) = answer.join().unwrap();
        open.push((v, t, s, served, listener));
    }
    // The victim now takes nothing.
    c.write_policies(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: victim, namespace: t}\nspec: {podSelector: {matchLabels: {app: victim}}, policyTypes: [Ingress]}\n",
    );
    c.apply_ok();
    for (v, t, mut s, mut served, _listener) in open {
        let fam = if v.is_ipv6() { "IPv6" } else { "IPv4" };
        // The victim speaks first: a real segment, in the connection's
        // window, retransmitted while it goes unanswered.
        served.write_all(b"srv").unwrap();
        std::thread::sleep(scaled(Duration::from_millis(1500)));
        let n = arrived(victim_ns, t, v, || {
            let _ = s.write_all(b"two");
            std::thread::sleep(scaled(Duration::from_millis(300)));
        });
        assert_eq!(
            n, 0,
            "{fam}: the cut connection's segments reached the victim after it spoke first"
        );
    }
}

#[test]
fn a_cut_connection_stays_cut_when_the_victim_speaks_first_bpf() {
    a_cut_connection_stays_cut("atcb", Backend::Bpf);
}

#[test]
fn a_cut_connection_stays_cut_when_the_victim_speaks_first_iptables() {
    a_cut_connection_stays_cut("atci", Backend::Iptables);
}
