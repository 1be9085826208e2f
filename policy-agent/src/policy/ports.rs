//! `NetworkPolicyPort`: protocol, port (number or name) and endPort.
use k8s_openapi::{
    api::networking::v1::NetworkPolicyPort, apimachinery::pkg::util::intstr::IntOrString,
};
use policy_common::{policy::PORT_PREFIX_LENGTHS, proto};

use crate::{
    cluster::{PolicyRef, protocol_number},
    identity::LabelKey,
    policy::error::{PolicyError, PolicyErrorKind},
};

/// The ports of one rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ports {
    /// "If this field is empty or missing, this rule matches all ports
    /// (traffic not restricted by port)": every port of every protocol,
    /// ICMP included.
    All,
    /// "If this field is present and contains at least one item, then this
    /// rule allows traffic only if the traffic matches at least one port in
    /// the list."
    List(Vec<PortMatch>),
}

/// One validated `ports` element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortMatch {
    /// `port` absent: "If this field is not provided, this matches all port
    /// names and numbers" of the protocol.
    Protocol(u8),
    /// A number, or with `endPort` "the range of ports from port to endPort,
    /// inclusive".
    Range { protocol: u8, first: u16, last: u16 },
    /// A named port: it "resolves on the destination pod" (the selected pod
    /// for ingress, each peer pod for egress).
    Named { protocol: u8, name: String },
}

impl PortMatch {
    /// Whether a packet's protocol and destination port match, resolving a
    /// named port on `destination` (no destination pod: no match).
    pub fn matches(&self, protocol: u8, port: u16, destination: Option<&LabelKey>) -> bool {
        match self {
            Self::Protocol(p) => *p == protocol,
            Self::Range {
                protocol: p,
                first,
                last,
            } => *p == protocol && (*first..=*last).contains(&port),
            Self::Named { protocol: p, name } => {
                *p == protocol
                    && destination.is_some_and(|d| d.resolve(name, *p).any(|n| n == port))
            }
        }
    }
}

/// A port set entry of the policy map: (protocol, prefix length, port).
pub type PortKey = (u8, u8, u16);

/// The wildcard entry: every protocol, every port.
pub const ANY_PORT: PortKey = (proto::ANY, 0, 0);

