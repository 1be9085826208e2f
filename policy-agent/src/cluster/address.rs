//! Addresses read as kube-proxy reads them.
//!
//! kube-proxy parses every Service and endpoint address with
//! k8s.io/utils/net's `ParseIPSloppy`: "identical to Go's standard
//! net.ParseIP, except that it allows leading '0' characters on numbers.
//! Go used to allow this and then changed the behavior in 1.17. We're
//! choosing to keep it for compat with potential stored values." The API
//! server accepted such addresses for years, so a stored Service may hold
//! `010.096.000.010`, which kube-proxy reads as 10.96.0.10 (decimal, not
//! octal). Rust's parser rejects it; an address read differently from the
//! node's Service implementation is a frontend the agent does not know.
//!
//! Go's `net.IP` also holds an IPv4 address as an IPv4-mapped IPv6 one,
//! and Kubernetes takes any such address for IPv4 (`To4() != nil`):
//! `::ffff:10.0.0.1` and `::ffff:a00:1` are 10.0.0.1 to kube-proxy. So
//! they are here.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Go's `dtoi` and `xtoi` give up at this value (and so reject longer
/// runs of digits).
const BIG: u32 = 0x00ff_ffff;

/// An address as `ParseIPSloppy` reads it: IPv4 octets in decimal with
/// any leading zeros, IPv6 groups of any number of hex digits up to
/// 0xffff (an embedded IPv4 part read the same sloppy way), no zone.
/// An IPv4-mapped IPv6 address is its IPv4 address.
pub fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    let ip = parse_go(s)?;
    Some(match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    })
}

/// A prefix as `ParseCIDRSloppy` reads it (its address sloppily, its
/// length in decimal), host bits cleared. An IPv4-mapped IPv6 prefix is
/// refused: what it stands for depends on who reads it.
pub fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let (addr, len) = s.split_once('/')?;
    let (n, used) = dtoi(len.as_bytes())?;
    if used != len.len() {
        return None;
    }
    let ip = parse_go(addr)?;
    if let IpAddr::V6(v6) = ip
        && v6.to_ipv4_mapped().is_some()
    {
        return None;
    }
    let len = u8::try_from(n).ok()?;
    IpNet::new(ip, len).ok().map(|n| n.trunc())
}

/// Go 1.16's `net.ParseIP`: the first '.' or ':' decides the family.
fn parse_go(s: &str) -> Option<IpAddr> {
    let b = s.as_bytes();
    match b.iter().find(|c| **c == b'.' || **c == b':')? {
        b'.' => parse_v4(b).map(IpAddr::V4),
        _ => parse_v6(b).map(IpAddr::V6),
    }
}

/// Decimal digits at the start of `s`: (value, digits used).
fn dtoi(s: &[u8]) -> Option<(u32, usize)> {
    let mut n: u32 = 0;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        n = n * 10 + u32::from(s[i] - b'0');
        if n >= BIG {
            return None;
        }
        i += 1;
    }
    (i > 0).then_some((n, i))
}

/// Hex digits at the start of `s`: (value, digits used).
fn xtoi(s: &[u8]) -> Option<(u32, usize)> {
    let mut n: u32 = 0;
    let mut i = 0;
    while i < s.len() {
        let Some(d) = char::from(s[i]).to_digit(16) else {
            break;
        };
        n = n * 16 + d;
        if n >= BIG {
            return None;
        }
        i += 1;
    }
    (i > 0).then_some((n, i))
}

/// Four decimal octets, each at most 255, leading zeros allowed.
fn parse_v4(mut s: &[u8]) -> Option<Ipv4Addr> {
    let mut out = [0u8; 4];
    for (i, octet) in out.iter_mut().enumerate() {
        if i > 0 {
            s = s.strip_prefix(b".")?;
        }
        let (n, used) = dtoi(s)?;
        *octet = u8::try_from(n).ok()?;
        s = &s[used..];
    }
    s.is_empty().then_some(Ipv4Addr::from(out))
}

