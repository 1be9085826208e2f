//! nfnetlink_log messages as bytes: the configuration a reader sends, and
//! the packet messages it reads turned into flow records.
use policy_common::{
    direction,
    event::{FlowRecord, RECORD_NEW_FLOW},
    family, proto,
    verdict::Reason,
};

use super::prefix::RecordPrefix;

pub(super) const NFNL_SUBSYS_ULOG: u16 = 4;
pub(super) const NFULNL_MSG_PACKET: u16 = 0;
pub(super) const NFULNL_MSG_CONFIG: u16 = 1;
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
const NLA_TYPE_MASK: u16 = 0x3fff;

// Configuration attributes and commands.
pub(super) const NFULA_CFG_CMD: u16 = 1;
pub(super) const NFULA_CFG_MODE: u16 = 2;
pub(super) const NFULA_CFG_TIMEOUT: u16 = 4;
pub(super) const NFULA_CFG_QTHRESH: u16 = 5;
pub(super) const NFULA_CFG_FLAGS: u16 = 6;
pub(super) const NFULNL_CFG_CMD_BIND: u8 = 1;
pub(super) const NFULNL_COPY_PACKET: u8 = 2;
/// Number each message: a gap is a record the socket never got.
pub(super) const NFULNL_CFG_F_SEQ: u16 = 0x0001;

// Packet attributes.
const NFULA_TIMESTAMP: u16 = 3;
const NFULA_IFINDEX_INDEV: u16 = 4;
const NFULA_IFINDEX_OUTDEV: u16 = 5;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;
const NFULA_SEQ: u16 = 12;

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO: u8 = 8;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;

/// An nfnetlink_log message (see `netlink::conntrack::nfnetlink_message`).
pub(super) fn message(
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) -> Vec<u8> {
    crate::netlink::conntrack::nfnetlink_message(
        NFNL_SUBSYS_ULOG,
        kind,
        flags,
        seq,
        (family, res_id),
        attrs,
    )
}

pub(super) fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len() + (4 - len % 4) % 4, 0);
}

/// The messages of one datagram: (type, flags, seq, the bytes after the
/// header). Stops at a header that does not fit.
pub(super) fn messages(buf: &[u8]) -> impl Iterator<Item = (u16, u16, u32, &[u8])> {
    let mut offset = 0;
    std::iter::from_fn(move || {
        let rest = buf.get(offset..)?;
        let len = u32::from_ne_bytes(rest.get(0..4)?.try_into().ok()?) as usize;
        if len < 16 || len > rest.len() {
            return None;
        }
        let kind = u16::from_ne_bytes(rest.get(4..6)?.try_into().ok()?);
        let flags = u16::from_ne_bytes(rest.get(6..8)?.try_into().ok()?);
        let seq = u32::from_ne_bytes(rest.get(8..12)?.try_into().ok()?);
        offset += (len + 3) & !3;
        Some((kind, flags, seq, &rest[16..len]))
    })
}

/// The attributes in `buf`: (type without flags, value).
fn attrs(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut offset = 0;
    std::iter::from_fn(move || {
        let rest = buf.get(offset..)?;
        let len = u16::from_ne_bytes([*rest.first()?, *rest.get(1)?]) as usize;
        let kind = u16::from_ne_bytes([*rest.get(2)?, *rest.get(3)?]);
        if len < 4 || len > rest.len() {
            return None;
        }
        offset += (len + 3) & !3;
        Some((kind & NLA_TYPE_MASK, &rest[4..len]))
    })
}

fn be32(v: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(v.get(0..4)?.try_into().ok()?))
}

fn be64(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.get(0..8)?.try_into().ok()?))
}

/// One packet message of nfnetlink_log, as far as a record needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Logged<'a> {
    pub prefix: Option<&'a str>,
    pub payload: &'a [u8],
    pub indev: u32,
    pub outdev: u32,
    /// Wall-clock time the kernel gives (only on hooks up to FORWARD).
    pub realtime_ns: Option<u64>,
    pub seq: Option<u32>,
}

