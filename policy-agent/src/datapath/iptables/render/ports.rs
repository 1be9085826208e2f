//! Port matches: a policy key's port block, and runs of keys merged into
//! port ranges.
//!
//! The policy map splits a port range into blocks of the lengths the
//! classifier probes (see `policy_common::policy::PORT_PREFIX_LENGTHS`),
//! which suits a hash probe but would cost iptables a rule per block:
//! `--dport` takes any range, so keys that differ only in adjacent ports
//! become one rule.
use policy_common::{policy::PolicyKey, proto};

/// Keys merged into one match: `key` with its port the first of the
/// range, and the range's last port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub key: PolicyKey,
    pub last: u16,
}

impl Span {
    /// One key's block.
    pub fn of(key: &PolicyKey) -> Self {
        let last = if key.port_prefix_len >= 16 {
            key.port
        } else {
            key.port | (0xffff >> key.port_prefix_len)
        };
        Self { key: *key, last }
    }

    /// Whether `next` (same peer and protocol, with ports) continues or
    /// overlaps this range.
    fn joins(&self, next: &Self) -> bool {
        let (a, b) = (&self.key, &next.key);
        a.endpoint_identity == b.endpoint_identity
            && a.peer_identity == b.peer_identity
            && a.direction == b.direction
            && a.protocol == b.protocol
            && proto::has_ports(a.protocol)
            && u32::from(b.port) <= u32::from(self.last) + 1
    }
}

/// The protocol and port match of `span` ("" for a key of every
/// protocol, or of one without ports).
pub(super) fn port_match(span: &Span) -> String {
    let p = match span.key.protocol {
        proto::TCP => "tcp",
        proto::UDP => "udp",
        proto::SCTP => "sctp",
        _ => return String::new(),
    };
    match (span.key.port, span.last) {
        (0, 0xffff) => format!("-p {p} "),
        (first, last) if first == last => format!("-p {p} --dport {first} "),
        (first, last) => format!("-p {p} --dport {first}:{last} "),
    }
}

/// `items` with each run of consecutive items of equal `T` merged into
/// port ranges: inside a run the order is free (one target), so it is
/// sorted by peer, protocol and port, and adjacent or overlapping ports
/// of one peer and protocol become one span. Runs keep their order.
pub(super) fn coalesce<T: Copy + PartialEq>(items: &[(PolicyKey, T)]) -> Vec<(Span, T)> {
    let mut out: Vec<(Span, T)> = Vec::with_capacity(items.len());
    let mut start = 0;
    while start < items.len() {
        let value = items[start].1;
        let end = items[start..]
            .iter()
            .position(|(_, v)| *v != value)
            .map_or(items.len(), |n| start + n);
        let mut run: Vec<Span> = items[start..end].iter().map(|(k, _)| Span::of(k)).collect();
        run.sort_by_key(|s| {
            (
                s.key.peer_identity,
                s.key.direction,
                s.key.protocol,
                s.key.port,
                s.last,
            )
        });
        let first_of_run = out.len();
        for span in run {
            match out[first_of_run..].last_mut() {
                Some((cur, _)) if cur.joins(&span) => cur.last = cur.last.max(span.last),
                _ => out.push((span, value)),
            }
        }
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use policy_common::{direction::INGRESS, proto::ANY};

    use super::*;

    fn key(peer: u32, protocol: u8, len: u8, port: u16) -> PolicyKey {
        PolicyKey::new(300, INGRESS, peer, protocol, len, port)
    }

    fn matches(spans: &[(Span, u32)]) -> Vec<(u32, String, u32)> {
        spans
            .iter()
            .map(|(s, v)| (s.key.peer_identity, port_match(s), *v))
            .collect()
    }

    #[test]
    fn a_split_range_reads_as_one_match_again() {
        // 8000-8100 in blocks of several lengths, out of order (as a map
        // iterates).
        let blocks = [(8096, 16), (8000, 12), (8016, 12), (8032, 12), (8048, 12)]
            .into_iter()
            .chain([(8064, 12), (8080, 12), (8097, 16), (8098, 16), (8099, 16)])
            .chain([(8100, 16)]);
        let keys: Vec<_> = blocks
            .map(|(port, len)| (key(400, proto::TCP, len, port), 7u32))
            .collect();
        assert!(keys.len() > 4);
        assert_eq!(
            matches(&coalesce(&keys)),
            vec![(400, "-p tcp --dport 8000:8100 ".into(), 7)]
        );
    }

    #[test]
    fn only_one_peer_protocol_and_target_merge() {
        let keys = vec![
            (key(400, proto::TCP, 16, 80), 1u32),
            (key(400, proto::TCP, 16, 81), 1),
            (key(400, proto::UDP, 16, 82), 1),
            (key(401, proto::TCP, 16, 82), 1),
            (key(400, proto::TCP, 16, 83), 1),
            (key(400, proto::TCP, 16, 82), 2),
            (key(400, ANY, 0, 0), 2),
            (key(400, proto::TCP, 16, 84), 1),
        ];
        assert_eq!(
            matches(&coalesce(&keys)),
            vec![
                (400, "-p tcp --dport 80:81 ".into(), 1),
                (400, "-p tcp --dport 83 ".into(), 1),
                (400, "-p udp --dport 82 ".into(), 1),
                (401, "-p tcp --dport 82 ".into(), 1),
                // A new run: its own order, merged apart from the first.
                (400, String::new(), 2),
                (400, "-p tcp --dport 82 ".into(), 2),
                (400, "-p tcp --dport 84 ".into(), 1),
            ]
        );
    }

    #[test]
    fn every_port_of_a_protocol_absorbs_its_blocks() {
        let keys = vec![
            (key(400, proto::TCP, 16, 80), 1u32),
            (key(400, proto::TCP, 0, 0), 1),
            (key(400, proto::TCP, 12, 0xfff0), 1),
        ];
        assert_eq!(matches(&coalesce(&keys)), vec![(400, "-p tcp ".into(), 1)]);
    }
}
