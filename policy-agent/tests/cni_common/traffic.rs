//! Traffic judged at the receiver for the CNI tests: a capture of every
//! IPv4 packet entering a namespace (all interfaces, also those created
//! after it started: the capture runs before the pod's eth0 exists), TCP
//! and UDP listeners, and a flood of TCP SYNs and UDP datagrams.
use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use policy_agent::sim::NetNs;
use socket2::{Domain, Protocol, Socket, Type};

/// One IPv4 packet that reached the namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// 6 TCP, 17 UDP, 1 ICMP...
    pub proto: u8,
    pub dport: u16,
    pub at: Instant,
}

/// A capture plus listeners (TCP accepted and closed, UDP read) on `port`
/// in one namespace, from creation until drop.
pub struct Receiver {
    packets: Arc<Mutex<Vec<Packet>>>,
    accepted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Receiver {
    /// Starts capturing in `ns` and listening on `port` (TCP and UDP);
    /// returns once everything is open.
    pub fn start(ns: &NetNs, port: u16) -> Self {
        let packets = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let capture = {
            let (packets, stop, ready) = (packets.clone(), stop.clone(), ready_tx.clone());
            ns.spawn(move || capture(&packets, &stop, &ready)).unwrap()
        };
        let listen = {
            let (accepted, stop, ready) = (accepted.clone(), stop.clone(), ready_tx);
            ns.spawn(move || listen(port, &accepted, &stop, &ready))
                .unwrap()
        };
        for _ in 0..2 {
            ready_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("capture and listeners open");
        }
        Self {
            packets,
            accepted,
            stop,
            threads: vec![
                std::thread::spawn(move || {
                    let _ = capture.join();
                }),
                std::thread::spawn(move || {
                    let _ = listen.join();
                }),
            ],
        }
    }

    /// Every packet so far (after a short drain of what is queued).
    pub fn packets(&self) -> Vec<Packet> {
        std::thread::sleep(Duration::from_millis(100));
        self.packets.lock().unwrap().clone()
    }

    /// Packets from `src`.
    pub fn from(&self, src: Ipv4Addr) -> Vec<Packet> {
        self.packets()
            .into_iter()
            .filter(|p| p.src == src)
            .collect()
    }

    /// Packets to `dport` (TCP or UDP).
    pub fn to_port(&self, dport: u16) -> Vec<Packet> {
        self.packets()
            .into_iter()
            .filter(|p| p.dport == dport && (p.proto == 6 || p.proto == 17))
            .collect()
    }

    /// TCP connections accepted by the listener.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn capture(packets: &Mutex<Vec<Packet>>, stop: &AtomicBool, ready: &std::sync::mpsc::Sender<()>) {
    let all = i32::from((libc::ETH_P_ALL as u16).to_be());
    let s = Socket::new(Domain::PACKET, Type::DGRAM, Some(Protocol::from(all))).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let size: libc::c_int = 16 << 20;
    // SAFETY: a valid socket and an int option of the right size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const size).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    let _ = ready.send(());
    let mut buf = [0u8; 256];
    loop {
        // SAFETY: zeroed sockaddr_ll is a valid out-parameter.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: buf and from are valid for the sizes passed.
        let n = unsafe {
            libc::recvfrom(
                s.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&raw mut from).cast(),
                &raw mut len,
            )
        };
        if n <= 0 {
            // Timeout: stop only once the queue is empty.
            if stop.load(Ordering::Relaxed) {
                return;
            }
            continue;
        }
        let b = &buf[..n as usize];
        if from.sll_pkttype == libc::PACKET_OUTGOING
            || u16::from_be(from.sll_protocol) != libc::ETH_P_IP as u16
            || b.len() < 24
            || b[0] >> 4 != 4
        {
            continue;
        }
        let ihl = usize::from(b[0] & 0x0f) * 4;
        let dport = b
            .get(ihl + 2..ihl + 4)
            .map_or(0, |p| u16::from_be_bytes([p[0], p[1]]));
        packets.lock().unwrap().push(Packet {
            src: Ipv4Addr::new(b[12], b[13], b[14], b[15]),
            dst: Ipv4Addr::new(b[16], b[17], b[18], b[19]),
            proto: b[9],
            dport,
            at: Instant::now(),
        });
    }
}

fn listen(port: u16, accepted: &AtomicU64, stop: &AtomicBool, ready: &std::sync::mpsc::Sender<()>) {
    let tcp = TcpListener::bind(("0.0.0.0", port)).unwrap();
    tcp.set_nonblocking(true).unwrap();
    let udp = UdpSocket::bind(("0.0.0.0", port)).unwrap();
    udp.set_nonblocking(true).unwrap();
    let _ = ready.send(());
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        let mut idle = true;
        if let Ok((conn, _)) = tcp.accept() {
            accepted.fetch_add(1, Ordering::Relaxed);
            drop(conn);
            idle = false;
        }
        while udp.recv_from(&mut buf).is_ok() {
            idle = false;
        }
        if idle {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// TCP SYNs (a new non-blocking connect each time) and UDP datagrams to
/// `targets` from inside `ns`, as fast as one thread can, until stopped or
/// `limit` has passed. Sends fail while the namespace has no route yet;
/// that is counted, not fatal.
pub struct Flood {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Flood {
    pub fn start(ns: &NetNs, targets: Vec<SocketAddrV4>, limit: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let inner = ns
            .spawn(move || {
                let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
                udp.set_nonblocking(true).unwrap();
                let _ = ready_tx.send(());
                let until = Instant::now() + limit;
                while !s.load(Ordering::Relaxed) && Instant::now() < until {
                    for t in &targets {
                        if udp.send_to(b"flood", *t).is_ok() {
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                        let tcp = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
                        tcp.set_nonblocking(true).unwrap();
                        let addr: SocketAddr = (*t).into();
                        match tcp.connect(&addr.into()) {
                            Ok(()) => {
                                n.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
                                n.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => {}
                        }
                    }
                    // Sending fails at once while there is no route: do
                    // not spin the CPU the agent needs.
                    if n.load(Ordering::Relaxed) == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            })
            .unwrap();
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("flood started");
        Self {
            stop,
            sent,
            thread: Some(std::thread::spawn(move || {
                let _ = inner.join();
            })),
        }
    }

    /// Stops and returns how many sends the kernel accepted.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.sent.load(Ordering::Relaxed)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One TCP connection from `ns` to `to` within `timeout`: whether it
/// connected (the caller judges at the receiver too).
pub fn connect(ns: &NetNs, to: SocketAddrV4, timeout: Duration) -> bool {
    ns.spawn(move || std::net::TcpStream::connect_timeout(&to.into(), timeout).is_ok())
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

/// `count` UDP datagrams from `ns` to `to`.
pub fn send_udp(ns: &NetNs, to: SocketAddrV4, count: u32) {
    ns.spawn(move || {
        let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..count {
            let _ = udp.send_to(b"probe", to);
            std::thread::sleep(Duration::from_millis(5));
        }
    })
    .unwrap()
    .join()
    .unwrap()
    .unwrap();
}
