//! Connectivity probes: many at once from one pod, each a real TCP
//! connection (greeting read back), UDP round trip or ICMP echo. Each
//! probe reports the local address it was sent from (for ICMP, the echo
//! identifier as the port), so the receiver's capture can tell whether
//! its request arrived.
use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::{Error, NetNs, serve::GREETING};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    Tcp,
    Udp,
    Ping,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
            Transport::Ping => "icmp",
        }
    }
}

/// What a probe saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A full round trip: the request and its reply both passed.
    Open,
    /// Nothing came back in time (dropped).
    Blocked,
    /// The peer answered with a reset or port unreachable: the path is
    /// open but nothing listens.
    Refused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Probe {
    pub to: SocketAddr,
    pub transport: Transport,
}

/// What the sender of one probe saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sent {
    pub outcome: Outcome,
    /// The address and port the request left from (ICMP: the echo
    /// identifier); None if the probe could not be sent.
    pub from: Option<SocketAddr>,
}

enum Pending {
    Connecting(Socket),
    Greeting(Socket),
    Waiting(Socket),
    Done(Outcome),
}

fn domain(ip: &IpAddr) -> Domain {
    if ip.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    }
}

fn local(s: &Socket) -> Option<SocketAddr> {
    s.local_addr().ok().and_then(|a| a.as_socket())
}

fn start(p: &Probe) -> std::io::Result<(Pending, Option<SocketAddr>)> {
    let addr = SockAddr::from(p.to);
    let pending = match p.transport {
        Transport::Tcp => {
            let s = Socket::new(domain(&p.to.ip()), Type::STREAM, Some(Protocol::TCP))?;
            s.set_nonblocking(true)?;
            match s.connect(&addr) {
                Ok(()) => Pending::Greeting(s),
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Pending::Connecting(s),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    Pending::Done(Outcome::Refused)
                }
                Err(e) => return Err(e),
            }
        }
        Transport::Udp => {
            let s = Socket::new(domain(&p.to.ip()), Type::DGRAM, Some(Protocol::UDP))?;
            s.set_nonblocking(true)?;
            s.connect(&addr)?;
            (&s).write_all(b"probe")?;
            Pending::Waiting(s)
        }
        Transport::Ping => {
            let (proto, kind) = if p.to.is_ipv4() {
                (Protocol::ICMPV4, 8u8)
            } else {
                (Protocol::ICMPV6, 128u8)
            };
            let s = Socket::new(domain(&p.to.ip()), Type::DGRAM, Some(proto))?;
            s.set_nonblocking(true)?;
            s.connect(&SockAddr::from(SocketAddr::new(p.to.ip(), 0)))?;
            // Echo request header; the kernel fills id and checksum.
            (&s).write_all(&[kind, 0, 0, 0, 0, 0, 0, 1])?;
            Pending::Waiting(s)
        }
    };
    let from = match &pending {
        Pending::Connecting(s) | Pending::Greeting(s) | Pending::Waiting(s) => local(s),
        Pending::Done(_) => None,
    };
    Ok((pending, from))
}

