//! A minimal DNS server for a simulated kube-dns pod and a minimal
//! resolver client: A and AAAA answers from a fixed name table over UDP
//! and TCP (RFC 1035 §4.2.2 length prefix), NXDOMAIN for unknown names,
//! NOTIMP for anything but a standard query. Only what a test needs of
//! RFC 1035 is parsed: the header, one question, and answer records.
use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{Error, NetNs, backend::L4};

/// Record types the server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordType {
    A,
    Aaaa,
}

impl RecordType {
    fn code(self) -> u16 {
        match self {
            Self::A => 1,
            Self::Aaaa => 28,
        }
    }
}

const CLASS_IN: u16 = 1;
const RCODE_FORMERR: u8 = 1;
const RCODE_NXDOMAIN: u8 = 3;
const RCODE_NOTIMP: u8 = 4;
const TTL: u32 = 30;

/// Names (lower case, no trailing dot) and their addresses.
pub type NameTable = BTreeMap<String, Vec<IpAddr>>;

fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// A parsed question.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Question {
    id: u16,
    flags: u16,
    name: String,
    qtype: u16,
    qclass: u16,
    /// Bytes of the question section (echoed back).
    raw: Vec<u8>,
}

/// Reads a (non-compressed) name at `at`; returns it and the offset after.
fn read_name(msg: &[u8], mut at: usize) -> Option<(String, usize)> {
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*msg.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        if len & 0xc0 != 0 {
            return None;
        }
        let label = msg.get(at..at + len)?;
        labels.push(String::from_utf8_lossy(label).into_owned());
        at += len;
    }
    Some((labels.join("."), at))
}

/// Skips a possibly compressed name (answers use pointers).
fn skip_name(msg: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *msg.get(at)?;
        if len == 0 {
            return Some(at + 1);
        }
        if len & 0xc0 == 0xc0 {
            return Some(at + 2);
        }
        at += 1 + usize::from(len);
    }
}

fn u16_at(msg: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.get(at)?, *msg.get(at + 1)?]))
}

fn parse_question(msg: &[u8]) -> Option<Question> {
    let id = u16_at(msg, 0)?;
    let flags = u16_at(msg, 2)?;
    if u16_at(msg, 4)? != 1 {
        return None;
    }
    let (name, at) = read_name(msg, 12)?;
    let qtype = u16_at(msg, at)?;
    let qclass = u16_at(msg, at + 2)?;
    Some(Question {
        id,
        flags,
        name,
        qtype,
        qclass,
        raw: msg.get(12..at + 4)?.to_vec(),
    })
}

/// The response to one query message (None: too short to answer).
pub fn respond(table: &NameTable, query: &[u8]) -> Option<Vec<u8>> {
    let id = u16_at(query, 0)?;
    let Some(q) = parse_question(query) else {
        // Header only: FORMERR, no question echoed.
        let mut out = Vec::with_capacity(12);
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&(0x8000u16 | u16::from(RCODE_FORMERR)).to_be_bytes());
        out.extend_from_slice(&[0; 8]);
        return Some(out);
    };
    let opcode = (q.flags >> 11) & 0xf;
    let rd = q.flags & 0x0100;
    let mut answers: Vec<&IpAddr> = Vec::new();
    let rcode = if opcode != 0 || q.flags & 0x8000 != 0 {
        RCODE_NOTIMP
    } else {
        match table.get(&normalize(&q.name)) {
            None => RCODE_NXDOMAIN,
            Some(ips) => {
                if q.qclass == CLASS_IN {
                    answers = ips
                        .iter()
                        .filter(|ip| {
                            (q.qtype == RecordType::A.code() && ip.is_ipv4())
                                || (q.qtype == RecordType::Aaaa.code() && ip.is_ipv6())
                        })
                        .collect();
                }
                0
            }
        }
    };
    // QR, the query's opcode, AA, its RD; RA clear.
    let flags = 0x8000 | (opcode << 11) | 0x0400 | rd | u16::from(rcode);
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&q.id.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&q.raw);
    for ip in answers {
        // The name is the question's: a pointer to offset 12.
        out.extend_from_slice(&[0xc0, 12]);
        let (kind, data) = match ip {
            IpAddr::V4(a) => (RecordType::A, a.octets().to_vec()),
            IpAddr::V6(a) => (RecordType::Aaaa, a.octets().to_vec()),
        };
        out.extend_from_slice(&kind.code().to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&TTL.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
    }
    Some(out)
}

/// A standard query for `name`, recursion desired.
pub fn query(id: u16, name: &str, kind: RecordType) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes());
    out.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    for label in normalize(name).split('.').filter(|l| !l.is_empty()) {
        let bytes = &label.as_bytes()[..label.len().min(63)];
        out.push(bytes.len() as u8);
        out.extend_from_slice(bytes);
    }
    out.push(0);
    out.extend_from_slice(&kind.code().to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    out
}

/// What a resolver got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// NOERROR with these addresses (empty: the name exists without
    /// records of that type).
    Addresses(Vec<IpAddr>),
    NxDomain,
    /// Another response code.
    Rcode(u8),
    /// The server refused the connection or the port was unreachable.
    Refused,
    /// Nothing (valid) came back in time.
    Timeout,
}