/// The policy-map port entries of `ports`. Named ports resolve on
/// `destination` when `named` is set (and are skipped otherwise); numeric
/// ones are included when `numeric` is set. Sorted, without duplicates.
pub fn port_keys(
    ports: &Ports,
    destination: Option<&LabelKey>,
    numeric: bool,
    named: bool,
) -> Vec<PortKey> {
    let mut out = Vec::new();
    match ports {
        Ports::All => {
            if numeric {
                out.push(ANY_PORT);
            }
        }
        Ports::List(list) => {
            for m in list {
                match m {
                    PortMatch::Protocol(p) if numeric => out.push((*p, 0, 0)),
                    PortMatch::Range {
                        protocol,
                        first,
                        last,
                    } if numeric => {
                        out.extend(
                            range_blocks(*first, *last)
                                .into_iter()
                                .map(|(port, len)| (*protocol, len, port)),
                        );
                    }
                    PortMatch::Named { protocol, name } if named => {
                        if let Some(d) = destination {
                            out.extend(d.resolve(name, *protocol).map(|n| (*protocol, 16, n)));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The fewest aligned blocks `(port, prefix length)` covering exactly
/// `first..=last` with lengths of [`PORT_PREFIX_LENGTHS`] only, in port
/// order, e.g. 8000-8015 → [(8000, 12)], 8000-8007 → two of length 14.
/// Each of the fewest blocks of any length is split into blocks of the
/// next length the classifier is given (see `PORT_PREFIX_LENGTHS`).
pub fn range_blocks(first: u16, last: u16) -> Vec<(u16, u8)> {
    let mut out = Vec::new();
    let (mut start, end) = (u32::from(first), u32::from(last));
    while start <= end {
        // The largest power-of-two block aligned at `start` within the range.
        let mut size: u32 = if start == 0 {
            1 << 16
        } else {
            1 << start.trailing_zeros().min(16)
        };
        while start + size - 1 > end {
            size >>= 1;
        }
        let len = 16 - size.trailing_zeros() as u8;
        // The shortest length given that is at least `len`: 16 is given.
        let given = PORT_PREFIX_LENGTHS
            .iter()
            .copied()
            .filter(|&l| l >= len)
            .min()
            .unwrap_or(16);
        let step = 1u32 << (16 - u32::from(given));
        let mut p = start;
        while p < start + size {
            // `p` is at most 65535 here.
            out.push((u16::try_from(p).unwrap_or(u16::MAX), given));
            p += step;
        }
        start += size;
    }
    out
}

/// IANA_SVC_NAME: 1-15 of [a-z0-9-], at least one letter, no leading,
/// trailing or doubled hyphen (apimachinery `IsValidPortName`).
pub fn is_valid_port_name(name: &str) -> bool {
    let b = name.as_bytes();
    (1..=15).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.iter().any(u8::is_ascii_lowercase)
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

/// Validates one `ports` element at `field` (`spec.ingress[0].ports[1]`).
pub fn parse_port(
    policy: &PolicyRef,
    field: &str,
    p: &NetworkPolicyPort,
) -> Result<PortMatch, PolicyError> {
    // Protocol names the API accepts (case-sensitive): "The protocol (TCP,
    // UDP, or SCTP) which traffic must match. If not specified, this field
    // defaults to TCP."
    let protocol = protocol_number(p.protocol.as_deref()).ok_or_else(|| {
        PolicyError::new(
            policy,
            format!("{field}.protocol"),
            PolicyErrorKind::UnknownProtocol {
                value: p.protocol.clone().unwrap_or_default(),
            },
        )
    })?;
    let in_range = |v: i32| u16::try_from(v).ok().filter(|n| *n != 0);
    match (&p.port, p.end_port) {
        (None, None) => Ok(PortMatch::Protocol(protocol)),
        // "endPort ... cannot be defined if the port field is not defined
        // or if the port field is defined as a named (string) port."
        (None | Some(IntOrString::String(_)), Some(_)) => Err(PolicyError::new(
            policy,
            format!("{field}.endPort"),
            PolicyErrorKind::EndPortWithoutNumericPort,
        )),
        (Some(IntOrString::String(name)), None) => {
            if is_valid_port_name(name) {
                Ok(PortMatch::Named {
                    protocol,
                    name: name.clone(),
                })
            } else {
                Err(PolicyError::new(
                    policy,
                    format!("{field}.port"),
                    PolicyErrorKind::BadPortName {
                        value: name.clone(),
                    },
                ))
            }
        }
        (Some(IntOrString::Int(port)), end) => {
            let first = in_range(*port).ok_or_else(|| {
                PolicyError::new(
                    policy,
                    format!("{field}.port"),
                    PolicyErrorKind::PortOutOfRange {
                        value: i64::from(*port),
                    },
                )
            })?;
            let Some(end) = end else {
                return Ok(PortMatch::Range {
                    protocol,
                    first,
                    last: first,
                });
            };
            // "The endPort must be equal or greater than port."
            let last = in_range(end).ok_or_else(|| {
                PolicyError::new(
                    policy,
                    format!("{field}.endPort"),
                    PolicyErrorKind::PortOutOfRange {
                        value: i64::from(end),
                    },
                )
            })?;
            if last < first {
                return Err(PolicyError::new(
                    policy,
                    format!("{field}.endPort"),
                    PolicyErrorKind::EndPortBelowPort {
                        port: *port,
                        end_port: end,
                    },
                ));
            }
            Ok(PortMatch::Range {
                protocol,
                first,
                last,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covered(blocks: &[(u16, u8)]) -> Vec<u16> {
        let mut ports: Vec<u16> = blocks
            .iter()
            .flat_map(|(p, len)| {
                let size = 1u32 << (16 - u32::from(*len));
                (u32::from(*p)..u32::from(*p) + size).map(|x| x as u16)
            })
            .collect();
        ports.sort_unstable();
        ports
    }

    /// The fewest aligned blocks of the given lengths covering `a..=b`,
    /// by search: the reference `range_blocks` is held to.
    fn fewest_given_blocks(a: u32, b: u32) -> usize {
        // best[i]: fewest blocks covering a..i (exclusive end i).
        let n = (b - a + 1) as usize;
        let mut best = vec![usize::MAX; n + 1];
        best[0] = 0;
        for i in 0..n {
            if best[i] == usize::MAX {
                continue;
            }
            let p = a + i as u32;
            for len in PORT_PREFIX_LENGTHS {
                let size = 1u32 << (16 - u32::from(len));
                if p.is_multiple_of(size) && p + size - 1 <= b {
                    let j = i + size as usize;
                    best[j] = best[j].min(best[i] + 1);
                }
            }
        }
        best[n]
    }

    #[test]
    fn range_blocks_are_exact_and_fewest_of_the_given_lengths() {
        assert_eq!(range_blocks(8000, 8015), vec![(8000, 12)]);
        assert_eq!(range_blocks(8000, 8007), vec![(8000, 14), (8004, 14)]);
        assert_eq!(range_blocks(80, 80), vec![(80, 16)]);
        assert_eq!(range_blocks(0, 65535), vec![(0, 0)]);
        // The fewest blocks of any length: 16.
        assert_eq!(range_blocks(1, 65535).len(), 42);
        assert_eq!(range_blocks(65535, 65535), vec![(65535, 16)]);
        for (a, b) in [
            (1, 1),
            (3, 17),
            (1000, 2000),
            (32768, 65535),
            (65000, 65535),
            (7, 8),
            (1, 65535),
            (4095, 8193),
            (30000, 32767),
        ] {
            let blocks = range_blocks(a, b);
            assert_eq!(covered(&blocks), (a..=b).collect::<Vec<_>>(), "{a}-{b}");
            assert_eq!(
                blocks.len(),
                fewest_given_blocks(u32::from(a), u32::from(b)),
                "{a}-{b} fewest"
            );
            assert!(
                blocks.windows(2).all(|w| w[0].0 < w[1].0),
                "{a}-{b} in order"
            );
            for (p, len) in blocks {
                assert!(PORT_PREFIX_LENGTHS.contains(&len), "{p}/{len} given");
                assert_eq!(
                    p & !policy_common::policy::port_mask(len),
                    0,
                    "{p}/{len} aligned"
                );
            }
        }
    }

    #[test]
    fn port_names_follow_iana_svc_name() {
        for ok in ["http", "h2c", "a-b", "dns-tcp", "x123456789abcde"] {
            assert!(is_valid_port_name(ok), "{ok}");
        }
        for bad in [
            "",
            "HTTP",
            "123",
            "-a",
            "a-",
            "a--b",
            "x123456789abcdef",
            "a_b",
            "80",
        ] {
            assert!(!is_valid_port_name(bad), "{bad}");
        }
    }
}