/// A packet message's body (after the netlink header): nfgenmsg, then
/// attributes.
pub(super) fn logged(body: &[u8]) -> Option<Logged<'_>> {
    let mut out = Logged::default();
    for (kind, value) in attrs(body.get(4..)?) {
        match kind {
            NFULA_PREFIX => {
                let text = value.split(|b| *b == 0).next().unwrap_or_default();
                out.prefix = std::str::from_utf8(text).ok();
            }
            NFULA_PAYLOAD => out.payload = value,
            NFULA_IFINDEX_INDEV => out.indev = be32(value)?,
            NFULA_IFINDEX_OUTDEV => out.outdev = be32(value)?,
            NFULA_SEQ => out.seq = be32(value),
            NFULA_TIMESTAMP => {
                let (sec, usec) = (be64(value)?, be64(value.get(8..)?)?);
                out.realtime_ns = sec
                    .checked_mul(1_000_000_000)
                    .and_then(|ns| ns.checked_add(usec.saturating_mul(1000)));
            }
            _ => {}
        }
    }
    Some(out)
}

/// Addresses, protocol and ports of an IP packet (the L4 fields stay 0
/// when the header is cut off, or for a later fragment).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Headers {
    pub family: u8,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub protocol: u8,
    pub sport: u16,
    pub dport: u16,
}

pub(super) fn headers(ip: &[u8]) -> Option<Headers> {
    let mut h = Headers::default();
    let (l4, later_fragment) = match ip.first()? >> 4 {
        4 => {
            let ihl = usize::from(ip.first()? & 0x0f) * 4;
            if ihl < 20 || ip.len() < 20 {
                return None;
            }
            h.family = family::IPV4;
            h.protocol = ip[9];
            h.src[..4].copy_from_slice(&ip[12..16]);
            h.dst[..4].copy_from_slice(&ip[16..20]);
            let offset = u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff;
            (ip.get(ihl..), offset != 0)
        }
        6 => {
            if ip.len() < 40 {
                return None;
            }
            h.family = family::IPV6;
            h.src.copy_from_slice(&ip[8..24]);
            h.dst.copy_from_slice(&ip[24..40]);
            let (mut next, mut at, mut later) = (ip[6], 40usize, false);
            // Extension headers, a bounded number: hop-by-hop, routing,
            // destination options (8-byte units), AH (4-byte units),
            // fragment (8 bytes).
            for _ in 0..8 {
                match next {
                    0 | 43 | 60 | 51 => {
                        let (n, len) = (*ip.get(at)?, usize::from(*ip.get(at + 1)?));
                        at += if next == 51 {
                            (len + 2) * 4
                        } else {
                            (len + 1) * 8
                        };
                        next = n;
                    }
                    44 => {
                        let frag = ip.get(at..at + 8)?;
                        later = u16::from_be_bytes([frag[2], frag[3]]) & 0xfff8 != 0;
                        next = frag[0];
                        at += 8;
                    }
                    _ => break,
                }
            }
            h.protocol = next;
            (ip.get(at..), later)
        }
        _ => return None,
    };
    let Some(l4) = l4.filter(|_| !later_fragment) else {
        return Some(h);
    };
    match h.protocol {
        proto::TCP | proto::UDP | proto::SCTP if l4.len() >= 4 => {
            h.sport = u16::from_be_bytes([l4[0], l4[1]]);
            h.dport = u16::from_be_bytes([l4[2], l4[3]]);
        }
        // As the classifier: an echo's identifier in both.
        proto::ICMP | proto::ICMPV6 if l4.len() >= 6 => {
            let echo = if h.protocol == proto::ICMP {
                matches!(l4[0], ICMP_ECHO | ICMP_ECHO_REPLY)
            } else {
                matches!(l4[0], ICMPV6_ECHO_REQUEST | ICMPV6_ECHO_REPLY)
            };
            if echo {
                let id = u16::from_be_bytes([l4[4], l4[5]]);
                h.sport = id;
                h.dport = id;
            }
        }
        _ => {}
    }
    Some(h)
}

