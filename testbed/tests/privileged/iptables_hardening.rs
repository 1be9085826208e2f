//! The iptables fallback against an attacker and a hostile node, with
//! real traffic on a simulated node (needs root; run under the kernel-test
//! lock): a failing conntrack revocation is reported and retried instead
//! of being taken for done; an upgrade removes the objects of the earlier
//! naming but never a foreign `PA…` one.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use policy_agent::netlink::conntrack::FAULT_ENV;
use policy_testbed::fixtures::conformance::{Backend, Conformance, socket};
use policy_testbed::{Outcome, connect, echo};

/// A flag file: revocations fail while it exists.
struct FakeConntrack {
    dir: PathBuf,
}

/// The agent's fault hook (`netlink::conntrack::FAULT_ENV`): a real
/// ctnetlink failure cannot be produced on demand.
impl FakeConntrack {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("policy-agent-fake-conntrack-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self { dir }
    }

    fn flag(&self) -> PathBuf {
        self.dir.join("fail")
    }

    fn fail(&self, on: bool) {
        if on {
            std::fs::write(self.flag(), "").unwrap();
        } else {
            let _ = std::fs::remove_file(self.flag());
        }
    }

    /// The environment that points the agent at the flag.
    fn env(&self) -> (&'static str, String) {
        (FAULT_ENV, self.flag().display().to_string())
    }
}

impl Drop for FakeConntrack {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const DENY_DB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: alpha}\nspec: {podSelector: {matchLabels: {app: db}}, policyTypes: [Ingress]}\n";