/// Parses a response to the query with `id`.
pub fn parse_response(msg: &[u8], id: u16) -> Option<Resolution> {
    if u16_at(msg, 0)? != id {
        return None;
    }
    let flags = u16_at(msg, 2)?;
    if flags & 0x8000 == 0 {
        return None;
    }
    let rcode = (flags & 0xf) as u8;
    match rcode {
        0 => {}
        RCODE_NXDOMAIN => return Some(Resolution::NxDomain),
        other => return Some(Resolution::Rcode(other)),
    }
    let qd = u16_at(msg, 4)?;
    let an = u16_at(msg, 6)?;
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(msg, at)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        at = skip_name(msg, at)?;
        let kind = u16_at(msg, at)?;
        let len = usize::from(u16_at(msg, at + 8)?);
        let data = msg.get(at + 10..at + 10 + len)?;
        match (kind, len) {
            (1, 4) => out.push(IpAddr::from([data[0], data[1], data[2], data[3]])),
            (28, 16) => {
                let mut b = [0u8; 16];
                b.copy_from_slice(data);
                out.push(IpAddr::from(b));
            }
            _ => {}
        }
        at += 10 + len;
    }
    Some(Resolution::Addresses(out))
}

/// A DNS server in a pod, serving UDP and TCP on `port` of each address;
/// stopped and joined on drop.
pub struct DnsServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

impl DnsServer {
    pub fn start(
        netns: &NetNs,
        ips: &[IpAddr],
        port: u16,
        table: NameTable,
    ) -> Result<Self, Error> {
        let table: NameTable = table.into_iter().map(|(k, v)| (normalize(&k), v)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let ns_name = netns.name.clone();
        let ips = ips.to_vec();
        let thread_stop = stop.clone();
        let thread =
            netns.spawn(move || serve(&ns_name, &ips, port, &table, &thread_stop, &ready_tx))?;
        let this = Self {
            stop,
            thread: Some(thread),
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| Error::Invalid("DNS server did not start".into()))??;
        Ok(this)
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    netns: &str,
    ips: &[IpAddr],
    port: u16,
    table: &NameTable,
    stop: &AtomicBool,
    ready: &mpsc::Sender<Result<(), Error>>,
) {
    let sock_err = |source| Error::Socket {
        netns: netns.to_owned(),
        source,
    };
    let mut listeners = Vec::new();
    let mut udp = Vec::new();
    let bound = (|| -> Result<(), Error> {
        for ip in ips {
            let l = TcpListener::bind(SocketAddr::new(*ip, port)).map_err(sock_err)?;
            l.set_nonblocking(true).map_err(sock_err)?;
            listeners.push(l);
            let s = UdpSocket::bind(SocketAddr::new(*ip, port)).map_err(sock_err)?;
            s.set_nonblocking(true).map_err(sock_err)?;
            udp.push(s);
        }
        Ok(())
    })();
    let failed = bound.is_err();
    let _ = ready.send(bound);
    if failed {
        return;
    }
    let mut buf = [0u8; 1500];
    while !stop.load(Ordering::Relaxed) {
        let fds = listeners
            .iter()
            .map(|l| l.as_raw_fd())
            .chain(udp.iter().map(|u| u.as_raw_fd()));
        for fd in crate::poll::readable(fds, 100) {
            if let Some(l) = listeners.iter().find(|l| l.as_raw_fd() == fd) {
                while let Ok((s, _)) = l.accept() {
                    let _ = serve_tcp(s, table);
                }
            } else if let Some(u) = udp.iter().find(|u| u.as_raw_fd() == fd) {
                while let Ok((len, from)) = u.recv_from(&mut buf) {
                    if let Some(resp) = respond(table, &buf[..len]) {
                        let _ = u.send_to(&resp, from);
                    }
                }
            }
        }
    }
}

/// One TCP connection: length-prefixed queries until the client closes
/// (bounded, so a silent client cannot stall the server).
fn serve_tcp(mut s: TcpStream, table: &NameTable) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_millis(500)))?;
    loop {
        let mut len = [0u8; 2];
        match s.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut msg)?;
        if let Some(resp) = respond(table, &msg) {
            let mut framed = (resp.len() as u16).to_be_bytes().to_vec();
            framed.extend_from_slice(&resp);
            s.write_all(&framed)?;
        }
    }
}

/// A query id that differs between queries (and runs).
fn next_id() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u16)
        .unwrap_or(0);
    seed ^ NEXT.fetch_add(0x9e37, Ordering::Relaxed)
}

