//! One rtnetlink request and its (possibly multipart) reply.
use netlink_packet_core::{DecodeError, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::Error;

pub(super) fn request(
    what: &'static str,
    msg: RouteNetlinkMessage,
    flags: u16,
) -> Result<Vec<RouteNetlinkMessage>, Error> {
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(Error::Socket)?;
    socket.bind_auto().map_err(Error::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(Error::Socket)?;

    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = 1;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf[..]);
    socket
        .send(&buf, 0)
        .map_err(|source| Error::Request { what, source })?;

    let dump = flags & netlink_packet_core::NLM_F_DUMP == netlink_packet_core::NLM_F_DUMP;
    let mut out = Vec::new();
    let mut rx = vec![0u8; 1 << 16];
    loop {
        let size = socket
            .recv(&mut &mut rx[..], 0)
            .map_err(|source| Error::Request { what, source })?;
        for msg in messages(&rx[..size]) {
            let msg = msg.map_err(|e| Error::Decode {
                what,
                detail: e.to_string(),
            })?;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(e) => {
                    if let Some(code) = e.code {
                        return Err(Error::Request {
                            what,
                            source: std::io::Error::from_raw_os_error(-code.get()),
                        });
                    }
                    return Ok(out); // an ACK
                }
                NetlinkPayload::InnerMessage(m) => out.push(m),
                _ => {}
            }
        }
        if !dump {
            return Ok(out);
        }
    }
}

/// The messages of one netlink datagram, in order. Ends after a message
/// that cannot be decoded (yielded as its error) or claims length 0.
pub(super) fn messages(
    buf: &[u8],
) -> impl Iterator<Item = Result<NetlinkMessage<RouteNetlinkMessage>, DecodeError>> + '_ {
    let mut offset = 0;
    std::iter::from_fn(move || {
        if offset >= buf.len() {
            return None;
        }
        let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[offset..]);
        match &msg {
            Ok(m) if m.header.length > 0 => offset += m.header.length as usize,
            _ => offset = buf.len(),
        }
        Some(msg)
    })
}