#[test]
fn a_failing_conntrack_delete_is_reported_and_retried() {
    let fake = FakeConntrack::new("run");
    let mut c = Conformance::new("ictrack", Backend::Iptables);
    let (key, flag) = fake.env();
    let dir = c.dir.to_str().unwrap().to_owned();
    c.start_daemon_with(19420, &["--manifests", &dir], &[(key, &flag)]);
    let client = &c.node().pod("beta/web").unwrap().netns;
    let mut flow = connect(client, socket("10.244.1.12", 80), Duration::from_secs(2)).unwrap();
    assert_eq!(
        echo(&mut flow, b"one", Duration::from_secs(1)),
        Outcome::Open
    );

    // alpha/db is closed while conntrack cannot delete its flows: the
    // established one still passes (its entry survives), and that is
    // reported.
    fake.fail(true);
    c.write_policies(DENY_DB);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = c.http_get(19420, "/metrics");
        let problems = metrics
            .lines()
            .find_map(|l| l.strip_prefix("policy_agent_problems "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if problems > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the failed deletion is never reported:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        echo(&mut flow, b"two", Duration::from_secs(1)),
        Outcome::Open,
        "the entry the failed deletion left lets the flow on"
    );

    // conntrack works again: the daemon's retry (no manifest change) cuts
    // the flow.
    fake.fail(false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while echo(&mut flow, b"xyz", Duration::from_millis(300)) == Outcome::Open {
        assert!(
            Instant::now() < deadline,
            "the established flow is never cut: the failed deletion was not retried"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn apply_fails_when_conntrack_cannot_delete() {
    let fake = FakeConntrack::new("apply");
    let c = Conformance::new("ictapply", Backend::Iptables);
    c.apply_ok();
    fake.fail(true);
    c.write_policies(DENY_DB);
    let out = c
        .node()
        .node
        .command(policy_testbed::fixtures::agent())
        .args(["apply", "--manifests", c.dir.to_str().unwrap()])
        .args(["--node", "node-1", "--datapath", "iptables"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .env(fake.env().0, fake.env().1)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "apply must not claim success:\n{text}"
    );
    assert!(
        text.contains("alpha/db") && text.contains("conntrack"),
        "the pod and the cause are named:\n{text}"
    );
}

#[test]
fn an_upgrade_removes_the_earlier_naming_and_spares_foreign_pa_objects() {
    let c = Conformance::new("itupgrade", Backend::Iptables);
    let node = &c.node().node;
    // What an agent of the earlier naming left: PA-FORWARD hooked into
    // FORWARD, a pod chain dropping everything to alpha/db, its set.
    node.exec("ipset", &["create", "PAI-0123abcd-v4", "hash:ip"])
        .unwrap();
    node.exec(
        "ipset",
        &["create", "PAI-0123abcd-v6", "hash:ip", "family", "inet6"],
    )
    .unwrap();
    node.exec("ipset", &["create", "PAYROLL", "hash:ip"])
        .unwrap();
    for (tool, fam) in [("iptables-restore", "v4"), ("ip6tables-restore", "v6")] {
        let restore = format!(
            "*filter\n:PA-FORWARD - [0:0]\n:PA-I-0123abcd - [0:0]\n:PA-LOCAL - [0:0]\n-A PA-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN\n-A PA-FORWARD -o itupgradeh2 -j PA-I-0123abcd\n-A PA-I-0123abcd -m set --match-set PAI-0123abcd-{fam} src -j RETURN\n-A PA-I-0123abcd -j DROP\n-A PA-LOCAL -s {foreign} -j DROP\n-I FORWARD 1 -j PA-FORWARD\n-A FORWARD -j PA-LOCAL\nCOMMIT\n",
            foreign = if fam == "v4" {
                "192.0.2.1"
            } else {
                "2001:db8::1"
            }
        );
        let mut cmd = node.command(tool);
        cmd.arg("--noflush");
        policy_agent::exec::output(&mut cmd, Some(&restore)).unwrap();
    }
    c.check("the old rules drop alpha/db", |f, t, _, _| {
        f == t || f == "(node)" || t != "alpha/db"
    });

    c.apply_ok();
    for tool in ["iptables-save", "ip6tables-save"] {
        let saved = node.exec(tool, &["-t", "filter"]).unwrap();
        assert!(
            !saved.contains("PA-FORWARD") && !saved.contains("PA-I-0123abcd"),
            "{saved}"
        );
        assert!(
            saved.contains(":PA-LOCAL") && saved.contains("-j PA-LOCAL"),
            "{saved}"
        );
    }
    let sets = node.exec("ipset", &["list", "-n"]).unwrap();
    assert!(!sets.contains("PAI-0123abcd"), "{sets}");
    assert!(sets.lines().any(|l| l == "PAYROLL"), "{sets}");
    c.check("no policy: everything open", |_, _, _, _| true);
}

// ---------------------------------------------------- source validation

mod spoofing {
    use std::{
        net::{IpAddr, SocketAddr, UdpSocket},
        os::fd::AsRawFd,
    };

    use policy_testbed::NetNs;
    use socket2::{Domain, Protocol, Socket, Type};

    use super::*;

    const PORT: u16 = 7777;

    /// A UDP datagram with its IP header (checksums filled: IPv6 needs the
    /// UDP one).
    fn udp_packet(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, payload: &[u8]) -> Vec<u8> {
        let len = 8 + payload.len();
        let mut udp = Vec::with_capacity(len);
        udp.extend_from_slice(&sport.to_be_bytes());
        udp.extend_from_slice(&dport.to_be_bytes());
        udp.extend_from_slice(&(len as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(payload);
        let mut pseudo = Vec::new();
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                pseudo.extend_from_slice(&s.octets());
                pseudo.extend_from_slice(&d.octets());
                pseudo.extend_from_slice(&[0, 17]);
                pseudo.extend_from_slice(&(len as u16).to_be_bytes());
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                pseudo.extend_from_slice(&s.octets());
                pseudo.extend_from_slice(&d.octets());
                pseudo.extend_from_slice(&(len as u32).to_be_bytes());
                pseudo.extend_from_slice(&[0, 0, 0, 17]);
            }
            _ => panic!("mixed families"),
        }
        pseudo.extend_from_slice(&udp);
        let mut sum: u32 = pseudo
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        let csum = match !(sum as u16) {
            0 => 0xffff,
            c => c,
        };
        udp[6..8].copy_from_slice(&csum.to_be_bytes());
        let mut ip = Vec::new();
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                ip.extend_from_slice(&[0x45, 0]);
                ip.extend_from_slice(&((20 + len) as u16).to_be_bytes());
                ip.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
                ip.extend_from_slice(&s.octets());
                ip.extend_from_slice(&d.octets());
                let mut sum: u32 = ip
                    .chunks(2)
                    .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
                    .sum();
                while sum > 0xffff {
                    sum = (sum & 0xffff) + (sum >> 16);
                }
                ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                ip.extend_from_slice(&[0x60, 0, 0, 0]);
                ip.extend_from_slice(&(len as u16).to_be_bytes());
                ip.extend_from_slice(&[17, 64]);
                ip.extend_from_slice(&s.octets());
                ip.extend_from_slice(&d.octets());
            }
            _ => unreachable!(),
        }
        ip.extend_from_slice(&udp);
        ip
    }

    /// Sends `packet` from inside `netns` through a raw socket: the kernel
    /// sends the header as written, forged source and all.
    fn send_raw(netns: &NetNs, dst: IpAddr, packet: Vec<u8>) {
        netns
            .spawn(move || {
                let domain = if dst.is_ipv4() {
                    Domain::IPV4
                } else {
                    Domain::IPV6
                };
                let s = Socket::new(domain, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW)))
                    .expect("raw socket");
                s.send_to(&packet, &SocketAddr::new(dst, 0).into())
                    .expect("send the forged packet");
            })
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
    }

    /// Sends an Ethernet frame into the node's uplink from its far end
    /// (as a packet arriving from the network).
    fn send_from_uplink(node: &NetNs, packet: Vec<u8>, v6: bool) {
        // nsenter keeps the host's /sys: ask iproute2 in the namespace.
        let brief = node.ip(&["-br", "link", "show", "uplink0"]).unwrap();
        let mac: Vec<u8> = brief
            .split_whitespace()
            .nth(2)
            .unwrap()
            .split(':')
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect();
        let ifindex: i32 = node
            .ip(&["-o", "link", "show", "uplink1"])
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        node.spawn(move || {
            let ether_type: u16 = if v6 { 0x86dd } else { 0x0800 };
            let mut frame = mac.clone();
            frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x42]);
            frame.extend_from_slice(&ether_type.to_be_bytes());
            frame.extend_from_slice(&packet);
            let s = Socket::new(
                Domain::PACKET,
                Type::RAW,
                Some(Protocol::from(i32::from((ether_type).to_be()))),
            )
            .expect("packet socket");
            // SAFETY: a zeroed sockaddr_ll filled field by field, passed with
            // its size; the frame buffer outlives the call.
            let sent = unsafe {
                let mut addr: libc::sockaddr_ll = std::mem::zeroed();
                addr.sll_family = libc::AF_PACKET as u16;
                addr.sll_ifindex = ifindex;
                addr.sll_halen = 6;
                addr.sll_addr[..6].copy_from_slice(&mac);
                libc::sendto(
                    s.as_raw_fd(),
                    frame.as_ptr().cast(),
                    frame.len(),
                    0,
                    (&raw const addr).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(
                sent,
                frame.len() as isize,
                "{}",
                std::io::Error::last_os_error()
            );
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    }

    /// A UDP listener in a pod: what it received, judged on its side.
    struct Listener {
        socket: UdpSocket,
    }

    impl Listener {
        fn start(netns: &NetNs, v6: bool) -> Self {
            let socket = netns
                .spawn(move || {
                    let any: IpAddr = if v6 {
                        "::".parse().unwrap()
                    } else {
                        "0.0.0.0".parse().unwrap()
                    };
                    UdpSocket::bind(SocketAddr::new(any, PORT)).unwrap()
                })
                .unwrap()
                .join()
                .unwrap()
                .unwrap();
            socket
                .set_read_timeout(Some(Duration::from_millis(150)))
                .unwrap();
            Self { socket }
        }

        /// The payloads received within `wait`; each is answered, so the
        /// flow it belongs to is established in conntrack.
        fn received(&self, wait: Duration) -> Vec<String> {
            let deadline = Instant::now() + wait;
            let mut out = Vec::new();
            let mut buf = [0u8; 256];
            while Instant::now() < deadline {
                if let Ok((n, from)) = self.socket.recv_from(&mut buf) {
                    out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                    let _ = self.socket.send_to(b"ack", from);
                }
            }
            out
        }
    }

    /// alpha/db takes ingress only from alpha/api.
    const DB_FROM_API: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: alpha}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: api}}}]}]\n";

    #[test]
    fn a_pod_cannot_send_with_another_pods_address() {
        let c = Conformance::new("itspoof", Backend::Iptables);
        let node = &c.node().node;
        // The node must not filter forged sources itself: the agent must.
        for key in [
            "net.ipv4.conf.all.rp_filter",
            "net.ipv4.conf.default.rp_filter",
        ] {
            node.sysctl(key, "0").unwrap();
        }
        for p in &c.node().pods {
            node.sysctl(&format!("net.ipv4.conf.{}.rp_filter", p.host_if), "0")
                .unwrap();
        }
        node.sysctl("net.ipv4.conf.uplink0.rp_filter", "0").unwrap();
        let attacker = &c.node().pod("beta/web").unwrap().netns;
        let api = &c.node().pod("alpha/api").unwrap().netns;
        let db = &c.node().pod("alpha/db").unwrap().netns;
        // db's own kernel would drop an IPv4 packet from its own address as
        // martian: let it through, so the node's rules are what is judged.
        for key in [
            "net.ipv4.conf.all.accept_local",
            "net.ipv4.conf.eth0.accept_local",
        ] {
            db.sysctl(key, "1").unwrap();
        }
        for key in [
            "net.ipv4.conf.all.rp_filter",
            "net.ipv4.conf.eth0.rp_filter",
        ] {
            db.sysctl(key, "0").unwrap();
        }
        for v6 in [false, true] {
            let listener = Listener::start(db, v6);
            let (api_ip, db_ip) = (c.pod_ip("alpha/api", v6), c.pod_ip("alpha/db", v6));
            let forged = |tag: &str| udp_packet(api_ip, 40000, db_ip, PORT, tag.as_bytes());
            let from_outside = |tag: &str| udp_packet(db_ip, 40001, db_ip, PORT, tag.as_bytes());

            // Without the agent the forgeries arrive: the test can see them.
            c.reset();
            send_raw(attacker, db_ip, forged("forged-before"));
            send_from_uplink(node, from_outside("self-before"), v6);
            let got = listener.received(Duration::from_millis(400));
            assert!(
                got.contains(&"forged-before".to_owned())
                    && got.contains(&"self-before".to_owned()),
                "v6={v6}: the forged packets must reach the listener unenforced: {got:?}"
            );

            c.write_policies(DB_FROM_API);
            c.apply_ok();
            // The genuine sender opens a UDP flow that db answers: an
            // established conntrack entry ...
            let genuine = api
                .spawn(move || UdpSocket::bind(SocketAddr::new(api_ip, 40000)).unwrap())
                .unwrap()
                .join()
                .unwrap()
                .unwrap();
            genuine
                .send_to(b"genuine", SocketAddr::new(db_ip, PORT))
                .unwrap();
            let got = listener.received(Duration::from_millis(400));
            assert_eq!(got, ["genuine"], "v6={v6}: the allowed sender gets through");
            genuine
                .set_read_timeout(Some(Duration::from_secs(1)))
                .unwrap();
            let mut ack = [0u8; 8];
            assert_eq!(genuine.recv(&mut ack).ok(), Some(3), "v6={v6}: db answers");
            // ... the attacker (a pod no policy isolates) sends as api on
            // the very same tuple, and from outside a packet claims to be
            // db talking to itself.
            send_raw(attacker, db_ip, forged("forged"));
            send_from_uplink(node, from_outside("self"), v6);
            let got = listener.received(Duration::from_millis(600));
            assert!(
                !got.contains(&"forged".to_owned()),
                "v6={v6}: a forged source passed db's 'only from api' rule: {got:?}"
            );
            assert!(
                !got.contains(&"self".to_owned()),
                "v6={v6}: db's own address arriving from the uplink passed as self traffic: {got:?}"
            );
            c.write_policies("");
        }
        // The forged packets were dropped by the source check, counted (the
        // last round was IPv6).
        let saved = node
            .exec("ip6tables-save", &["-c", "-t", "filter"])
            .unwrap();
        assert!(
            saved
                .lines()
                .any(|l| l.contains("forged source") && !l.starts_with("[0:0]")),
            "{saved}"
        );
    }
}
