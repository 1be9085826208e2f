//! TCP and UDP servers inside the pods: TCP greets with "ok\n" and then
//! echoes; UDP echoes each datagram.
//!
//! Each pod's server thread also keeps a capture (an `AF_PACKET` socket
//! in the pod's namespace) of what reaches the pod: connection requests
//! (TCP SYN), TCP data, UDP datagrams and ICMP echo requests, with their
//! addresses and ports. A verdict is judged where the traffic arrives:
//! a probe that timed out at the sender was blocked only if its request
//! never reached the receiver (a datapath that let a forbidden request in
//! and dropped only the reply would otherwise look like one that blocks).
use std::{
    collections::{HashMap, HashSet},
    io::{ErrorKind, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use socket2::{Domain, Protocol, Socket, Type};

use crate::{Error, NetNs, Transport, node::SimNode};

pub const GREETING: &[u8] = b"ok\n";

/// How often an idle server thread wakes up (to stop, or to report its
/// capture drained).
const TICK_MS: i32 = 20;
/// Payload bytes kept per captured packet.
const KEEP: usize = 32;

/// Something that reached a pod, seen by the capture in its namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Arrival {
    /// The pod ("namespace/name") whose namespace it reached.
    pub pod: String,
    /// Source address and port (ICMP: the echo identifier).
    pub from: SocketAddr,
    /// Destination address and port (ICMP: 0).
    pub to: SocketAddr,
    pub transport: Transport,
    /// A TCP connection request (SYN without ACK).
    pub syn: bool,
    /// The first bytes of the payload (TCP data, a UDP datagram, echo data).
    pub payload: Vec<u8>,
}

/// Everything captured between two [`Servers::arrivals`] calls.
#[derive(Clone, Debug, Default)]
pub struct Arrivals {
    pub all: Vec<Arrival>,
    requests: HashSet<(SocketAddr, SocketAddr, Transport)>,
}

impl Arrivals {
    fn new(all: Vec<Arrival>) -> Self {
        let requests = all
            .iter()
            .filter(|a| a.transport != Transport::Tcp || a.syn)
            .map(|a| (a.from, a.to, a.transport))
            .collect();
        Self { all, requests }
    }

    /// Whether the request of a probe sent from `from` to `to` reached its
    /// destination: a SYN for TCP, the datagram for UDP, the echo request
    /// for ICMP (whose `from` port is the echo identifier).
    pub fn request_arrived(&self, from: SocketAddr, to: SocketAddr, transport: Transport) -> bool {
        let to = match transport {
            Transport::Ping => SocketAddr::new(to.ip(), 0),
            _ => to,
        };
        self.requests.contains(&(from, to, transport))
    }

    /// TCP payloads that reached `to` from `from`, concatenated in order.
    pub fn tcp_data(&self, from: SocketAddr, to: SocketAddr) -> Vec<u8> {
        self.all
            .iter()
            .filter(|a| a.transport == Transport::Tcp && a.from == from && a.to == to)
            .flat_map(|a| a.payload.iter().copied())
            .collect()
    }
}

/// One server thread's handshake with [`Servers::arrivals`]: it stores
/// the request number it had seen before its last full drain.
struct Drained {
    seen: AtomicU64,
    /// Packets the kernel could not queue to the capture (must stay 0).
    lost: AtomicU64,
    exited: AtomicBool,
}

/// Servers of every pod, stopped and joined on drop.
pub struct Servers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<(), Error>>>,
    log: Arc<Mutex<Vec<Arrival>>>,
    request: Arc<AtomicU64>,
    drained: Vec<Arc<Drained>>,
}

struct Shared {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Arrival>>>,
    request: Arc<AtomicU64>,
    drained: Arc<Drained>,
}

