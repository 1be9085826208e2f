//! Real SCTP associations through both datapaths (elsewhere SCTP is only
//! crafted packets through BPF_PROG_TEST_RUN), judged at the receiver:
//! what the listeners in the destination pods accepted and read decides,
//! never what the sender saw. Two kinds of test: a NetworkPolicy that
//! admits one SCTP port from one pod, and upstream's four SCTP conformance
//! tests of ClusterNetworkPolicy (CNPAdminTierIngressSCTP,
//! CNPAdminTierEgressSCTP, CNPBaselineTierIngressSCTP,
//! CNPBaselineTierEgressSCTP), on both datapaths, IPv4 and IPv6. Needs the
//! kernel's `sctp` module: the 6.1 test guest loads it; a kernel without
//! it skips with the reason printed. Needs root.
//!
//! The upstream tests (`cluster_policy`) are on the world `cluster_policy` maps upstream's
//! houses onto, cut down to the pods they probe: ravenclaw is alpha/api
//! (both luna-lovegood pods), hufflepuff alpha/web (both cedric-diggory
//! pods), gryffindor namespace beta (harry-potter-0 and -1: beta/web and
//! beta/api), slytherin namespace gamma (draco-malfoy-0 and -1: gamma/web
//! and gamma/api). Each test edits its one policy in place, subtest after
//! subtest, as upstream does, and each subtest is a stage: the policies
//! written as they then are and applied (unless upstream patched nothing),
//! upstream's probes held to a small model of the API (`open`), then every
//! pair between ravenclaw and the other pods probed, on both SCTP ports
//! and in both families, and held to the model. The ingress and egress
//! tests of a tier run in lockstep (see `in_lockstep`), all four on one
//! cluster per datapath.
//!
//! Time: the suite runs in the TCG guest, where deadlines are scaled ten
//! times, a cluster and an apply cost seconds, and a refused association
//! is only known by its absence. So the probes of a stage all run at once,
//! both datapaths side by side, and a stage waits once: until its admitted
//! associations have delivered their messages, then three times as long
//! as that took (never less than `REFUSED_WINDOW`) for the refused ones
//! not to arrive. The earlier CNP test's shape is one more stage
//! (`sctp_guard`).

use std::{
    collections::BTreeSet,
    io::{ErrorKind, Read as _, Write as _},
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use policy_testbed::NetNs;
use policy_testbed::fixtures::{
    conformance::{Backend, Conformance, NsSpec, PodSpec, labels, name_of, ns_of},
    deadline::scaled,
};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

mod cluster_policy;

const IPPROTO_SCTP: i32 = 132;

/// How long, at least, a stage waits (from its start) for associations
/// the policy refuses to show at the listeners; on the host (scaled for
/// the guest).
const REFUSED_WINDOW: Duration = Duration::from_millis(300);
/// What a listener sends on every association it accepts.
const GREETING: &[u8] = b"accepted";
/// How long an admitted association may take to deliver its message, on
/// the host (scaled for the guest).
const ADMITTED_DEADLINE: Duration = Duration::from_secs(6);

fn sctp() -> Protocol {
    Protocol::from(IPPROTO_SCTP)
}

/// Why SCTP sockets cannot be had here, if they cannot.
fn sctp_unavailable() -> Option<String> {
    Socket::new(Domain::IPV4, Type::STREAM, Some(sctp()))
        .err()
        .map(|e| format!("no SCTP sockets on this kernel ({e}); the 6.1 test guest runs this"))
}

/// A dual-stack listener sees IPv4 peers as mapped IPv6 addresses.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn netns(c: &Conformance, pod: &str) -> NetNs {
    NetNs::borrow(&c.node().pod(pod).unwrap().netns.name)
}

/// One association tried: from pod `from` to pod `to`'s `port`, in one
/// family; `open` is the API's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Probe {
    from: String,
    to: String,
    port: u16,
    v6: bool,
    open: bool,
}

/// Where an association landed: (listening pod, its port, the peer).
type Landing = (String, u16, IpAddr);

