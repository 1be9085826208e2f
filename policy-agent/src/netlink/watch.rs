//! Link events (RTNLGRP_LINK) and pod-route events (RTNLGRP_IPV4_ROUTE,
//! RTNLGRP_IPV6_ROUTE), so a pod interface is attached as soon as it exists
//! and its route does (a CNI plugin may add the route after the link is
//! up), without polling; and address events (RTNLGRP_IPV4_IFADDR,
//! RTNLGRP_IPV6_IFADDR), so the node's addresses are read again when they
//! change.
//!
//! Events go to whatever the caller hands in: a closure for link events,
//! a socket the caller waits on for address events. Netlink is support
//! below every layer and names none of them.
use std::{os::fd::AsRawFd as _, time::Duration};

use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteHeader, RouteMessage, RouteType},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::{Error, Link, link_from, request::messages, route_from};

const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// A link was created in (or moved into) this namespace: the kernel
    /// announces it with every flag in the change mask.
    Created(Link),
    /// A link changed (state, name, ...).
    Changed(Link),
    Removed(Link),
    /// A route that can lead to a pod (main table, unicast, a single
    /// address, no gateway) appeared or went, through interface `oif`.
    PodRoute {
        oif: u32,
    },
}

/// Whether `route` is one the interface lookup could now answer with: a
/// host route straight out of an interface, as CNI plugins add per pod.
fn pod_route(route: &RouteMessage) -> Option<u32> {
    let h = &route.header;
    let host_len = match h.address_family {
        AddressFamily::Inet => 32,
        AddressFamily::Inet6 => 128,
        _ => return None,
    };
    if h.table != RouteHeader::RT_TABLE_MAIN
        || h.kind != RouteType::Unicast
        || h.destination_prefix_length != host_len
    {
        return None;
    }
    route_from(route)
        .filter(|r| r.gateway.is_none())
        .map(|r| r.oif)
}

/// Subscribes (in the calling thread's namespace) and hands each event to
/// `sink` from a background thread until `sink` answers false (its
/// receiver is gone).
pub fn watch_links(
    sink: impl Fn(LinkEvent) -> bool + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, Error> {
    let socket = subscribe(RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE)?;
    spawn("netlink-links", move || {
        let mut rx = vec![0u8; 1 << 16];
        loop {
            let Ok(size) = socket.recv(&mut &mut rx[..], 0) else {
                // ENOBUFS after a burst: keep going; the agent resyncs.
                continue;
            };
            for msg in messages(&rx[..size]) {
                let Ok(msg) = msg else { break };
                let event = match msg.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l))
                        if l.header.change_mask.bits() == u32::MAX =>
                    {
                        Some(LinkEvent::Created(link_from(&l)))
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                        Some(LinkEvent::Changed(link_from(&l)))
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(l)) => {
                        Some(LinkEvent::Removed(link_from(&l)))
                    }
                    NetlinkPayload::InnerMessage(
                        RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r),
                    ) => pod_route(&r).map(|oif| LinkEvent::PodRoute { oif }),
                    _ => None,
                };
                if let Some(e) = event
                    && !sink(e)
                {
                    return;
                }
            }
        }
    })
}

/// Address changes in the namespace of the thread that subscribed, read
/// by the caller in its own thread (no relay: the reader waits on the
/// socket itself).
pub struct AddressEvents {
    socket: Socket,
    buf: Vec<u8>,
}

impl AddressEvents {
    pub fn subscribe() -> Result<Self, Error> {
        Ok(Self {
            socket: subscribe(RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR)?,
            buf: vec![0u8; 1 << 16],
        })
    }

    /// Waits up to `timeout` for a change; true if one came (its message
    /// is consumed).
    pub fn wait(&mut self, timeout: Duration) -> bool {
        if !readable(&self.socket, timeout) {
            return false;
        }
        // ENOBUFS after a burst is a change too: the caller reads again.
        let _ = self.socket.recv(&mut &mut self.buf[..], 0);
        true
    }

    /// Consumes the changes already queued.
    pub fn drain(&mut self) {
        while self.wait(Duration::ZERO) {}
    }
}

/// Whether `socket` has something to read (or an error to report) within
/// `timeout`. An interrupted wait counts as nothing.
fn readable(socket: &Socket, timeout: Duration) -> bool {
    let mut fd = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut fd, 1, ms) > 0 }
}

/// A route-netlink socket in the calling thread's namespace, subscribed to
/// the multicast `groups`.
fn subscribe(groups: u32) -> Result<Socket, Error> {
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(Error::Socket)?;
    socket
        .bind(&SocketAddr::new(0, groups))
        .map_err(Error::Socket)?;
    Ok(socket)
}

fn spawn(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(Error::Socket)
}
