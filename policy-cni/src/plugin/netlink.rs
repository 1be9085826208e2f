//! Just enough rtnetlink to read one link (RTM_GETLINK by name or index)
//! in the calling thread's network namespace: its index, name, kind and
//! `IFLA_LINK` (a veth's peer index, in the peer's namespace).
use std::{
    ffi::CStr,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// One link's attributes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` ("veth", "bridge", ...).
    pub kind: Option<String>,
    /// `IFLA_LINK`: for a veth, its peer's index.
    pub peer: Option<u32>,
    /// `IFLA_LINK_NETNSID`: set when the peer lives in another namespace.
    pub peer_netnsid: Option<i32>,
}

/// Which link to read.
pub enum Query<'a> {
    Name(&'a str),
    Index(u32),
}

const NLMSG_HDRLEN: usize = 16;
const IFINFO_LEN: usize = 16;
const NLA_TYPE_MASK: u16 = 0x3fff;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Reads the link; `Ok(None)` when it does not exist.
pub fn get_link(query: Query<'_>) -> io::Result<Option<Link>> {
    let mut msg = vec![0u8; NLMSG_HDRLEN + IFINFO_LEN];
    let index = match query {
        Query::Index(i) => i32::try_from(i).map_err(|_| io::Error::other("ifindex too large"))?,
        Query::Name(name) => {
            let mut value = name.as_bytes().to_vec();
            value.push(0);
            push_attr(&mut msg, libc::IFLA_IFNAME, &value);
            0
        }
    };
    // ifinfomsg: family (u8), pad, type (u16), index (i32), flags, change.
    msg[NLMSG_HDRLEN + 4..NLMSG_HDRLEN + 8].copy_from_slice(&index.to_ne_bytes());
    let len = u32::try_from(msg.len()).map_err(|_| io::Error::other("message too long"))?;
    msg[0..4].copy_from_slice(&len.to_ne_bytes());
    msg[4..6].copy_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
    let flags = u16::try_from(libc::NLM_F_REQUEST).unwrap_or(1);
    msg[6..8].copy_from_slice(&flags.to_ne_bytes());
    msg[8..12].copy_from_slice(&1u32.to_ne_bytes());

    let sock = socket()?;
    // SAFETY: `msg` is a valid buffer of `msg.len()` bytes.
    let sent = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 32 * 1024];
    // SAFETY: `buf` is a valid, writable buffer of `buf.len()` bytes.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    parse_reply(&buf[..n])
}

fn push_attr(msg: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = u16::try_from(4 + value.len()).unwrap_or(u16::MAX);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(value);
    msg.resize(align4(msg.len()), 0);
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: a timeval of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            u32::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(16),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Walks `(type, value)` attributes.
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16_at(b, 0)?);
        let kind = u16_at(b, 2)? & NLA_TYPE_MASK;
        let value = b.get(4..len)?;
        b = b.get(align4(len)..).unwrap_or(&[]);
        Some((kind, value))
    })
}

fn string(value: &[u8]) -> String {
    CStr::from_bytes_until_nul(value)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(value).into_owned())
}

fn parse_reply(b: &[u8]) -> io::Result<Option<Link>> {
    let bad = || io::Error::other("short netlink reply");
    let len = usize::try_from(u32_at(b, 0).ok_or_else(bad)?).map_err(|_| bad())?;
    let kind = u16_at(b, 4).ok_or_else(bad)?;
    let body = b.get(NLMSG_HDRLEN..len).ok_or_else(bad)?;
    if kind == u16::try_from(libc::NLMSG_ERROR).unwrap_or(2) {
        let errno = i32::from_ne_bytes(
            body.get(0..4)
                .ok_or_else(bad)?
                .try_into()
                .map_err(|_| bad())?,
        );
        return match -errno {
            0 => Err(io::Error::other("netlink acknowledged without a link")),
            libc::ENODEV => Ok(None),
            e => Err(io::Error::from_raw_os_error(e)),
        };
    }
    if kind != libc::RTM_NEWLINK {
        return Err(io::Error::other(format!(
            "unexpected netlink message type {kind}"
        )));
    }
    let index = u32_at(body, 4).ok_or_else(bad)?;
    let mut link = Link {
        index,
        name: String::new(),
        kind: None,
        peer: None,
        peer_netnsid: None,
    };
    for (t, value) in attrs(body.get(IFINFO_LEN..).unwrap_or(&[])) {
        match t {
            libc::IFLA_IFNAME => link.name = string(value),
            libc::IFLA_LINK => link.peer = u32_at(value, 0),
            libc::IFLA_LINK_NETNSID => {
                link.peer_netnsid = u32_at(value, 0).map(|v| i32::from_ne_bytes(v.to_ne_bytes()));
            }
            libc::IFLA_LINKINFO => {
                link.kind = attrs(value)
                    .find(|(t, _)| *t == libc::IFLA_INFO_KIND)
                    .map(|(_, v)| string(v));
            }
            _ => {}
        }
    }
    Ok(Some(link))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_read_by_name_and_by_index() {
        let by_name = get_link(Query::Name("lo")).unwrap_or_else(|e| panic!("{e}"));
        let lo = by_name.unwrap_or_else(|| panic!("no lo"));
        assert_eq!(lo.name, "lo");
        assert_eq!(lo.index, 1);
        assert_eq!(lo.peer, None);
        let by_index = get_link(Query::Index(1)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(by_index.map(|l| l.name), Some("lo".to_owned()));
    }

    #[test]
    fn a_missing_link_is_none() {
        assert_eq!(get_link(Query::Name("nosuchlink0")).ok(), Some(None));
        assert_eq!(get_link(Query::Index(999_999)).ok(), Some(None));
    }

    #[test]
    fn attributes_walk_stops_at_truncation() {
        let mut b = Vec::new();
        push_attr(&mut b, 3, b"eth0\0");
        push_attr(&mut b, 5, &7u32.to_ne_bytes());
        let all: Vec<_> = attrs(&b).map(|(t, _)| t).collect();
        assert_eq!(all, [3, 5]);
        let cut: Vec<_> = attrs(&b[..b.len() - 2]).map(|(t, _)| t).collect();
        assert_eq!(cut, [3]);
    }
}