/// Runs every probe from the calling thread's namespace, all at once,
/// within `timeout`.
pub fn run_probes(probes: &[Probe], timeout: Duration) -> std::io::Result<Vec<Sent>> {
    let (mut state, from): (Vec<Pending>, Vec<Option<SocketAddr>>) = probes
        .iter()
        .map(start)
        .collect::<std::io::Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    let mut buf = [0u8; 64];
    crate::poll::drive(
        &mut state,
        Instant::now() + timeout,
        || Pending::Done(Outcome::Blocked),
        |s| match s {
            Pending::Connecting(s) => Some((s.as_raw_fd(), libc::POLLOUT)),
            Pending::Greeting(s) | Pending::Waiting(s) => Some((s.as_raw_fd(), libc::POLLIN)),
            Pending::Done(_) => None,
        },
        |item| match item {
            Pending::Connecting(s) => match s.take_error() {
                Ok(None) => Pending::Greeting(s),
                Ok(Some(e)) if e.kind() == ErrorKind::ConnectionRefused => {
                    Pending::Done(Outcome::Refused)
                }
                _ => Pending::Done(Outcome::Blocked),
            },
            Pending::Greeting(s) => match (&s).read(&mut buf) {
                Ok(n) if n >= GREETING.len() && &buf[..GREETING.len()] == GREETING => {
                    Pending::Done(Outcome::Open)
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => Pending::Greeting(s),
                Err(e)
                    if e.kind() == ErrorKind::ConnectionRefused
                        || e.kind() == ErrorKind::ConnectionReset =>
                {
                    Pending::Done(Outcome::Refused)
                }
                _ => Pending::Done(Outcome::Blocked),
            },
            Pending::Waiting(s) => match (&s).read(&mut buf) {
                Ok(_) => Pending::Done(Outcome::Open),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Pending::Waiting(s),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    Pending::Done(Outcome::Refused)
                }
                Err(_) => Pending::Done(Outcome::Blocked),
            },
            done => done,
        },
    );
    Ok(state
        .into_iter()
        .zip(from)
        .map(|(s, from)| Sent {
            outcome: match s {
                Pending::Done(o) => o,
                _ => Outcome::Blocked,
            },
            from,
        })
        .collect())
}

/// Probes from several namespaces in parallel: (source index, probe) →
/// what the sender saw.
pub fn matrix(
    sources: &[&NetNs],
    probes: &[Vec<Probe>],
    timeout: Duration,
) -> Result<BTreeMap<(usize, Probe), Sent>, Error> {
    let mut handles = Vec::new();
    for (i, (ns, list)) in sources.iter().zip(probes).enumerate() {
        let list = list.clone();
        let name = ns.name.clone();
        handles.push((
            i,
            name,
            list.clone(),
            ns.spawn(move || run_probes(&list, timeout))?,
        ));
    }
    let mut out = BTreeMap::new();
    for (i, name, list, h) in handles {
        let res = h
            .join()
            .map_err(|_| Error::Invalid(format!("probe thread in {name} panicked")))??
            .map_err(|source| Error::Socket {
                netns: name.clone(),
                source,
            })?;
        for (p, o) in list.into_iter().zip(res) {
            out.insert((i, p), o);
        }
    }
    Ok(out)
}

/// Opens a TCP connection from inside `netns` and reads the greeting; the
/// socket keeps working from any thread afterwards (its namespace is fixed
/// at creation).
pub fn connect(
    netns: &NetNs,
    to: SocketAddr,
    timeout: Duration,
) -> Result<std::net::TcpStream, Error> {
    let name = netns.name.clone();
    let handle = netns.spawn(move || -> std::io::Result<std::net::TcpStream> {
        let mut s = std::net::TcpStream::connect_timeout(&to, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        let mut buf = [0u8; 3];
        s.read_exact(&mut buf)?;
        Ok(s)
    })?;
    let joined = handle
        .join()
        .map_err(|_| Error::Invalid(format!("connect thread in {name} panicked")))??;
    joined.map_err(|source| Error::Socket {
        netns: name,
        source,
    })
}

/// Sends `payload` on an open connection and waits for its echo.
pub fn echo(stream: &mut std::net::TcpStream, payload: &[u8], timeout: Duration) -> Outcome {
    if stream.set_read_timeout(Some(timeout)).is_err() || stream.write_all(payload).is_err() {
        return Outcome::Blocked;
    }
    let mut got = vec![0u8; payload.len()];
    match stream.read_exact(&mut got) {
        Ok(()) if got == payload => Outcome::Open,
        Err(e) if e.kind() == ErrorKind::ConnectionReset => Outcome::Refused,
        _ => Outcome::Blocked,
    }
}