fn resolve_here(
    server: SocketAddr,
    name: &str,
    kind: RecordType,
    l4: L4,
    timeout: Duration,
) -> std::io::Result<Resolution> {
    let id = next_id();
    let msg = query(id, name, kind);
    let deadline = Instant::now() + timeout;
    let refused = |e: &std::io::Error| {
        matches!(
            e.kind(),
            ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset
        )
    };
    match l4 {
        L4::Udp => {
            let bind: SocketAddr = if server.is_ipv4() {
                ([0, 0, 0, 0], 0).into()
            } else {
                ([0u16; 8], 0).into()
            };
            let s = UdpSocket::bind(bind)?;
            s.connect(server)?;
            s.send(&msg)?;
            let mut buf = [0u8; 1500];
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(Resolution::Timeout);
                }
                s.set_read_timeout(Some(left))?;
                match s.recv(&mut buf) {
                    Ok(len) => {
                        if let Some(r) = parse_response(&buf[..len], id) {
                            return Ok(r);
                        }
                    }
                    Err(e) if refused(&e) => return Ok(Resolution::Refused),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        return Ok(Resolution::Timeout);
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        L4::Tcp => {
            let mut s = match TcpStream::connect_timeout(&server, timeout) {
                Ok(s) => s,
                Err(e) if refused(&e) => return Ok(Resolution::Refused),
                Err(e) if e.kind() == ErrorKind::TimedOut => return Ok(Resolution::Timeout),
                Err(e) => return Err(e),
            };
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            s.set_read_timeout(Some(left))?;
            let mut framed = (msg.len() as u16).to_be_bytes().to_vec();
            framed.extend_from_slice(&msg);
            s.write_all(&framed)?;
            let mut len = [0u8; 2];
            let read = s.read_exact(&mut len).and_then(|()| {
                let mut resp = vec![0u8; usize::from(u16::from_be_bytes(len))];
                s.read_exact(&mut resp).map(|()| resp)
            });
            match read {
                Ok(resp) => Ok(parse_response(&resp, id).unwrap_or(Resolution::Timeout)),
                Err(e) if refused(&e) => Ok(Resolution::Refused),
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::UnexpectedEof
                    ) =>
                {
                    Ok(Resolution::Timeout)
                }
                Err(e) => Err(e),
            }
        }
    }
}

/// Asks `server` (e.g. the kube-dns ClusterIP on port 53) for `name`
/// from inside `netns`, over UDP or TCP, waiting at most `timeout`.
pub fn resolve(
    netns: &NetNs,
    server: SocketAddr,
    name: &str,
    kind: RecordType,
    l4: L4,
    timeout: Duration,
) -> Result<Resolution, Error> {
    let ns_name = netns.name.clone();
    let name = name.to_owned();
    netns
        .spawn(move || resolve_here(server, &name, kind, l4, timeout))?
        .join()
        .map_err(|_| Error::Invalid("resolver thread panicked".into()))??
        .map_err(|source| Error::Socket {
            netns: ns_name,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> NameTable {
        let mut t = NameTable::new();
        t.insert(
            "web.default.svc.cluster.local".into(),
            vec![
                "10.96.0.50".parse().unwrap(),
                "fd00:96::50".parse().unwrap(),
            ],
        );
        t.insert("v4only.example".into(), vec!["192.0.2.1".parse().unwrap()]);
        t
    }

    #[test]
    fn answers_a_aaaa_nodata_and_nxdomain() {
        let t = table();
        let resp = respond(
            &t,
            &query(7, "WEB.default.svc.cluster.local.", RecordType::A),
        )
        .unwrap();
        assert_eq!(
            parse_response(&resp, 7),
            Some(Resolution::Addresses(vec!["10.96.0.50".parse().unwrap()]))
        );
        let resp = respond(
            &t,
            &query(8, "web.default.svc.cluster.local", RecordType::Aaaa),
        )
        .unwrap();
        assert_eq!(
            parse_response(&resp, 8),
            Some(Resolution::Addresses(vec!["fd00:96::50".parse().unwrap()]))
        );
        let resp = respond(&t, &query(9, "v4only.example", RecordType::Aaaa)).unwrap();
        assert_eq!(
            parse_response(&resp, 9),
            Some(Resolution::Addresses(vec![]))
        );
        let resp = respond(&t, &query(10, "nope.example", RecordType::A)).unwrap();
        assert_eq!(parse_response(&resp, 10), Some(Resolution::NxDomain));
        // Another id is not our answer.
        assert_eq!(parse_response(&resp, 11), None);
        // The question is echoed and the header is a response.
        assert_eq!(resp[2] & 0x80, 0x80);
        assert_eq!(u16_at(&resp, 4), Some(1));
    }

    #[test]
    fn malformed_and_unsupported_queries_get_error_codes() {
        let t = table();
        assert_eq!(respond(&t, &[1]), None);
        let resp = respond(&t, &[0, 5, 1, 0, 0, 1, 0, 0]).unwrap();
        assert_eq!(
            parse_response(&resp, 5),
            Some(Resolution::Rcode(RCODE_FORMERR))
        );
        let mut notify = query(6, "web.default.svc.cluster.local", RecordType::A);
        notify[2] |= 4 << 3; // opcode NOTIFY
        let resp = respond(&t, &notify).unwrap();
        assert_eq!(
            parse_response(&resp, 6),
            Some(Resolution::Rcode(RCODE_NOTIMP))
        );
    }
}