/// What the listeners saw since they were last cleared.
#[derive(Default)]
struct Seen {
    /// Every association accepted, as soon as it was.
    accepted: Vec<Landing>,
    /// What each accepted association has carried so far (by the serving
    /// loop's number for it), and how its last read ended.
    received: Vec<(u64, Landing, Vec<u8>, String)>,
}

impl Seen {
    /// Whether an association from `landing` carried all of `message`.
    fn got(&self, landing: &Landing, message: &[u8]) -> bool {
        self.received
            .iter()
            .any(|(_, at, data, _)| at == landing && data == message)
    }
}

/// SCTP listeners (one-to-one style, dual-stack) on given ports of given
/// pods, all served by one thread: every association is greeted and
/// recorded when accepted, and what it carries as it arrives. (Its end is
/// not awaited: the senders hold their associations open until the stage
/// ends.)
struct Listeners {
    seen: Arc<Mutex<Seen>>,
    /// Rounds of the serving loop that found nothing to accept.
    idle: Arc<AtomicU64>,
    /// Bumped by `clear`: the loop then drops what it was reading.
    generation: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listeners {
    fn start(c: &Conformance, servers: &[(&str, &[u16])]) -> Self {
        // A socket belongs to the namespace it is made in, whichever
        // thread serves it.
        let mut sockets: Vec<(String, u16, Socket)> = Vec::new();
        for (pod, ports) in servers {
            let ports = ports.to_vec();
            // One socket per family, bound to the pod's address of it: an
            // association then has one path. Bound to any address, SCTP
            // lists every address of the pod in its handshake and may move
            // to another one (another family) when a path is slow, as a
            // new flow the probe is not about.
            let addrs = [c.pod_ip(pod, false), c.pod_ip(pod, true)];
            let made = netns(c, pod)
                .spawn(move || {
                    ports
                        .into_iter()
                        .flat_map(|port| addrs.map(|a| (port, a)))
                        .map(|(port, addr)| {
                            let domain = if addr.is_ipv6() {
                                Domain::IPV6
                            } else {
                                Domain::IPV4
                            };
                            let s = Socket::new(domain, Type::STREAM, Some(sctp())).unwrap();
                            if addr.is_ipv6() {
                                s.set_only_v6(true).unwrap();
                            }
                            s.set_reuse_address(true).unwrap();
                            s.bind(&SockAddr::from(SocketAddr::new(addr, port)))
                                .unwrap();
                            s.listen(64).unwrap();
                            s.set_nonblocking(true).unwrap();
                            (port, s)
                        })
                        .collect::<Vec<_>>()
                })
                .unwrap()
                .join()
                .unwrap()
                .unwrap();
            sockets.extend(
                made.into_iter()
                    .map(|(port, s)| ((*pod).to_owned(), port, s)),
            );
        }
        let mut this = Self {
            seen: Arc::default(),
            idle: Arc::default(),
            generation: Arc::default(),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        let (seen, idle, generation, stop) = (
            this.seen.clone(),
            this.idle.clone(),
            this.generation.clone(),
            this.stop.clone(),
        );
        this.thread = Some(std::thread::spawn(move || {
            serve(&sockets, &seen, (&idle, &generation), &stop);
        }));
        this
    }

    fn clear(&self) {
        let mut seen = self.seen.lock().unwrap();
        self.generation.fetch_add(1, Ordering::SeqCst);
        *seen = Seen::default();
    }

    /// Waits (a bounded while) until the serving loop has twice found
    /// nothing to accept: whatever was set up before this call has been
    /// accepted.
    fn settle(&self) {
        let from = self.idle.load(Ordering::SeqCst);
        let deadline = Instant::now() + scaled(Duration::from_secs(3));
        while self.idle.load(Ordering::SeqCst) < from + 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Listeners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The listeners' loop: accepts, and reads every accepted association
/// without blocking, until `stop`.
fn serve(
    sockets: &[(String, u16, Socket)],
    seen: &Mutex<Seen>,
    (idle, generation): (&AtomicU64, &AtomicU64),
    stop: &AtomicBool,
) {
    // (the generation it was accepted in, its number, the association),
    // read until a `clear` ends that generation. Tagged when accepted, not
    // by the round: a `clear` between a round's start and an accept would
    // otherwise drop (and close) an association of the new stage.
    let mut reading: Vec<(u64, u64, Socket)> = Vec::new();
    let mut numbered = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let now = generation.load(Ordering::SeqCst);
        reading.retain(|(g, ..)| *g == now);
        let mut accepted = false;
        for (pod, port, s) in sockets {
            while let Ok((conn, peer)) = s.accept() {
                accepted = true;
                // A stage's senders start only once `clear` has returned.
                let accepted_in = generation.load(Ordering::SeqCst);
                conn.set_nonblocking(true).unwrap();
                // The sender waits for this before it sends.
                let _ = (&conn).write(GREETING);
                let landing = (
                    pod.clone(),
                    *port,
                    canonical(peer.as_socket().unwrap().ip()),
                );
                numbered += 1;
                let mut seen = seen.lock().unwrap();
                seen.accepted.push(landing.clone());
                seen.received
                    .push((numbered, landing, Vec::new(), String::new()));
                reading.push((accepted_in, numbered, conn));
            }
        }
        // Every association is read until the stage ends (a read may
        // find it ended, or failing, before what it carries has come).
        for (_, n, conn) in &reading {
            let mut buf = [0u8; 512];
            let how = loop {
                match (&*conn).read(&mut buf) {
                    Ok(0) => break "ended".to_owned(),
                    Ok(k) => {
                        let mut seen = seen.lock().unwrap();
                        if let Some(r) = seen.received.iter_mut().find(|r| r.0 == *n) {
                            r.2.extend_from_slice(&buf[..k]);
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break "open".to_owned(),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => break e.to_string(),
                }
            };
            let mut seen = seen.lock().unwrap();
            if let Some(r) = seen.received.iter_mut().find(|r| r.0 == *n) {
                r.3 = how;
            }
        }
        if !accepted {
            idle.fetch_add(1, Ordering::SeqCst);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `s` is writable or has failed (its association set up, or
/// given up on) within `ms`.
fn settled(s: &Socket, ms: i32) -> bool {
    let mut fd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: `fd` is one valid pollfd for the call's duration.
    unsafe { libc::poll(&mut fd, 1, ms) > 0 }
}

/// From inside `netns`, in a thread of its own: an association to `to`
/// and, once it is set up and the listener's greeting came, `message` sent
/// on it. The sender closes its
/// socket when `stop` is set (set up or not, nothing of it is left for a
/// later stage); what it saw is no verdict.
fn send(
    netns: &NetNs,
    from: IpAddr,
    to: SocketAddr,
    message: Vec<u8>,
    stop: Arc<AtomicBool>,
) -> JoinHandle<Result<String, policy_testbed::Error>> {
    netns
        .spawn(move || {
            let domain = if to.is_ipv6() {
                Domain::IPV6
            } else {
                Domain::IPV4
            };
            let s = Socket::new(domain, Type::STREAM, Some(sctp())).unwrap();
            // One path, as the listener's (see `Listeners::start`).
            s.bind(&SockAddr::from(SocketAddr::new(from, 0))).unwrap();
            s.set_nonblocking(true).unwrap();
            match s.connect(&SockAddr::from(to)) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
                Err(e) => return format!("connect: {e}"),
            }
            loop {
                if stop.load(Ordering::SeqCst) {
                    return "never set up".to_owned();
                }
                if settled(&s, 20) {
                    break;
                }
            }
            match s.take_error() {
                Ok(None) => {}
                Ok(Some(e)) | Err(e) => return format!("failed: {e}"),
            }
            // Only once the listener has accepted the association: data
            // that arrives while `accept` moves it off the listening socket
            // can be lost.
            let mut greeting = Vec::new();
            while greeting.len() < GREETING.len() {
                if stop.load(Ordering::SeqCst) {
                    return "set up, never greeted".to_owned();
                }
                let mut buf = [0u8; 16];
                match (&s).read(&mut buf) {
                    Ok(0) => return "set up, ended before the greeting".to_owned(),
                    Ok(n) => greeting.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return format!("set up, reading the greeting: {e}"),
                }
            }
            s.set_nonblocking(false).unwrap();
            let wrote = match (&s).write_all(&message) {
                Ok(()) => "set up, sent".to_owned(),
                Err(e) => format!("set up, send: {e}"),
            };
            // Held open until the stage ends: closed at once, it could be
            // shut down before the listener accepts it, and Linux may then
            // lose what it carried.
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(10));
            }
            wrote
        })
        .unwrap()
}

/// One stage: `policy` applied (None: what is applied stays), then every
/// probe at once. Each admitted one must deliver its message to the
/// listener, no refused one may be accepted there, nothing else may
/// arrive.
fn stage(c: &Conformance, ears: &Listeners, what: &str, policy: Option<&str>, probes: &[Probe]) {
    let backend = c.backend;
    assert!(
        probes.iter().any(|p| p.open) && probes.iter().any(|p| !p.open),
        "{what}: a stage probes at least one admitted and one refused pair"
    );
    let landing = |p: &Probe| (p.to.clone(), p.port, c.pod_ip(&p.from, p.v6));
    let keys: BTreeSet<Landing> = probes.iter().map(landing).collect();
    assert_eq!(keys.len(), probes.len(), "{what}: a probe repeated");
    let begun = Instant::now();
    if let Some(policy) = policy {
        c.write_policies(policy);
        c.apply_ok();
    }
    let applied = begun.elapsed();
    ears.clear();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let messages: Vec<Vec<u8>> = probes
        .iter()
        .map(|p| format!("{what}: {} -> {}:{} v6={}", p.from, p.to, p.port, p.v6).into_bytes())
        .collect();
    let senders: Vec<_> = probes
        .iter()
        .zip(&messages)
        .map(|(p, m)| {
            let to = SocketAddr::new(c.pod_ip(&p.to, p.v6), p.port);
            let from = c.pod_ip(&p.from, p.v6);
            send(&netns(c, &p.from), from, to, m.clone(), stop.clone())
        })
        .collect();
    let wanted: Vec<(Landing, Vec<u8>)> = probes
        .iter()
        .zip(&messages)
        .filter(|(p, _)| p.open)
        .map(|(p, m)| (landing(p), m.clone()))
        .collect();
    // The admitted associations, sent at the same moment through the same
    // path, say how long one takes here and now.
    let deadline = start + scaled(ADMITTED_DEADLINE);
    let (took, all) = loop {
        let all = {
            let seen = ears.seen.lock().unwrap();
            wanted.iter().all(|(at, m)| seen.got(at, m))
        };
        if all || Instant::now() > deadline {
            break (start.elapsed(), all);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // (Failing already, it waits no longer.)
    let window = if all { took * 3 } else { took }.max(scaled(REFUSED_WINDOW));
    if let Some(rest) = window.checked_sub(start.elapsed()) {
        std::thread::sleep(rest);
    }
    stop.store(true, Ordering::SeqCst);
    let sent: Vec<String> = senders
        .into_iter()
        .map(|s| s.join().unwrap().unwrap())
        .collect();
    ears.settle();
    let seen = ears.seen.lock().unwrap();
    let mut wrong = Vec::new();
    for ((p, m), sent) in probes.iter().zip(&messages).zip(&sent) {
        let at = landing(p);
        if p.open && !seen.got(&at, m) {
            wrong.push(format!(
                "admitted {} -> {}:{} (v6: {}) did not deliver (the sender: {sent})",
                p.from, p.to, p.port, p.v6
            ));
        }
        if !p.open && seen.accepted.contains(&at) {
            wrong.push(format!(
                "refused {} -> {}:{} (v6: {}) was accepted",
                p.from, p.to, p.port, p.v6
            ));
        }
    }
    for at in &seen.accepted {
        if !keys.contains(at) {
            wrong.push(format!("an association no probe made: {at:?}"));
        }
    }
    let received: Vec<(&Landing, String, &String)> = seen
        .received
        .iter()
        .map(|(_, at, data, how)| (at, String::from_utf8_lossy(data).into_owned(), how))
        .collect();
    let received = format!("{received:#?}");
    drop(seen);
    assert!(
        wrong.is_empty(),
        "{backend:?}, {what}: {wrong:#?}\nthe listeners received {received}"
    );
    eprintln!(
        "sctp {backend:?} {what}: {} probes, apply {:.1}s, admitted after {:.1}s, stage {:.1}s",
        probes.len(),
        applied.as_secs_f64(),
        took.as_secs_f64(),
        begun.elapsed().as_secs_f64()
    );
}

/// Runs `test` on each datapath, side by side, each on its own cluster
/// (`prefixes`: BPF's, iptables'); a failure on either fails the test.
fn on_both_datapaths(prefixes: [&'static str; 2], test: fn(&'static str, Backend)) {
    let runs: Vec<_> = prefixes
        .into_iter()
        .zip([Backend::Bpf, Backend::Iptables])
        .map(|(prefix, backend)| {
            std::thread::Builder::new()
                .name(format!("{backend:?}"))
                .spawn(move || test(prefix, backend))
                .unwrap()
        })
        .collect();
    let results: Vec<_> = runs.into_iter().map(JoinHandle::join).collect();
    for r in results {
        if let Err(panic) = r {
            std::panic::resume_unwind(panic);
        }
    }
}

// ---------------------------------------------------------------------
// NetworkPolicy: one SCTP port admitted from one pod.

/// Admitted from the trusted pod.
const OPEN_PORT: u16 = 9002;
/// Listened on, admitted from nobody.
const CLOSED_PORT: u16 = 9003;

/// The victim admits the trusted pod on the open port.
fn network_policy() -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: victim, namespace: s}}\nspec:\n  podSelector: {{matchLabels: {{app: victim}}}}\n  ingress:\n    - from: [{{podSelector: {{matchLabels: {{app: trusted}}}}}}]\n      ports: [{{protocol: SCTP, port: {OPEN_PORT}}}]\n"
    )
}

/// A victim pod listens on two SCTP ports; a NetworkPolicy admits one
/// port from one pod.
fn network_policy_traffic(prefix: &'static str, backend: Backend) {
    if let Some(why) = sctp_unavailable() {
        eprintln!("SKIPPED {prefix}: {why}");
        return;
    }
    let pod = |name: &str, i: u8| {
        PodSpec::numbered("s", name, 7, i, vec![("assoc".into(), OPEN_PORT, "SCTP")])
    };
    let c = Conformance::with_cluster(
        prefix,
        backend,
        vec![NsSpec {
            name: "s".into(),
            labels: labels(&[("team", "s")]),
        }],
        vec![pod("victim", 21), pod("trusted", 22), pod("other", 23)],
    );
    let ears = Listeners::start(&c, &[("s/victim", &[OPEN_PORT, CLOSED_PORT])]);
    let mut probes = Vec::new();
    for v6 in [false, true] {
        for from in ["s/trusted", "s/other"] {
            for port in [OPEN_PORT, CLOSED_PORT] {
                probes.push(Probe {
                    from: from.into(),
                    to: "s/victim".into(),
                    port,
                    v6,
                    open: from == "s/trusted" && port == OPEN_PORT,
                });
            }
        }
    }
    stage(
        &c,
        &ears,
        "network policy",
        Some(&network_policy()),
        &probes,
    );
}

#[test]
fn sctp_associations_through_the_bpf_datapath() {
    network_policy_traffic("sctpb", Backend::Bpf);
}

#[test]
fn sctp_associations_through_the_iptables_datapath() {
    network_policy_traffic("sctpi", Backend::Iptables);
}
