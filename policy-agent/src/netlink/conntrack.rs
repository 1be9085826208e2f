//! Setting a connmark bit on the conntrack entries of given addresses,
//! over ctnetlink (what `conntrack -U <side> <ip> --mark bit/bit` does).
//!
//! conntrack-tools updates each entry while its dump is still being read,
//! and the dump fails ("No buffer space available") once a few hundred
//! entries match: an ordinary busy pod. Here the dump is read to its end
//! first (filtered in the kernel to entries without the bit), then each
//! matching entry is updated. The update sends the bit with itself as the
//! mask (`CTA_MARK_MASK`), so the kernel sets it without touching the
//! other bits, whatever changed since the dump.
use std::net::IpAddr;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::Error;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLA_TYPE_MASK: u16 = 0x3fff;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_MARK: u16 = 8;
const CTA_ZONE: u16 = 18;
const CTA_MARK_MASK: u16 = 21;
const CTA_TUPLE_IP: u16 = 1;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;

/// Which address of a flow to match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FlowSide {
    /// The original direction's source (`conntrack -s`).
    OrigSrc,
    /// The original direction's destination (`conntrack -d`).
    OrigDst,
    /// The reply direction's source (`conntrack --reply-src`): the pod a
    /// Service's DNAT sent the flow to.
    ReplySrc,
}

/// What [`mark_flows`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MarkReport {
    /// Entries that now carry the bit, by the target that matched them.
    pub marked: Vec<((FlowSide, IpAddr), usize)>,
    /// Entries that went between the dump and their update.
    pub gone: usize,
}

/// One dumped entry: what the update needs, and what the targets match.
struct Entry {
    family: u8,
    /// The CTA_TUPLE_ORIG attribute as the kernel sent it (finds the
    /// entry again), and CTA_ZONE if any.
    key: Vec<u8>,
    orig_src: Option<IpAddr>,
    orig_dst: Option<IpAddr>,
    reply_src: Option<IpAddr>,
}

impl Entry {
    fn address(&self, side: FlowSide) -> Option<IpAddr> {
        match side {
            FlowSide::OrigSrc => self.orig_src,
            FlowSide::OrigDst => self.orig_dst,
            FlowSide::ReplySrc => self.reply_src,
        }
    }
}

/// Fault injection for the tests of what a failed revocation does (a
/// real failure cannot be produced on demand): while the file this names
/// exists, every revocation fails.
pub const FAULT_ENV: &str = "POLICY_AGENT_TEST_FAIL_CONNTRACK_WHILE";

fn injected_fault() -> Option<Error> {
    let flag = std::env::var_os(FAULT_ENV)?;
    std::path::Path::new(&flag)
        .exists()
        .then(|| Error::Request {
            what: "conntrack dump",
            source: std::io::Error::other(format!(
                "fault injected ({FAULT_ENV} names an existing file)"
            )),
        })
}

/// Sets `bit` in the connmark of every conntrack entry of the calling
/// thread's network namespace that matches one of `targets`.
pub fn mark_flows(targets: &[(FlowSide, IpAddr)], bit: u32) -> Result<MarkReport, Error> {
    let mut report = MarkReport {
        marked: targets.iter().map(|t| (*t, 0)).collect(),
        gone: 0,
    };
    if targets.is_empty() {
        return Ok(report);
    }
    if let Some(fault) = injected_fault() {
        return Err(fault);
    }
    let socket = open()?;
    // A dump the kernel marks interrupted (the table changed under it)
    // may have skipped entries: read it again, a bounded number of times.
    let mut entries = Vec::new();
    for attempt in 1..=4 {
        let (dumped, interrupted) = dump_without(&socket, bit)?;
        entries = dumped;
        if !interrupted {
            break;
        }
        if attempt == 4 {
            return Err(Error::Request {
                what: "conntrack dump",
                source: std::io::Error::new(
                    std::io::ErrorKind::Interrupted,
                    "the dump was interrupted four times in a row",
                ),
            });
        }
    }
    let mut seq = 1u32;
    for entry in &entries {
        let Some(hit) = report
            .marked
            .iter_mut()
            .find(|((side, ip), _)| entry.address(*side) == Some(*ip))
        else {
            continue;
        };
        seq = seq.wrapping_add(1);
        match update(&socket, entry, bit, seq) {
            Ok(()) => hit.1 += 1,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => report.gone += 1,
            Err(source) => {
                return Err(Error::Request {
                    what: "conntrack update",
                    source,
                });
            }
        }
    }
    Ok(report)
}

