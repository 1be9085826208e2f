//! Backends that say who they are: a server per pod answering every TCP
//! connection and UDP datagram with `pod:<ns>/<name> from <ip>:<port>\n`
//! (the pod's name and the source it saw), and a client that opens N
//! connections (or sends N datagrams, each from its own socket) to one
//! address from inside a pod and reports who answered each.
use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::{Error, NetNs};

/// TCP or UDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum L4 {
    Tcp,
    Udp,
}

/// One request a backend answered, as the backend saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Served {
    /// "ns/name".
    pub pod: String,
    pub l4: L4,
    /// The address and port it was reached at.
    pub local: SocketAddr,
    /// The source it saw (a node address if masqueraded).
    pub peer: SocketAddr,
}

/// Identity servers, stopped and joined on drop.
pub struct Backends {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<(), Error>>>,
    log: Arc<Mutex<Vec<Served>>>,
}

impl Default for Backends {
    fn default() -> Self {
        Self::new()
    }
}

impl Backends {
    pub fn new() -> Self {
        Self {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            log: Arc::default(),
        }
    }

    /// Starts the server of pod `pod` ("ns/name") in `netns`, bound to
    /// each of `ips` on every port; returns once it listens.
    pub fn add(
        &mut self,
        netns: &NetNs,
        pod: &str,
        ips: &[IpAddr],
        tcp: &[u16],
        udp: &[u16],
    ) -> Result<(), Error> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let stop = self.stop.clone();
        let log = self.log.clone();
        let ns_name = netns.name.clone();
        let pod = pod.to_owned();
        let ips = ips.to_vec();
        let (tcp, udp) = (tcp.to_vec(), udp.to_vec());
        self.threads.push(
            netns.spawn(move || serve(&ns_name, &pod, &ips, &tcp, &udp, &stop, &log, &ready_tx))?,
        );
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| Error::Invalid("backend server did not start".into()))?
    }

    /// Everything answered so far.
    pub fn served(&self) -> Vec<Served> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Forgets what was answered so far.
    pub fn clear(&self) {
        if let Ok(mut l) = self.log.lock() {
            l.clear();
        }
    }
}

impl Drop for Backends {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn answer(pod: &str, peer: &SocketAddr) -> Vec<u8> {
    format!("pod:{pod} from {peer}\n").into_bytes()
}

#[allow(clippy::too_many_arguments)]
fn serve(
    netns: &str,
    pod: &str,
    ips: &[IpAddr],
    tcp: &[u16],
    udp: &[u16],
    stop: &AtomicBool,
    log: &Mutex<Vec<Served>>,
    ready: &mpsc::Sender<Result<(), Error>>,
) {
    let sock_err = |source| Error::Socket {
        netns: netns.to_owned(),
        source,
    };
    let mut listeners = Vec::new();
    let mut datagrams = Vec::new();
    let bound = (|| -> Result<(), Error> {
        for ip in ips {
            for port in tcp {
                let l = TcpListener::bind(SocketAddr::new(*ip, *port)).map_err(sock_err)?;
                l.set_nonblocking(true).map_err(sock_err)?;
                listeners.push(l);
            }
            for port in udp {
                let s = UdpSocket::bind(SocketAddr::new(*ip, *port)).map_err(sock_err)?;
                s.set_nonblocking(true).map_err(sock_err)?;
                datagrams.push(s);
            }
        }
        Ok(())
    })();
    let failed = bound.is_err();
    let _ = ready.send(bound);
    if failed {
        return;
    }
    let record = |l4, local, peer| {
        if let Ok(mut l) = log.lock() {
            l.push(Served {
                pod: pod.to_owned(),
                l4,
                local,
                peer,
            });
        }
    };
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        let fds = listeners
            .iter()
            .map(|l| l.as_raw_fd())
            .chain(datagrams.iter().map(|u| u.as_raw_fd()));
        for fd in crate::poll::readable(fds, 100) {
            if let Some(l) = listeners.iter().find(|l| l.as_raw_fd() == fd) {
                while let Ok((mut s, peer)) = l.accept() {
                    let local = s.local_addr().unwrap_or(peer);
                    record(L4::Tcp, local, peer);
                    // The greeting fits the socket buffer: one write.
                    let _ = s.set_nonblocking(false);
                    let _ = s.write_all(&answer(pod, &peer));
                }
            } else if let Some(u) = datagrams.iter().find(|u| u.as_raw_fd() == fd) {
                while let Ok((_, peer)) = u.recv_from(&mut buf) {
                    let local = u.local_addr().unwrap_or(peer);
                    record(L4::Udp, local, peer);
                    let _ = u.send_to(&answer(pod, &peer), peer);
                }
            }
        }
    }
}

/// What one connection or datagram got back.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// A backend answered: its pod ("ns/name") and the source it saw.
    Answered { pod: String, seen_from: SocketAddr },
    /// Refused: a reset or an ICMP port unreachable (kube-proxy's REJECT
    /// for a Service without endpoints).
    Refused,
    /// Nothing came back in time.
    NoAnswer,
}

