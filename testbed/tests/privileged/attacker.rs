//! An attacker pod on the simulated node, with raw sockets: spoofed
//! sources, forged replies, ICMP errors quoting real flows, segments of no
//! connection, overlapping fragments, src = dst, long IPv6 header chains;
//! neighbour-discovery look-alikes, and packets for the node to
//! decapsulate whose inner packet forges a trusted pod's source.
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
    NODE_V4, NODE_V6, NetNs, Outcome, connect, echo,
    packet::{FRAME_DST_MAC, Fragment, L4, Packet, TCP_ACK, TCP_SYN},
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
    cluster(
        prefix,
        backend,
        vec![pod("attacker", 11), pod("victim", 12), pod("trusted", 13)],
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: victim, namespace: t}\nspec:\n  podSelector: {matchLabels: {app: victim}}\n  ingress:\n    - from: [{podSelector: {matchLabels: {app: trusted}}}]\n      ports: [{protocol: UDP, port: 9000}, {protocol: TCP, port: 9001}]\n",
    )
}

/// Namespace `t` (labelled team=t) holding `pods`, `policies` applied.
fn cluster(
    prefix: &'static str,
    backend: Backend,
    pods: Vec<PodSpec>,
    policies: &str,
) -> Conformance {
    let c = Conformance::with_cluster(
        prefix,
        backend,
        vec![NsSpec {
            name: "t".into(),
            labels: labels(&[("team", "t")]),
        }],
        pods,
    );
    c.write_policies(policies);
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
    captured(victim, send)
        .iter()
        .filter(|p| endpoints(p) == Some((from, to)))
        .count()
}

