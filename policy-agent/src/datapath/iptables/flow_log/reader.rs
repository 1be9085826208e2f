//! The nfnetlink_log reader: binds the records' NFLOG group on a raw
//! NETLINK_NETFILTER socket and turns each logged packet into a
//! [`FlowRecord`].
//!
//! The group is bound without `PF_BIND`: the NFLOG target reaches
//! nfnetlink_log by itself, and `PF_BIND` would make it the namespace's
//! default logger for every other netfilter log (conntrack's invalid
//! packets among them).
//!
//! What is lost is counted where the kernel lets it be:
//! - past the per-node budget, by the rule of `pa-agent:LIMITED` and
//!   `LIMITED-DROP` ([`limited_records`]): exact, and the counters start
//!   again when the chains are rewritten (another rate);
//! - past this socket's buffer, by the sequence number each message
//!   carries (`NFULNL_CFG_F_SEQ`): the gaps ([`ReaderStats::lost`]), exact
//!   but for the last messages before the reader stops;
//! - a record the kernel could not even allocate is not counted anywhere.
use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use policy_common::event::FlowRecord;
use tracing::{debug, warn};

use super::{
    Error,
    packet::{
        NFNL_SUBSYS_ULOG, NFULA_CFG_CMD, NFULA_CFG_FLAGS, NFULA_CFG_MODE, NFULA_CFG_QTHRESH,
        NFULA_CFG_TIMEOUT, NFULNL_CFG_CMD_BIND, NFULNL_CFG_F_SEQ, NFULNL_COPY_PACKET,
        NFULNL_MSG_CONFIG, NFULNL_MSG_PACKET, NLM_F_ACK, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR,
        attr, logged, message, messages, record,
    },
};
use crate::{
    datapath::iptables::{Backend, Family, LIMITED_CHAIN, LIMITED_COMMENT, LIMITED_DROP_CHAIN},
    exec,
};

/// Bytes of each packet copied: an IPv6 header with a few extension
/// headers and the L4 ports.
const COPY_RANGE: u32 = 160;
/// The kernel sends a batch at this many messages...
const QUEUE_THRESHOLD: u32 = 32;
/// ... or after this long (hundredths of a second): a record is late by
/// at most 50 ms.
const FLUSH_TIMEOUT: u32 = 5;
/// The socket's receive buffer: room for a burst of the default budget
/// many times over.
const RECEIVE_BUFFER: libc::c_int = 4 << 20;

/// What a reader saw besides its records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderStats {
    /// Records handed out.
    pub records: u64,
    /// Records the kernel logged that never reached this socket (gaps in
    /// the message sequence: the buffer was full).
    pub lost: u64,
    /// Times the socket reported its buffer overrun (ENOBUFS).
    pub overruns: u64,
    /// Messages in the group that are not this agent's records (another
    /// tool's prefix, a packet that is not IP).
    pub foreign: u64,
}

/// The one reader of an NFLOG group.
pub struct IptablesFlowReader {
    fd: OwnedFd,
    group: u16,
    buf: Vec<u8>,
    /// Records that came in while the bind was acknowledged.
    pending: Vec<FlowRecord>,
    next_seq: Option<u32>,
    stats: ReaderStats,
}

fn os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write into; both clocks always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Whether this process may configure netfilter (CAP_NET_ADMIN in its
/// effective set): tells a group held by another socket from a refusal.
fn has_net_admin() -> bool {
    const CAP_NET_ADMIN: u32 = 12;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_owned();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_NET_ADMIN) != 0)
}