/// The record of one logged packet; `to_monotonic` turns the kernel's
/// wall-clock stamp into CLOCK_MONOTONIC ns, `now` is the monotonic time
/// it was read (for hooks that give no stamp). None: not one of ours.
pub(super) fn record(
    logged: &Logged<'_>,
    to_monotonic: impl Fn(u64) -> u64,
    now: u64,
) -> Option<FlowRecord> {
    let prefix = RecordPrefix::decode(logged.prefix?)?;
    let h = headers(logged.payload)?;
    // The pod's host interface: what it sent came in by it, what it
    // receives goes out by it (0 when the hook has none: OUTPUT).
    let ifindex = if prefix.direction == direction::EGRESS {
        logged.indev
    } else {
        logged.outdev
    };
    let new_flow = matches!(
        prefix.reason,
        Reason::AllowPolicy
            | Reason::AllowAdminTier
            | Reason::AllowBaselineTier
            | Reason::DropPolicy
            | Reason::DropAdminTier
            | Reason::DropBaselineTier
    );
    Some(FlowRecord {
        timestamp_ns: logged.realtime_ns.map_or(now, to_monotonic),
        ifindex,
        endpoint_identity: prefix.identity,
        src: h.src,
        dst: h.dst,
        sport: h.sport,
        dport: h.dport,
        protocol: h.protocol,
        family: h.family,
        direction: prefix.direction,
        reason: prefix.reason as u8,
        rule: prefix.rule(),
        flags: if new_flow { RECORD_NEW_FLOW } else { 0 },
        ..FlowRecord::default()
    })
}

#[cfg(test)]
mod tests {
    use policy_common::event::RuleRef;

    use super::*;

    /// A packet message as nfnetlink_log builds it (attributes in its
    /// order, values in network order).
    fn packet_message(
        prefix: &str,
        payload: &[u8],
        indev: u32,
        outdev: u32,
        stamp: Option<(u64, u64)>,
        seq: u32,
    ) -> Vec<u8> {
        let mut a = Vec::new();
        attr(&mut a, 1, &[0x08, 0x00, 2, 0]); // NFULA_PACKET_HDR
        attr(&mut a, NFULA_PREFIX, format!("{prefix}\0").as_bytes());
        if indev != 0 {
            attr(&mut a, NFULA_IFINDEX_INDEV, &indev.to_be_bytes());
        }
        if outdev != 0 {
            attr(&mut a, NFULA_IFINDEX_OUTDEV, &outdev.to_be_bytes());
        }
        if let Some((sec, usec)) = stamp {
            let mut ts = sec.to_be_bytes().to_vec();
            ts.extend_from_slice(&usec.to_be_bytes());
            attr(&mut a, NFULA_TIMESTAMP, &ts);
        }
        attr(&mut a, NFULA_SEQ, &seq.to_be_bytes());
        attr(&mut a, NFULA_PAYLOAD, payload);
        message(NFULNL_MSG_PACKET, 0, 0, libc::AF_INET as u8, 10410, &a)
    }