/// Runs `send` while capturing on the victim's interface; returns every IP
/// packet that arrived there.
fn captured(victim: &NetNs, send: impl FnOnce()) -> Vec<Vec<u8>> {
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
            let mut packets = Vec::new();
            let mut buf = [0u8; 2048];
            let mut until: Option<Instant> = None;
            loop {
                if until.is_none() && stop_rx.try_recv().is_ok() {
                    // Let late packets land.
                    until = Some(Instant::now() + scaled(Duration::from_millis(300)));
                }
                if until.is_some_and(|u| Instant::now() >= u) {
                    return packets;
                }
                // SAFETY: buf is writable for its length.
                let len =
                    unsafe { libc::recv(s.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if len <= 0 {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                packets.push(buf[..len as usize].to_vec());
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

// ------------------------------------------------ what only the node may send

const FREE: &str = "t/free";

/// Addresses of no pod and no node that the victim takes: the control
/// that a decapsulated inner packet really reaches it.
const OUTSIDE_V4: &str = "198.51.100.7";
const OUTSIDE_V6: &str = "2001:db8:5::7";

/// The attacker may send nothing but `attacker_egress` (a list of egress
/// rules; empty: nothing at all), `t/free` is not isolated, and the victim
/// takes everything from the attacker, free, the trusted pod and the
/// outside prefixes: whatever of theirs does not reach it is kept away by
/// the defence under test, not by the victim's policy.
fn node_traffic_policies(attacker_egress: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: victim, namespace: t}}\nspec:\n  podSelector: {{matchLabels: {{app: victim}}}}\n  ingress:\n    - from:\n        - podSelector: {{matchLabels: {{app: attacker}}}}\n        - podSelector: {{matchLabels: {{app: free}}}}\n        - podSelector: {{matchLabels: {{app: trusted}}}}\n        - ipBlock: {{cidr: 198.51.100.0/24}}\n        - ipBlock: {{cidr: \"2001:db8:5::/48\"}}\n---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: attacker, namespace: t}}\nspec:\n  podSelector: {{matchLabels: {{app: attacker}}}}\n  policyTypes: [Egress]\n  egress: [{attacker_egress}]\n"
    )
}

fn setup_node_traffic(prefix: &'static str, backend: Backend) -> Conformance {
    cluster(
        prefix,
        backend,
        vec![
            pod("attacker", 11),
            pod("victim", 12),
            pod("trusted", 13),
            pod("free", 14),
        ],
        &node_traffic_policies(""),
    )
}

/// Neighbour-discovery types with hop limit 255 between global addresses
/// are forwarded like any packet and must be judged like one: from an
/// attacker denied all egress, neither with its own source nor with the
/// trusted pod's, does a neighbour solicitation or advertisement reach the
/// victim's global address, though the victim would take both. (The BPF
/// classifier let them pass the attacker's egress for their hop limit.)
fn nd_look_alikes(prefix: &'static str, backend: Backend) {
    let c = setup_node_traffic(prefix, backend);
    let node = c.node();
    let ns = |id: &str| &node.pod(id).unwrap().netns;
    let (attacker, victim_ns, trusted_ns) = (ns(ATTACKER), ns(VICTIM), ns(TRUSTED));
    let (a, v, t) = (
        c.pod_ip(ATTACKER, true),
        c.pod_ip(VICTIM, true),
        c.pod_ip(TRUSTED, true),
    );
    let nd = |src: IpAddr, kind: u8| {
        let mut p = Packet::new(src, v, L4::Icmp { kind });
        p.hop_limit = 255;
        p
    };
    for (kind, name) in [
        (135, "neighbour solicitation"),
        (136, "neighbour advertisement"),
    ] {
        // The control: from the trusted pod (its egress is open) the same
        // packet is forwarded and arrives.
        let n = arrived(victim_ns, t, v, || {
            send_raw(trusted_ns, vec![nd(t, kind); 3])
        });
        assert!(
            n >= 1,
            "{name} from the trusted pod to the victim's global address must arrive"
        );
        for (src, whose) in [(a, "its own"), (t, "the trusted pod's")] {
            let n = arrived(victim_ns, src, v, || {
                send_raw(attacker, vec![nd(src, kind); 3])
            });
            assert_eq!(
                n, 0,
                "a {name} (hop limit 255) from the attacker with {whose} source reached the victim"
            );
        }
    }
}

#[test]
fn neighbour_discovery_look_alikes_reach_nothing_bpf() {
    nd_look_alikes("atndb", Backend::Bpf);
}

#[test]
fn neighbour_discovery_look_alikes_reach_nothing_iptables() {
    nd_look_alikes("atndi", Backend::Iptables);
}

/// A device on the node that takes packets out of an encapsulation.
struct Tunnel {
    name: &'static str,
    /// The outer packet's destination: one of the node's own addresses.
    node: IpAddr,
    /// The families of the inner packets it carries.
    inner: &'static [bool],
    /// VXLAN with this VNI, or IP-in-IP.
    vni: Option<u32>,
}

const VXLAN_PORT: u16 = 4789;

impl Tunnel {
    /// The packet from `src` to the node that carries `inner`.
    fn wrap(&self, src: IpAddr, inner: Packet) -> Packet {
        let inner = Box::new(inner);
        let l4 = match self.vni {
            Some(vni) => L4::Vxlan {
                sport: 40000,
                dport: VXLAN_PORT,
                vni,
                inner,
            },
            None => L4::Tunnel { gre: false, inner },
        };
        Packet::new(src, self.node, l4)
    }
}

/// The node's decapsulating devices: VXLAN on UDP 4789 bound to each of
/// its addresses (VNI 4 on IPv4, 6 on IPv6), taking frames addressed to
/// [`FRAME_DST_MAC`], and an IPIP device where the kernel has one (the
/// host's has no `ipip` module; the 6.1 guest's has). Reverse-path
/// filtering is off, as on a node that routes for tunnels: the kernel
/// would otherwise drop every inner packet from an address it routes
/// elsewhere, and the test would see nothing for that reason alone. They
/// go with the node's namespace.
fn tunnels(node: &NetNs) -> Vec<Tunnel> {
    let mac = FRAME_DST_MAC
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    let mut out = Vec::new();
    for (name, vni, local, udp6) in [
        ("pavx4", 4, IpAddr::V4(NODE_V4), ""),
        // The crafted outer UDP has no checksum, which IPv6 takes only
        // where the receiver says so.
        ("pavx6", 6, IpAddr::V6(NODE_V6), " udp6zerocsumrx"),
    ] {
        node.ip_batch(&[
            format!(
                "link add {name} type vxlan id {vni} local {local} dstport {VXLAN_PORT} nolearning{udp6}"
            ),
            format!("link set {name} address {mac}"),
            format!("link set {name} up"),
        ])
        .unwrap_or_else(|e| panic!("a VXLAN device on the node: {e}"));
        out.push(Tunnel {
            name,
            node: local,
            inner: &[false, true],
            vni: Some(vni),
        });
    }
    let ipip_device = node.ip_batch(&[
        format!("link add paipip type ipip local {NODE_V4}"),
        "link set paipip up".into(),
    ]);
    match ipip_device {
        Ok(()) => out.push(Tunnel {
            name: "paipip",
            node: IpAddr::V4(NODE_V4),
            inner: &[false],
            vni: None,
        }),
        Err(e) => eprintln!(
            "SKIPPED the IPIP device: this kernel has none ({}); VXLAN only",
            e.to_string().trim()
        ),
    }
    let mut off = vec!["all".to_owned(), "default".to_owned()];
    off.extend(out.iter().map(|t| t.name.to_owned()));
    for dev in off {
        node.sysctl(&format!("net.ipv4.conf.{dev}.rp_filter"), "0")
            .unwrap();
    }
    out
}

/// A UDP datagram's source, destination and source port.
fn udp_flow(ip: &[u8]) -> Option<(IpAddr, IpAddr, u16)> {
    let (src, dst) = endpoints(ip)?;
    let (protocol, l4) = match ip.first()? >> 4 {
        4 => (*ip.get(9)?, usize::from(ip.first()? & 0x0f) * 4),
        _ => (*ip.get(6)?, 40),
    };
    (protocol == 17).then_some(())?;
    let port = ip.get(l4..l4 + 2)?;
    Some((src, dst, u16::from_be_bytes([port[0], port[1]])))
}

/// One encapsulated datagram of [`encapsulations_to_the_node`]: who sends
/// it, through which tunnel, with which inner source (to the victim's
/// address of its family), and whether some of it must arrive. Each case
/// has an inner source port of its own, so the cases of one capture are
/// told apart.
struct EncapCase<'a> {
    what: String,
    sender: &'a str,
    tunnel: &'a Tunnel,
    inner_src: IpAddr,
    arrives: bool,
}

impl<'a> EncapCase<'a> {
    fn new(
        tunnel: &'a Tunnel,
        sender: &'a str,
        inner_src: IpAddr,
        arrives: bool,
        what: &str,
    ) -> Self {
        let fam = if inner_src.is_ipv6() { "IPv6" } else { "IPv4" };
        Self {
            what: format!("{}: {fam} inner {what}", tunnel.name),
            sender,
            tunnel,
            inner_src,
            arrives,
        }
    }
}

/// Sends every case (three copies each) in one capture window at the
/// victim, and returns a line for each case whose fate was not the
/// expected one.
fn run_encap_cases(c: &Conformance, victim_ns: &NetNs, cases: &[EncapCase<'_>]) -> Vec<String> {
    let node = c.node();
    let sport = |i: usize| 41000 + u16::try_from(i).unwrap();
    let victim = |inner_src: IpAddr| c.pod_ip(VICTIM, inner_src.is_ipv6());
    let packets = captured(victim_ns, || {
        for (i, case) in cases.iter().enumerate() {
            let outer_src = c.pod_ip(case.sender, case.tunnel.node.is_ipv6());
            let inner = Packet::udp(case.inner_src, sport(i), victim(case.inner_src), 9000);
            let outer = case.tunnel.wrap(outer_src, inner);
            send_raw(&node.pod(case.sender).unwrap().netns, vec![outer; 3]);
        }
    });
    let mut wrong = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let flow = Some((case.inner_src, victim(case.inner_src), sport(i)));
        let n = packets.iter().filter(|p| udp_flow(p) == flow).count();
        eprintln!("{}: {n} arrived", case.what);
        if (n > 0) != case.arrives {
            wrong.push(format!(
                "{}: {n} arrived, expected {}",
                case.what,
                if case.arrives { "some" } else { "none" }
            ));
        }
    }
    wrong
}

/// An encapsulation a pod sends to the node's address is no node traffic:
/// decapsulated, its inner packet travels on with the source the pod
/// chose. Through every tunnel device the node has, an inner datagram to
/// the victim's admitted port:
/// - from an outside address, sent by a pod whose egress is open: arrives
///   (the control: the decapsulation path delivers);
/// - with the trusted pod's source, or the sender's own, from that pod:
///   nothing (a local pod's address entering the node elsewhere than at
///   its own interface is a spoof);
/// - from the attacker, denied all egress: nothing at all (its outer
///   packet is dropped), nor the outside source's;
/// - once an ipBlock lets the attacker reach the node's address, its
///   outside source's arrives (the outer packet is judged by the node
///   address's class, as any peer's), the forged one still not.
///
/// The cases of each phase share one capture window.
fn encapsulations_to_the_node(prefix: &'static str, backend: Backend) {
    let c = setup_node_traffic(prefix, backend);
    let victim_ns = &c.node().pod(VICTIM).unwrap().netns;
    let tunnels = tunnels(&c.node().node);
    let outside =
        |v6: bool| -> IpAddr { if v6 { OUTSIDE_V6 } else { OUTSIDE_V4 }.parse().unwrap() };
    // (tunnel, inner family) pairs.
    let paths: Vec<(&Tunnel, bool)> = tunnels
        .iter()
        .flat_map(|t| t.inner.iter().map(move |v6| (t, *v6)))
        .collect();

    let open = "sent by a pod whose egress is open";
    let denied = "sent by the attacker denied all egress";
    let mut cases = Vec::new();
    for &(t, v6) in &paths {
        let (trusted, own, out) = (c.pod_ip(TRUSTED, v6), c.pod_ip(FREE, v6), outside(v6));
        cases.extend([
            EncapCase::new(t, FREE, out, true, &format!("from outside, {open}")),
            EncapCase::new(
                t,
                FREE,
                trusted,
                false,
                &format!("as the trusted pod, {open}"),
            ),
            EncapCase::new(t, FREE, own, false, &format!("with its own source, {open}")),
            EncapCase::new(
                t,
                ATTACKER,
                trusted,
                false,
                &format!("as the trusted pod, {denied}"),
            ),
            EncapCase::new(t, ATTACKER, out, false, &format!("from outside, {denied}")),
        ]);
    }
    let mut wrong = run_encap_cases(&c, victim_ns, &cases);

    // The attacker may now reach the node's addresses (ipBlocks): its
    // encapsulations are judged by their class.
    c.write_policies(&node_traffic_policies(&format!(
        "{{to: [{{ipBlock: {{cidr: {NODE_V4}/32}}}}, {{ipBlock: {{cidr: \"{NODE_V6}/128\"}}}}]}}"
    )));
    c.apply_ok();
    let allowed = "sent by the attacker allowed the node's address";
    let mut cases = Vec::new();
    for &(t, v6) in &paths {
        let (trusted, out) = (c.pod_ip(TRUSTED, v6), outside(v6));
        cases.extend([
            EncapCase::new(t, ATTACKER, out, true, &format!("from outside, {allowed}")),
            EncapCase::new(
                t,
                ATTACKER,
                trusted,
                false,
                &format!("as the trusted pod, {allowed}"),
            ),
        ]);
    }
    wrong.extend(run_encap_cases(&c, victim_ns, &cases));
    assert!(
        wrong.is_empty(),
        "{prefix} ({}):\n{}",
        backend.flag(),
        wrong.join("\n")
    );
}

#[test]
fn encapsulations_to_the_node_carry_no_forged_source_bpf() {
    encapsulations_to_the_node("attnb", Backend::Bpf);
}

#[test]
fn encapsulations_to_the_node_carry_no_forged_source_iptables() {
    encapsulations_to_the_node("attni", Backend::Iptables);
}