impl IptablesFlowReader {
    /// Binds NFLOG group `group` in the calling thread's network
    /// namespace. Only one socket can bind a group: a second one gets
    /// [`Error::GroupTaken`].
    pub fn open(group: u16) -> Result<Self, Error> {
        // SAFETY: plain socket(2); the descriptor is owned below.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_NETFILTER,
            )
        };
        if raw < 0 {
            return Err(Error::Socket(os_error()));
        }
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a zeroed sockaddr_nl is valid; the kernel picks the port.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `addr` is a sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(Error::Socket(os_error()));
        }
        // A larger buffer than the default: FORCE passes rmem_max as root,
        // the plain option is the fallback.
        let size = RECEIVE_BUFFER;
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            // SAFETY: an int option of the size given.
            let rc = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&raw const size).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
        }
        let mut this = Self {
            fd,
            group,
            buf: vec![0; 1 << 17],
            pending: Vec::new(),
            // The instance is new (the bind makes it): it numbers from 0.
            next_seq: Some(0),
            stats: ReaderStats::default(),
        };
        this.bind()?;
        Ok(this)
    }

    /// The group this reader holds.
    pub fn group(&self) -> u16 {
        self.group
    }

    pub fn stats(&self) -> ReaderStats {
        self.stats
    }

    /// One configuration message: bind, copy the packet's first bytes,
    /// batch, number the messages.
    fn bind(&mut self) -> Result<(), Error> {
        let mut a = Vec::new();
        attr(&mut a, NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
        // struct nfulnl_msg_config_mode: copy_range (be32), copy_mode, pad.
        let mut mode = COPY_RANGE.to_be_bytes().to_vec();
        mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
        attr(&mut a, NFULA_CFG_MODE, &mode);
        attr(&mut a, NFULA_CFG_QTHRESH, &QUEUE_THRESHOLD.to_be_bytes());
        attr(&mut a, NFULA_CFG_TIMEOUT, &FLUSH_TIMEOUT.to_be_bytes());
        attr(&mut a, NFULA_CFG_FLAGS, &NFULNL_CFG_F_SEQ.to_be_bytes());
        const SEQ: u32 = 1;
        let msg = message(
            NFULNL_MSG_CONFIG,
            NLM_F_REQUEST | NLM_F_ACK,
            SEQ,
            libc::AF_UNSPEC as u8,
            self.group,
            &a,
        );
        // SAFETY: sending a buffer of the length given.
        let rc = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if rc < 0 {
            return Err(Error::Bind {
                group: self.group,
                source: os_error(),
            });
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Bind {
                    group: self.group,
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no acknowledgement from nfnetlink_log",
                    ),
                });
            }
            let n = self.receive(left).map_err(|source| Error::Bind {
                group: self.group,
                source,
            })?;
            let mut ack = None;
            let (records, stats) = self.parse(n, |kind, seq, body| {
                if kind == NLMSG_ERROR && seq == SEQ {
                    ack = body
                        .get(0..4)
                        .and_then(|b| b.try_into().ok())
                        .map(i32::from_ne_bytes);
                }
            });
            self.pending.extend(records);
            self.add(stats);
            match ack {
                None => continue,
                Some(0) => return Ok(()),
                Some(code) => {
                    let errno = -code;
                    let group = self.group;
                    return Err(match errno {
                        // Another socket's instance: EPERM (another port
                        // id) or EBUSY; EPERM also without the capability.
                        libc::EPERM if !has_net_admin() => Error::NotPermitted { group },
                        libc::EPERM | libc::EBUSY => Error::GroupTaken { group },
                        _ => Error::Bind {
                            group,
                            source: std::io::Error::from_raw_os_error(errno),
                        },
                    });
                }
            }
        }
    }

    /// Waits up to `timeout` for a datagram; its length (0: none came).
    fn receive(&mut self, timeout: Duration) -> std::io::Result<usize> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready < 0 {
            let e = os_error();
            return if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(0)
            } else {
                Err(e)
            };
        }
        if ready == 0 {
            return Ok(0);
        }
        self.receive_now()
    }

    /// One datagram if one is waiting (0: none).
    fn receive_now(&mut self) -> std::io::Result<usize> {
        // SAFETY: receiving into our buffer, at most its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(0),
            // Messages were dropped; the sequence gaps count how many.
            Some(libc::ENOBUFS) => {
                self.stats.overruns += 1;
                Ok(0)
            }
            _ => Err(e),
        }
    }

    /// The records in the first `n` bytes of the buffer; `other` sees
    /// every other message (type, seq, body).
    fn parse(
        &mut self,
        n: usize,
        mut other: impl FnMut(u16, u32, &[u8]),
    ) -> (Vec<FlowRecord>, ReaderStats) {
        let mut stats = ReaderStats::default();
        let mut out = Vec::new();
        // Read once per datagram: a later step of the wall clock moves
        // only later records.
        let now = clock_ns(libc::CLOCK_MONOTONIC);
        let offset = clock_ns(libc::CLOCK_REALTIME).saturating_sub(now);
        for (kind, _, seq, body) in messages(&self.buf[..n]) {
            if kind != (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET {
                if kind != NLMSG_DONE {
                    other(kind, seq, body);
                }
                continue;
            }
            let Some(l) = logged(body) else {
                stats.foreign += 1;
                continue;
            };
            if let Some(seq) = l.seq {
                if let Some(want) = self.next_seq {
                    stats.lost += u64::from(seq.wrapping_sub(want));
                }
                self.next_seq = Some(seq.wrapping_add(1));
            }
            match record(&l, |real| real.saturating_sub(offset), now) {
                Some(r) => out.push(r),
                None => stats.foreign += 1,
            }
        }
        stats.records = out.len() as u64;
        (out, stats)
    }

    fn add(&mut self, s: ReaderStats) {
        self.stats.records += s.records;
        self.stats.lost += s.lost;
        self.stats.overruns += s.overruns;
        self.stats.foreign += s.foreign;
    }

    /// The records that came within `timeout`: waits for the first
    /// datagram, then takes what else is queued without waiting. Empty
    /// when nothing came (or the socket failed: logged, and the wait is
    /// kept so a caller's loop does not spin).
    pub fn next_batch(&mut self, timeout: Duration) -> Vec<FlowRecord> {
        let mut out = std::mem::take(&mut self.pending);
        let started = Instant::now();
        let mut first = out.is_empty();
        loop {
            let got = if first {
                self.receive(timeout)
            } else {
                self.receive_now()
            };
            first = false;
            match got {
                Ok(0) => break,
                Ok(n) => {
                    let (records, stats) = self.parse(n, |kind, _, _| {
                        debug!(kind, "nfnetlink_log: a message that is no packet");
                    });
                    out.extend(records);
                    self.add(stats);
                    // Bounded: a flood is returned in pieces.
                    if out.len() >= 4096 {
                        break;
                    }
                }
                Err(e) => {
                    warn!(group = self.group, error = %e, "reading flow records");
                    std::thread::sleep(timeout.saturating_sub(started.elapsed()));
                    break;
                }
            }
        }
        out
    }
}