fn open() -> Result<Socket, Error> {
    let mut socket = Socket::new(NETLINK_NETFILTER).map_err(Error::Socket)?;
    socket.bind_auto().map_err(Error::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(Error::Socket)?;
    Ok(socket)
}

/// An nfnetlink message: header (type `subsys << 8 | kind`), nfgenmsg
/// (`family`, version 0, `res_id` in network order), attributes.
pub(crate) fn nfnetlink_message(
    subsys: u16,
    kind: u16,
    flags: u16,
    seq: u32,
    (family, res_id): (u8, u16),
    attrs: &[u8],
) -> Vec<u8> {
    let len = 16 + 4 + attrs.len();
    let mut buf = Vec::with_capacity(len);
    buf.extend_from_slice(&(len as u32).to_ne_bytes());
    buf.extend_from_slice(&((subsys << 8) | kind).to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&[family, 0]);
    buf.extend_from_slice(&res_id.to_be_bytes());
    buf.extend_from_slice(attrs);
    buf
}

/// A ctnetlink message (resource id 0).
fn message(kind: u16, flags: u16, seq: u32, family: u8, attrs: &[u8]) -> Vec<u8> {
    nfnetlink_message(NFNL_SUBSYS_CTNETLINK, kind, flags, seq, (family, 0), attrs)
}

fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len() + (4 - len % 4) % 4, 0);
}

/// The attributes in `buf`: (type without flags, value, the whole
/// attribute with its header and padding).
fn attrs(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8], &[u8])> {
    let mut offset = 0;
    std::iter::from_fn(move || {
        let rest = buf.get(offset..)?;
        let len = u16::from_ne_bytes([*rest.first()?, *rest.get(1)?]) as usize;
        let kind = u16::from_ne_bytes([*rest.get(2)?, *rest.get(3)?]);
        if len < 4 || len > rest.len() {
            return None;
        }
        let padded = (len + 3) & !3;
        offset += padded;
        Some((
            kind & NLA_TYPE_MASK,
            &rest[4..len],
            &rest[..padded.min(rest.len())],
        ))
    })
}

/// Source and destination of a CTA_TUPLE_* attribute's value.
fn tuple_addresses(tuple: &[u8]) -> (Option<IpAddr>, Option<IpAddr>) {
    let (mut src, mut dst) = (None, None);
    for (kind, value, _) in attrs(tuple) {
        if kind != CTA_TUPLE_IP {
            continue;
        }
        for (kind, v, _) in attrs(value) {
            let ip = match (kind, v.len()) {
                (CTA_IP_V4_SRC | CTA_IP_V4_DST, 4) => {
                    IpAddr::from(<[u8; 4]>::try_from(v).unwrap_or_default())
                }
                (CTA_IP_V6_SRC | CTA_IP_V6_DST, 16) => {
                    IpAddr::from(<[u8; 16]>::try_from(v).unwrap_or_default())
                }
                _ => continue,
            };
            match kind {
                CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = Some(ip),
                _ => dst = Some(ip),
            }
        }
    }
    (src, dst)
}

fn entry(family: u8, body: &[u8]) -> Entry {
    let mut entry = Entry {
        family,
        key: Vec::new(),
        orig_src: None,
        orig_dst: None,
        reply_src: None,
    };
    for (kind, value, whole) in attrs(body) {
        match kind {
            CTA_TUPLE_ORIG => {
                (entry.orig_src, entry.orig_dst) = tuple_addresses(value);
                entry.key.extend_from_slice(whole);
            }
            CTA_TUPLE_REPLY => entry.reply_src = tuple_addresses(value).0,
            CTA_ZONE => entry.key.extend_from_slice(whole),
            _ => {}
        }
    }
    entry
}