impl Reply {
    pub fn pod(&self) -> Option<&str> {
        match self {
            Self::Answered { pod, .. } => Some(pod),
            _ => None,
        }
    }
}

/// How many replies each backend gave; refused and unanswered requests
/// count under "(refused)" and "(no answer)".
pub fn tally(replies: &[Reply]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in replies {
        let key = match r {
            Reply::Answered { pod, .. } => pod.clone(),
            Reply::Refused => "(refused)".into(),
            Reply::NoAnswer => "(no answer)".into(),
        };
        *out.entry(key).or_insert(0) += 1;
    }
    out
}

fn parse(bytes: &[u8]) -> Option<Reply> {
    let text = std::str::from_utf8(bytes).ok()?;
    let line = text.strip_suffix('\n')?;
    let rest = line.strip_prefix("pod:")?;
    let (pod, from) = rest.split_once(" from ")?;
    Some(Reply::Answered {
        pod: pod.to_owned(),
        seen_from: from.parse().ok()?,
    })
}

enum Pending {
    Connecting(Socket),
    Reading(Socket, Vec<u8>),
    Done(Reply),
}

fn start(to: SocketAddr, l4: L4) -> std::io::Result<Pending> {
    let domain = if to.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let addr = SockAddr::from(to);
    match l4 {
        L4::Tcp => {
            let s = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?;
            s.set_nonblocking(true)?;
            match s.connect(&addr) {
                Ok(()) => Ok(Pending::Reading(s, Vec::new())),
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(Pending::Connecting(s)),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    Ok(Pending::Done(Reply::Refused))
                }
                Err(e) => Err(e),
            }
        }
        L4::Udp => {
            let s = Socket::new(domain, Type::DGRAM, Some(Protocol::UDP))?;
            s.set_nonblocking(true)?;
            s.connect(&addr)?;
            match (&s).write_all(b"who\n") {
                Ok(()) => Ok(Pending::Reading(s, Vec::new())),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    Ok(Pending::Done(Reply::Refused))
                }
                Err(e) => Err(e),
            }
        }
    }
}

/// Opens `count` TCP connections (or sends `count` datagrams, each from
/// a new socket and so a new flow) to `to` from the calling thread's
/// network namespace, all at once, and waits at most `timeout` for the
/// answers.
pub fn ask_here(
    to: SocketAddr,
    l4: L4,
    count: usize,
    timeout: Duration,
) -> std::io::Result<Vec<Reply>> {
    let mut state: Vec<Pending> = (0..count)
        .map(|_| start(to, l4))
        .collect::<std::io::Result<_>>()?;
    let mut buf = [0u8; 256];
    crate::poll::drive(
        &mut state,
        Instant::now() + timeout,
        || Pending::Done(Reply::NoAnswer),
        |s| match s {
            Pending::Connecting(s) => Some((s.as_raw_fd(), libc::POLLOUT)),
            Pending::Reading(s, _) => Some((s.as_raw_fd(), libc::POLLIN)),
            Pending::Done(_) => None,
        },
        |item| match item {
            Pending::Connecting(s) => match s.take_error() {
                Ok(None) => Pending::Reading(s, Vec::new()),
                Ok(Some(e)) if e.kind() == ErrorKind::ConnectionRefused => {
                    Pending::Done(Reply::Refused)
                }
                // Unreachable and the like: nothing answered.
                _ => Pending::Done(Reply::NoAnswer),
            },
            Pending::Reading(s, mut got) => match (&s).read(&mut buf) {
                Ok(0) => Pending::Done(parse(&got).unwrap_or(Reply::NoAnswer)),
                Ok(len) => {
                    got.extend_from_slice(&buf[..len]);
                    if got.ends_with(b"\n") || l4 == L4::Udp {
                        Pending::Done(parse(&got).unwrap_or(Reply::NoAnswer))
                    } else {
                        Pending::Reading(s, got)
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => Pending::Reading(s, got),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => Pending::Done(Reply::Refused),
                Err(e) if e.kind() == ErrorKind::ConnectionReset && got.is_empty() => {
                    Pending::Done(Reply::Refused)
                }
                Err(_) => Pending::Done(parse(&got).unwrap_or(Reply::NoAnswer)),
            },
            done @ Pending::Done(_) => done,
        },
    );
    Ok(state
        .into_iter()
        .map(|s| match s {
            Pending::Done(r) => r,
            _ => Reply::NoAnswer,
        })
        .collect())
}

/// [`ask_here`] from inside `netns` (a pod's namespace, or a node's).
pub fn ask(
    netns: &NetNs,
    to: SocketAddr,
    l4: L4,
    count: usize,
    timeout: Duration,
) -> Result<Vec<Reply>, Error> {
    let name = netns.name.clone();
    netns
        .spawn(move || ask_here(to, l4, count, timeout))?
        .join()
        .map_err(|_| Error::Invalid("client thread panicked".into()))??
        .map_err(|source| Error::Socket {
            netns: name,
            source,
        })
}