/// Records the per-node budget held back since the record chains were
/// written, summed over both families: the packet counters of
/// `pa-agent:LIMITED` and `LIMITED-DROP` (0 where they are not
/// installed).
pub fn limited_records(backend: Backend) -> Result<u64, Error> {
    let mut total = 0;
    for fam in Family::BOTH {
        let base = if fam == Family::V4 {
            "iptables"
        } else {
            "ip6tables"
        };
        let tool = match backend {
            Backend::Auto => base.to_owned(),
            Backend::Nft => format!("{base}-nft"),
            Backend::Legacy => format!("{base}-legacy"),
        };
        for chain in [LIMITED_CHAIN, LIMITED_DROP_CHAIN] {
            let listed = match exec::run(
                &tool,
                &["-w", "-t", "filter", "-L", chain, "-v", "-x", "-n"],
            ) {
                Ok(text) => text,
                // Not installed: records are off.
                Err(exec::CommandError::Failed { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            total += packet_counts(&listed);
        }
    }
    Ok(total)
}

/// The packet count of the counting rule in an `iptables -L -v -x -n`
/// listing (the chain's content-hash marker above it counts too).
fn packet_counts(listing: &str) -> u64 {
    listing
        .lines()
        .filter(|l| l.contains(LIMITED_COMMENT))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_of_a_listing_are_summed() {
        let listing = "Chain pa-agent:LIMITED (3 references)\n    pkts      bytes target     prot opt in     out     source               destination\n      17     1020            0    --  *      *       0.0.0.0/0            0.0.0.0/0            /* policy-agent:d608ddd4745ed2fb */\n      17     1020 RETURN     0    --  *      *       0.0.0.0/0            0.0.0.0/0            /* pa-agent: flow records over the budget */\n";
        assert_eq!(packet_counts(listing), 17);
        assert_eq!(packet_counts("Chain x (0 references)\n pkts bytes\n"), 0);
    }
}