/// Every entry whose mark lacks `bit` (the kernel filters), read to the
/// end, and whether the kernel flagged the dump as interrupted.
fn dump_without(socket: &Socket, bit: u32) -> Result<(Vec<Entry>, bool), Error> {
    const WHAT: &str = "conntrack dump";
    let mut filter = Vec::new();
    attr(&mut filter, CTA_MARK, &0u32.to_be_bytes());
    attr(&mut filter, CTA_MARK_MASK, &bit.to_be_bytes());
    let request = message(
        IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        1,
        libc::AF_UNSPEC as u8,
        &filter,
    );
    socket
        .send(&request, 0)
        .map_err(|source| Error::Request { what: WHAT, source })?;
    let mut entries = Vec::new();
    let mut interrupted = false;
    let mut buf = vec![0u8; 1 << 18];
    loop {
        let size = socket
            .recv(&mut &mut buf[..], 0)
            .map_err(|source| Error::Request { what: WHAT, source })?;
        let mut offset = 0;
        while offset + 16 <= size {
            let header = &buf[offset..size];
            let len = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]) as usize;
            let kind = u16::from_ne_bytes([header[4], header[5]]);
            let flags = u16::from_ne_bytes([header[6], header[7]]);
            if len < 16 || len > header.len() {
                return Err(Error::Decode {
                    what: WHAT,
                    detail: format!("message length {len} at offset {offset} of {size}"),
                });
            }
            interrupted |= flags & NLM_F_DUMP_INTR != 0;
            match kind {
                NLMSG_DONE => return Ok((entries, interrupted)),
                NLMSG_ERROR => {
                    let code = header
                        .get(16..20)
                        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                        .unwrap_or(0);
                    if code != 0 {
                        return Err(Error::Request {
                            what: WHAT,
                            source: std::io::Error::from_raw_os_error(-code),
                        });
                    }
                }
                _ if len >= 20 => entries.push(entry(header[16], &header[20..len])),
                _ => {}
            }
            offset += (len + 3) & !3;
        }
    }
}

/// Sets `bit` on one entry (found by its original tuple and zone) and
/// waits for the kernel's answer.
fn update(socket: &Socket, entry: &Entry, bit: u32, seq: u32) -> std::io::Result<()> {
    let mut body = entry.key.clone();
    attr(&mut body, CTA_MARK, &bit.to_be_bytes());
    attr(&mut body, CTA_MARK_MASK, &bit.to_be_bytes());
    socket.send(
        &message(
            IPCTNL_MSG_CT_NEW,
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            entry.family,
            &body,
        ),
        0,
    )?;
    let mut buf = vec![0u8; 4096];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        if size < 20 {
            return Err(std::io::Error::other("short netlink answer"));
        }
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        let answer_seq = u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]);
        if kind != NLMSG_ERROR || answer_seq != seq {
            continue; // Not our acknowledgement.
        }
        let code = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
        return if code == 0 {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(-code))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NLA_F_NESTED: u16 = 0x8000;

    #[test]
    fn attributes_round_trip_with_padding() {
        let mut buf = Vec::new();
        attr(&mut buf, CTA_ZONE, &7u16.to_be_bytes());
        attr(&mut buf, CTA_MARK, &0x80u32.to_be_bytes());
        assert_eq!(buf.len(), 8 + 8, "the 2-byte zone is padded to 4");
        let parsed: Vec<(u16, Vec<u8>)> = attrs(&buf).map(|(k, v, _)| (k, v.to_vec())).collect();
        assert_eq!(
            parsed,
            [
                (CTA_ZONE, 7u16.to_be_bytes().to_vec()),
                (CTA_MARK, 0x80u32.to_be_bytes().to_vec())
            ]
        );
    }

    #[test]
    fn an_entry_yields_its_addresses_and_its_lookup_key() {
        let ip = |src: [u8; 4], dst: [u8; 4]| {
            let mut inner = Vec::new();
            attr(&mut inner, CTA_IP_V4_SRC, &src);
            attr(&mut inner, CTA_IP_V4_DST, &dst);
            let mut tuple = Vec::new();
            attr(&mut tuple, CTA_TUPLE_IP | NLA_F_NESTED, &inner);
            tuple
        };
        let mut body = Vec::new();
        attr(
            &mut body,
            CTA_TUPLE_ORIG | NLA_F_NESTED,
            &ip([10, 0, 0, 1], [10, 96, 0, 10]),
        );
        let orig_len = body.len();
        attr(
            &mut body,
            CTA_TUPLE_REPLY | NLA_F_NESTED,
            &ip([10, 244, 0, 11], [10, 0, 0, 1]),
        );
        attr(&mut body, CTA_MARK, &0u32.to_be_bytes());
        let e = entry(libc::AF_INET as u8, &body);
        assert_eq!(
            e.address(FlowSide::OrigSrc),
            Some("10.0.0.1".parse().unwrap())
        );
        assert_eq!(
            e.address(FlowSide::OrigDst),
            Some("10.96.0.10".parse().unwrap())
        );
        assert_eq!(
            e.address(FlowSide::ReplySrc),
            Some("10.244.0.11".parse().unwrap())
        );
        assert_eq!(e.key, body[..orig_len], "the original tuple, as sent");
    }

    #[test]
    fn a_truncated_attribute_ends_the_walk() {
        let mut buf = Vec::new();
        attr(&mut buf, CTA_MARK, &1u32.to_be_bytes());
        buf.extend_from_slice(&[40, 0, 8, 0, 1]); // claims 40 bytes, has 5
        assert_eq!(attrs(&buf).count(), 1);
    }
}
