//! The tc filters on one side of an interface's clsact qdisc, in the
//! order the kernel runs them (`tc filter show dev X ingress|egress`).
use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcHandle, TcMessage},
};

use super::{Error, request::request};

/// One filter of a clsact hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// `pref`: lower runs first.
    pub priority: u16,
    /// The filter's handle (`0:4e50` is written 0x4e50).
    pub handle: u32,
    /// The classifier kind ("bpf", "u32", "flower", ...).
    pub kind: String,
}

/// The filters of `ifindex` at clsact ingress (`egress` false) or egress,
/// lowest priority number first. Empty without a clsact qdisc.
pub fn clsact_filters(ifindex: u32, egress: bool) -> Result<Vec<Filter>, Error> {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = TcHandle {
        major: TcHandle::INGRESS.major,
        minor: if egress {
            TcHandle::MIN_EGRESS
        } else {
            TcHandle::MIN_INGRESS
        },
    };
    let replies = match request(
        "filter dump",
        RouteNetlinkMessage::GetTrafficFilter(msg),
        NLM_F_REQUEST | NLM_F_DUMP,
    ) {
        Ok(r) => r,
        // No clsact qdisc (or no interface): no filters.
        Err(Error::Request { source, .. })
            if matches!(
                source.raw_os_error(),
                Some(libc::EINVAL) | Some(libc::ENOENT) | Some(libc::ENODEV)
            ) =>
        {
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    let mut out: Vec<Filter> = replies
        .iter()
        .filter_map(|r| match r {
            RouteNetlinkMessage::NewTrafficFilter(m) => Some(m),
            _ => None,
        })
        // A filter's chain head (handle 0) is listed before its filters.
        .filter(|m| u32::from(m.header.handle) != 0)
        .map(|m| Filter {
            priority: (m.header.info >> 16) as u16,
            handle: u32::from(m.header.handle),
            kind: m
                .attributes
                .iter()
                .find_map(|a| match a {
                    TcAttribute::Kind(k) => Some(k.clone()),
                    _ => None,
                })
                .unwrap_or_default(),
        })
        .collect();
    out.sort_by_key(|f| f.priority);
    Ok(out)
}