/// Go 1.16's `parseIPv6`: hex groups, one `::`, a trailing IPv4 part.
fn parse_v6(mut s: &[u8]) -> Option<Ipv6Addr> {
    let mut ip = [0u8; 16];
    let mut ellipsis: Option<usize> = None;
    if s.starts_with(b"::") {
        ellipsis = Some(0);
        s = &s[2..];
        if s.is_empty() {
            return Some(Ipv6Addr::UNSPECIFIED);
        }
    }
    let mut i = 0;
    while i < 16 {
        let (n, used) = xtoi(s)?;
        if n > 0xffff {
            return None;
        }
        if s.get(used) == Some(&b'.') {
            // A trailing IPv4 part, only where its four bytes end the
            // address (or an ellipsis makes room).
            if (ellipsis.is_none() && i != 12) || i + 4 > 16 {
                return None;
            }
            let v4 = parse_v4(s)?;
            ip[i..i + 4].copy_from_slice(&v4.octets());
            s = &[];
            i += 4;
            break;
        }
        ip[i] = (n >> 8) as u8;
        ip[i + 1] = n as u8;
        i += 2;
        s = &s[used..];
        if s.is_empty() {
            break;
        }
        if s[0] != b':' || s.len() == 1 {
            return None;
        }
        s = &s[1..];
        if s[0] == b':' {
            if ellipsis.is_some() {
                return None;
            }
            ellipsis = Some(i);
            s = &s[1..];
            if s.is_empty() {
                break;
            }
        }
    }
    if !s.is_empty() {
        return None;
    }
    if i < 16 {
        // The ellipsis stands for the missing groups.
        let at = ellipsis?;
        let n = 16 - i;
        ip.copy_within(at..i, at + n);
        ip[at..at + n].fill(0);
    } else if ellipsis.is_some() {
        // It must stand for at least one group.
        return None;
    }
    Some(Ipv6Addr::from(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// The cases of the forked parser's own tests (k8s.io/utils, forked
    /// from Go 1.16's net), and what Rust's strict parser reads alike.
    #[test]
    fn reads_what_parse_ip_sloppy_reads() {
        for (text, want) in [
            ("127.0.1.2", "127.0.1.2"),
            ("127.001.002.003", "127.1.2.3"),
            ("127.007.008.009", "127.7.8.9"),
            ("127.010.020.030", "127.10.20.30"),
            ("010.096.000.050", "10.96.0.50"),
            ("0123.0.0.1", "123.0.0.1"),
            ("::ffff:127.1.2.3", "127.1.2.3"),
            ("::ffff:127.001.002.003", "127.1.2.3"),
            ("::ffff:7f01:0203", "127.1.2.3"),
            ("0:0:0:0:0000:ffff:127.1.2.3", "127.1.2.3"),
            ("0:0:0:0:000000:ffff:127.1.2.3", "127.1.2.3"),
            ("0:0:0:0::ffff:127.1.2.3", "127.1.2.3"),
            ("2001:4860:0:2001::68", "2001:4860:0:2001::68"),
            (
                "2001:4860:0000:2001:0000:0000:0000:0068",
                "2001:4860:0:2001::68",
            ),
            ("fd00:96::a", "fd00:96::a"),
            ("::", "::"),
            ("::1", "::1"),
            ("1::", "1::"),
            ("::10.0.0.1", "::a00:1"),
        ] {
            assert_eq!(parse_ip_sloppy(text), Some(ip(want)), "{text}");
        }
        for bad in [
            "-0.0.0.0",
            "0.-1.0.0",
            "0.0.-2.0",
            "0.0.0.-3",
            "127.0.0.256",
            "abc",
            "123:",
            "fe80::1%lo0",
            "fe80::1%911",
            "",
            "a1:a2:a3:a4::b1:b2:b3:b4",
            "1.2..4",
            "1.2.3",
            "1.2.3.4.5",
            "10.0.0.1 ",
            "1:2:3:4:5:6:7:8:9",
            "1::2::3",
            "1:2:3:4:5:6:7:8::",
            "::ffff:1.2.3.4.5",
            "1:2:3:4:5:6:7:1.2.3.4",
            "0x0a.0.0.1",
            "None",
        ] {
            assert_eq!(parse_ip_sloppy(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn reads_prefixes_as_parse_cidr_sloppy_reads_them() {
        for (text, want) in [
            ("10.96.0.0/12", "10.96.0.0/12"),
            ("010.096.000.000/012", "10.96.0.0/12"),
            ("10.96.1.1/12", "10.96.0.0/12"),
            ("fd00:96::/108", "fd00:96::/108"),
        ] {
            assert_eq!(
                parse_cidr_sloppy(text),
                Some(want.parse().unwrap()),
                "{text}"
            );
        }
        for bad in [
            "10.96.0.0",
            "10.96.0.0/33",
            "10.96.0.0/-1",
            "10.96.0.0/1a",
            "fd00::/129",
            "::ffff:10.0.0.0/104",
            "/8",
        ] {
            assert_eq!(parse_cidr_sloppy(bad), None, "{bad:?}");
        }
    }
}
