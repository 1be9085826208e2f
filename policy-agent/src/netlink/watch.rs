//! Link events (RTNLGRP_LINK), so a pod interface that appears is attached
//! at once, without polling.
use std::sync::mpsc::Sender;

use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::{Error, Link, link_from, request::messages};

const RTMGRP_LINK: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// A link appeared or changed (state, name, ...).
    Changed(Link),
    Removed(Link),
}

/// Subscribes (in the calling thread's namespace) and forwards events from
/// a background thread until the receiver goes away.
pub fn watch_links(tx: Sender<LinkEvent>) -> Result<std::thread::JoinHandle<()>, Error> {
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(Error::Socket)?;
    socket
        .bind(&SocketAddr::new(0, RTMGRP_LINK))
        .map_err(Error::Socket)?;
    std::thread::Builder::new()
        .name("netlink-links".into())
        .spawn(move || {
            let mut rx = vec![0u8; 1 << 16];
            loop {
                let Ok(size) = socket.recv(&mut &mut rx[..], 0) else {
                    // ENOBUFS after a burst: keep going; the agent resyncs.
                    continue;
                };
                for msg in messages(&rx[..size]) {
                    let Ok(msg) = msg else { break };
                    let event = match msg.payload {
                        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                            Some(LinkEvent::Changed(link_from(&l)))
                        }
                        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(l)) => {
                            Some(LinkEvent::Removed(link_from(&l)))
                        }
                        _ => None,
                    };
                    if let Some(e) = event
                        && tx.send(e).is_err()
                    {
                        return;
                    }
                }
            }
        })
        .map_err(Error::Socket)
}