    fn tcp_v4_syn() -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 60, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0];
        p.extend_from_slice(&[10, 244, 1, 10, 10, 244, 1, 12]);
        p.extend_from_slice(&[0xc3, 0x50, 0, 80, 0, 0, 0, 1, 0, 0, 0, 0, 0xa0, 0x02]);
        p
    }

    #[test]
    fn a_hand_built_message_becomes_its_record() {
        let prefix = RecordPrefix::new(
            Reason::AllowPolicy,
            direction::INGRESS,
            0x1a,
            RuleRef {
                network_policy: 0x2a,
                ..RuleRef::default()
            },
        );
        let msg = packet_message(
            &prefix.encode(),
            &tcp_v4_syn(),
            7,
            9,
            Some((1_700_000_000, 250)),
            5,
        );
        let mut all: Vec<_> = messages(&msg).collect();
        assert_eq!(all.len(), 1);
        let (kind, _, _, body) = all.remove(0);
        assert_eq!(kind, (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET);
        let l = logged(body).unwrap();
        assert_eq!((l.indev, l.outdev, l.seq), (7, 9, Some(5)));
        assert_eq!(l.realtime_ns, Some(1_700_000_000_000_250_000));
        let r = record(&l, |real| real - 1_000, 0).unwrap();
        assert_eq!(r.timestamp_ns, 1_700_000_000_000_249_000);
        // Ingress: the pod's interface is where the packet goes out.
        assert_eq!(r.ifindex, 9);
        assert_eq!(r.endpoint_identity, 0x1a);
        assert_eq!(r.direction, direction::INGRESS);
        assert_eq!(r.reason, Reason::AllowPolicy as u8);
        assert_eq!(r.rule.network_policy, 0x2a);
        assert_eq!(r.flags, RECORD_NEW_FLOW);
        assert_eq!(
            (r.family, r.protocol, r.sport, r.dport),
            (family::IPV4, proto::TCP, 50000, 80)
        );
        assert_eq!(&r.src[..4], &[10, 244, 1, 10]);
        assert_eq!(&r.dst[..4], &[10, 244, 1, 12]);
        assert_eq!(r.src[4..], [0; 12]);
    }

    #[test]
    fn an_egress_drop_without_a_stamp_takes_the_input_interface_and_now() {
        let prefix =
            RecordPrefix::new(Reason::DropPolicy, direction::EGRESS, 3, RuleRef::default());
        // IPv6 with a hop-by-hop header before UDP.
        let mut p = vec![0x60, 0, 0, 0, 0, 16, 0, 64];
        p.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        p.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        p.extend_from_slice(&[17, 0, 1, 4, 0, 0, 0, 0]);
        p.extend_from_slice(&[0x13, 0x89, 0, 53, 0, 8, 0, 0]);
        let two = [
            packet_message(&prefix.encode(), &p, 4, 0, None, 1),
            packet_message("some other tool", &p, 4, 0, None, 2),
        ]
        .concat();
        let records: Vec<FlowRecord> = messages(&two)
            .filter_map(|(_, _, _, body)| record(&logged(body)?, |_| 0, 77))
            .collect();
        assert_eq!(records.len(), 1, "another prefix is not a record");
        let r = records[0];
        assert_eq!((r.ifindex, r.timestamp_ns), (4, 77));
        assert_eq!(
            (r.family, r.protocol, r.sport, r.dport),
            (family::IPV6, proto::UDP, 5001, 53)
        );
        assert_eq!(r.reason, Reason::DropPolicy as u8);
        assert_eq!(r.rule, RuleRef::default());
    }

    #[test]
    fn cut_or_odd_packets_keep_what_they_have() {
        // Cut inside TCP: no ports. A later fragment: none either.
        let mut syn = tcp_v4_syn();
        syn.truncate(22);
        assert_eq!(
            headers(&syn).map(|h| (h.protocol, h.dport)),
            Some((proto::TCP, 0))
        );
        let mut frag = tcp_v4_syn();
        frag[7] = 0x10;
        assert_eq!(headers(&frag).map(|h| h.dport), Some(0));
        assert_eq!(headers(&[0x45, 0, 0]), None);
        assert_eq!(headers(&[]), None);
        assert_eq!(headers(&[0x20; 40]), None);
        // A truncated attribute list ends the walk without a panic.
        let msg = packet_message("pa1 1 0 1 1 0 0", &tcp_v4_syn(), 1, 2, None, 1);
        for cut in 0..msg.len() {
            for (_, _, _, body) in messages(&msg[..cut]) {
                let _ = logged(body).map(|l| record(&l, |t| t, 0));
            }
        }
    }
}