impl Servers {
    /// Starts one server thread per pod and waits until all are bound.
    pub fn start(node: &SimNode) -> Result<Self, Error> {
        let mut this = Self {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            log: Arc::default(),
            request: Arc::default(),
            drained: Vec::new(),
        };
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Error>>();
        for p in &node.pods {
            let shared = this.shared();
            let ready = ready_tx.clone();
            let pod = p.pod.clone();
            let ns_name = p.netns.name.clone();
            let handle = p
                .netns
                .spawn(move || serve_pod(&ns_name, &pod, &shared, &ready))?;
            this.threads.push(handle);
        }
        drop(ready_tx);
        for _ in 0..node.pods.len() {
            match ready_rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::Invalid("pod servers did not start".into())),
            }
        }
        Ok(this)
    }

    fn shared(&mut self) -> Shared {
        let drained = Arc::new(Drained {
            seen: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            exited: AtomicBool::new(false),
        });
        self.drained.push(drained.clone());
        Shared {
            stop: self.stop.clone(),
            log: self.log.clone(),
            request: self.request.clone(),
            drained,
        }
    }

    /// Starts the servers of one pod (a pod added later).
    pub fn add(&mut self, netns: &NetNs, pod: &crate::SimPod) -> Result<(), Error> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let shared = self.shared();
        let pod = pod.clone();
        let ns_name = netns.name.clone();
        self.threads
            .push(netns.spawn(move || serve_pod(&ns_name, &pod, &shared, &ready_tx))?);
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| Error::Invalid("pod server did not start".into()))?
    }

    /// What reached the pods since the last call. Every capture is
    /// drained first, so whatever the kernel delivered before this call
    /// is included.
    pub fn arrivals(&self) -> Result<Arrivals, Error> {
        let want = self.request.fetch_add(1, Ordering::SeqCst) + 1;
        let deadline = Instant::now() + Duration::from_secs(10);
        for d in &self.drained {
            while d.seen.load(Ordering::SeqCst) < want && !d.exited.load(Ordering::SeqCst) {
                if Instant::now() > deadline {
                    return Err(Error::Invalid("a pod capture did not drain".into()));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            let lost = d.lost.swap(0, Ordering::SeqCst);
            if lost > 0 {
                return Err(Error::Invalid(format!(
                    "a pod capture lost {lost} packet(s): what arrived is unknown"
                )));
            }
        }
        let all = std::mem::take(
            &mut *self
                .log
                .lock()
                .map_err(|_| Error::Invalid("capture log poisoned".into()))?,
        );
        Ok(Arrivals::new(all))
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A capture of every packet entering the calling thread's network
/// namespace (all interfaces, loopback included).
fn open_capture() -> std::io::Result<Socket> {
    // Room for a burst of a whole matrix even if this thread is slow to
    // run.
    let s = capture_socket(8 << 20)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// A packet socket that sees every packet entering the calling thread's
/// network namespace, with a receive buffer of `size` bytes
/// (SO_RCVBUFFORCE needs CAP_NET_ADMIN, which the tests have; without it,
/// as much as the system's limit allows).
pub fn capture_socket(size: libc::c_int) -> std::io::Result<Socket> {
    let all = i32::from((libc::ETH_P_ALL as u16).to_be());
    let s = Socket::new(Domain::PACKET, Type::DGRAM, Some(Protocol::from(all)))?;
    // SAFETY: a valid socket and an int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const size).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        s.set_recv_buffer_size(size as usize)?;
    }
    Ok(s)
}

/// Packets the kernel dropped for this capture since the last call.
fn capture_drops(fd: RawFd) -> u64 {
    let mut stats = libc::tpacket_stats {
        tp_packets: 0,
        tp_drops: 0,
    };
    let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    // SAFETY: a valid socket and a buffer of the option's size.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            (&raw mut stats).cast(),
            &raw mut len,
        )
    };
    if rc == 0 {
        u64::from(stats.tp_drops)
    } else {
        0
    }
}

/// Reads every queued packet of the capture into `log`.
fn drain_capture(fd: RawFd, pod: &str, log: &Mutex<Vec<Arrival>>) {
    let mut buf = [0u8; 2048];
    let mut seen = Vec::new();
    loop {
        // SAFETY: zeroed sockaddr_ll is a valid out-parameter.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: buf and from are valid for the sizes passed.
        let n = unsafe {
            libc::recvfrom(
                fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
                (&raw mut from).cast(),
                &raw mut len,
            )
        };
        if n <= 0 {
            break;
        }
        if from.sll_pkttype == libc::PACKET_OUTGOING {
            continue;
        }
        if let Some(a) = parse_arrival(pod, u16::from_be(from.sll_protocol), &buf[..n as usize]) {
            seen.push(a);
        }
    }
    if !seen.is_empty()
        && let Ok(mut l) = log.lock()
    {
        l.extend(seen);
    }
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

/// A probe-relevant packet (IPv4 or IPv6 without extension headers; TCP,
/// UDP, ICMP echo request), or None.
fn parse_arrival(pod: &str, ethertype: u16, p: &[u8]) -> Option<Arrival> {
    const ETH_P_IP: u16 = 0x0800;
    const ETH_P_IPV6: u16 = 0x86dd;
    let (src, dst, protocol, l4) = match ethertype {
        ETH_P_IP if p.len() >= 20 && p[0] >> 4 == 4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            // A later fragment carries no L4 header.
            if be16(p, 6)? & 0x1fff != 0 {
                return None;
            }
            let a = |at: usize| IpAddr::V4(Ipv4Addr::new(p[at], p[at + 1], p[at + 2], p[at + 3]));
            (a(12), a(16), p[9], p.get(ihl..)?)
        }
        ETH_P_IPV6 if p.len() >= 40 && p[0] >> 4 == 6 => {
            let a = |at: usize| {
                let mut o = [0u8; 16];
                o.copy_from_slice(&p[at..at + 16]);
                IpAddr::V6(Ipv6Addr::from(o))
            };
            (a(8), a(24), p[6], &p[40..])
        }
        _ => return None,
    };
    let keep = |b: &[u8]| b[..b.len().min(KEEP)].to_vec();
    match protocol {
        6 => {
            let off = usize::from(*l4.get(12)? >> 4) * 4;
            let flags = *l4.get(13)?;
            Some(Arrival {
                pod: pod.to_owned(),
                from: SocketAddr::new(src, be16(l4, 0)?),
                to: SocketAddr::new(dst, be16(l4, 2)?),
                transport: Transport::Tcp,
                syn: flags & 0x12 == 0x02,
                payload: keep(l4.get(off..).unwrap_or_default()),
            })
        }
        17 => Some(Arrival {
            pod: pod.to_owned(),
            from: SocketAddr::new(src, be16(l4, 0)?),
            to: SocketAddr::new(dst, be16(l4, 2)?),
            transport: Transport::Udp,
            syn: false,
            payload: keep(l4.get(8..).unwrap_or_default()),
        }),
        // Echo requests only (ICMP 8, ICMPv6 128).
        1 | 58 if matches!(*l4.first()?, 8 | 128) => Some(Arrival {
            pod: pod.to_owned(),
            from: SocketAddr::new(src, be16(l4, 4)?),
            to: SocketAddr::new(dst, 0),
            transport: Transport::Ping,
            syn: false,
            payload: keep(l4.get(8..).unwrap_or_default()),
        }),
        _ => None,
    }
}

fn serve_pod(
    netns: &str,
    pod: &crate::SimPod,
    shared: &Shared,
    ready: &mpsc::Sender<Result<(), Error>>,
) {
    let sock_err = |source| Error::Socket {
        netns: netns.to_owned(),
        source,
    };
    let mut listeners = Vec::new();
    let mut udp = Vec::new();
    let mut capture = None;
    let bound = (|| -> Result<(), Error> {
        capture = Some(open_capture().map_err(sock_err)?);
        for ip in &pod.ips {
            for port in &pod.tcp_ports {
                let l = TcpListener::bind(SocketAddr::new(*ip, *port)).map_err(sock_err)?;
                l.set_nonblocking(true).map_err(sock_err)?;
                listeners.push(l);
            }
            for port in &pod.udp_ports {
                let s = UdpSocket::bind(SocketAddr::new(*ip, *port)).map_err(sock_err)?;
                s.set_nonblocking(true).map_err(sock_err)?;
                udp.push(s);
            }
        }
        Ok(())
    })();
    let failed = bound.is_err();
    let _ = ready.send(bound);
    let Some(capture) = capture.filter(|_| !failed) else {
        shared.drained.exited.store(true, Ordering::SeqCst);
        return;
    };
    let cap_fd = capture.as_raw_fd();
    let id = pod.id();
    let mut conns: HashMap<RawFd, TcpStream> = HashMap::new();
    let mut buf = [0u8; 2048];
    while !shared.stop.load(Ordering::Relaxed) {
        // Read before draining: every packet queued before the request
        // was made is then drained before it is acknowledged.
        let request = shared.request.load(Ordering::SeqCst);
        let fds: Vec<RawFd> = std::iter::once(cap_fd)
            .chain(listeners.iter().map(|l| l.as_raw_fd()))
            .chain(udp.iter().map(|u| u.as_raw_fd()))
            .chain(conns.keys().copied())
            .collect();
        for fd in crate::poll::readable(fds, TICK_MS) {
            if fd != cap_fd {
                serve_one(fd, &listeners, &udp, &mut conns, &mut buf);
            }
        }
        drain_capture(cap_fd, &id, &shared.log);
        let lost = capture_drops(cap_fd);
        if lost > 0 {
            shared.drained.lost.fetch_add(lost, Ordering::SeqCst);
        }
        shared.drained.seen.fetch_max(request, Ordering::SeqCst);
    }
    shared.drained.exited.store(true, Ordering::SeqCst);
}

fn serve_one(
    fd: RawFd,
    listeners: &[TcpListener],
    udp: &[UdpSocket],
    conns: &mut HashMap<RawFd, TcpStream>,
    buf: &mut [u8],
) {
    if let Some(l) = listeners.iter().find(|l| l.as_raw_fd() == fd) {
        while let Ok((mut s, _)) = l.accept() {
            let _ = s.set_nonblocking(true);
            let _ = s.write_all(GREETING);
            conns.insert(s.as_raw_fd(), s);
        }
    } else if let Some(u) = udp.iter().find(|u| u.as_raw_fd() == fd) {
        while let Ok((len, from)) = u.recv_from(buf) {
            let _ = u.send_to(&buf[..len], from);
        }
    } else if let Some(s) = conns.get_mut(&fd) {
        match s.read(buf) {
            Ok(0) => {
                conns.remove(&fd);
            }
            Ok(len) => {
                let _ = s.write_all(&buf[..len]);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => {
                conns.remove(&fd);
            }
        }
    }
}
