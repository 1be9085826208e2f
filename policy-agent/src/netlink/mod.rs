//! rtnetlink queries the agent needs: the interface a pod IP routes to, an
//! interface's name and kind, the node's own addresses, an interface's tc
//! filters, conntrack marks, and link and address events.
pub mod conntrack;
mod filters;
mod request;
mod watch;

use std::net::IpAddr;

use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteFlags, RouteMessage},
};

pub use self::filters::{Filter, clsact_filters};
use self::request::request;
pub use self::watch::{AddressEvents, LinkEvent, watch_links};

/// Errors talking to the kernel over netlink.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("netlink socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error("netlink {what}: {source}")]
    Request {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("netlink {what}: cannot decode the reply: {detail}")]
    Decode { what: &'static str, detail: String },
}

/// An interface's name and link kind ("veth", "bridge", ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub kind: Option<String>,
    /// How a packet on it is framed, by its link-layer type (ARPHRD).
    pub framing: Framing,
}

/// How a packet on an interface is framed, as tc sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// An Ethernet header first (Ethernet, veth, bridge, VXLAN, GENEVE).
    Ethernet,
    /// The IP header first: no link-layer header (IP-in-IP, GRE, sit,
    /// ip6tnl, WireGuard, tun, raw IP).
    Ip,
    /// Loopback.
    Loopback,
    /// Anything else (the ARPHRD number): nothing here can read it.
    Other(u16),
}

impl Framing {
    fn of(kind: LinkLayerType) -> Self {
        match kind {
            LinkLayerType::Ether => Framing::Ethernet,
            LinkLayerType::None
            | LinkLayerType::Tunnel
            | LinkLayerType::Tunnel6
            | LinkLayerType::Sit
            | LinkLayerType::Ipgre
            | LinkLayerType::Ip6gre
            | LinkLayerType::Rawip => Framing::Ip,
            LinkLayerType::Loopback => Framing::Loopback,
            other => Framing::Other(u16::from(other)),
        }
    }
}

/// The route the kernel would send a packet for `ip` by (as `ip route get
/// fibmatch`: the routing table's entry, with its own prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub oif: u32,
    /// Set when the route goes through a gateway (not a pod's own route).
    pub gateway: Option<IpAddr>,
    /// The matching entry's prefix length: a pod's own route is a host
    /// route (/32, /128); a shorter one is a subnet or default route that
    /// other addresses share.
    pub prefix_len: u8,
}

impl Route {
    /// Whether this entry routes `ip` alone.
    pub fn is_host_route_of(&self, ip: IpAddr) -> bool {
        self.prefix_len == if ip.is_ipv4() { 32 } else { 128 }
    }
}

/// `ip route get fibmatch <ip>` in the calling thread's network namespace.
pub fn route_to(ip: IpAddr) -> Result<Option<Route>, Error> {
    let mut msg = RouteMessage::default();
    // The matching table entry rather than a cloned per-address result:
    // its prefix tells a pod's own route from a shared one.
    msg.header.flags = RouteFlags::FibMatch;
    match ip {
        IpAddr::V4(a) => {
            msg.header.address_family = AddressFamily::Inet;
            msg.header.destination_prefix_length = 32;
            msg.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet(a)));
        }
        IpAddr::V6(a) => {
            msg.header.address_family = AddressFamily::Inet6;
            msg.header.destination_prefix_length = 128;
            msg.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet6(a)));
        }
    }
    let replies = match request(
        "route get",
        RouteNetlinkMessage::GetRoute(msg),
        NLM_F_REQUEST,
    ) {
        Ok(r) => r,
        // No route at all (ENETUNREACH/EHOSTUNREACH): nothing to attach to.
        Err(Error::Request { source, .. })
            if matches!(
                source.raw_os_error(),
                Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH)
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    Ok(replies.iter().find_map(|reply| match reply {
        RouteNetlinkMessage::NewRoute(route) => route_from(route),
        _ => None,
    }))
}

/// The output interface and gateway of a route message (None without an
/// output interface).
fn route_from(route: &RouteMessage) -> Option<Route> {
    let mut oif = None;
    let mut gateway = None;
    for attr in &route.attributes {
        match attr {
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Gateway(RouteAddress::Inet(a)) => gateway = Some(IpAddr::V4(*a)),
            RouteAttribute::Gateway(RouteAddress::Inet6(a)) => gateway = Some(IpAddr::V6(*a)),
            _ => {}
        }
    }
    oif.map(|oif| Route {
        oif,
        gateway,
        prefix_len: route.header.destination_prefix_length,
    })
}

fn link_from(msg: &LinkMessage) -> Link {
    let mut link = Link {
        index: msg.header.index,
        name: String::new(),
        kind: None,
        framing: Framing::of(msg.header.link_layer_type),
    };
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::Kind(kind) = info {
                        link.kind = Some(kind_name(kind));
                    }
                }
            }
            _ => {}
        }
    }
    link
}

fn kind_name(kind: &InfoKind) -> String {
    match kind {
        InfoKind::Veth => "veth".to_owned(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Every interface in the calling thread's namespace.
pub fn links() -> Result<Vec<Link>, Error> {
    let replies = request(
        "link dump",
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    Ok(replies
        .iter()
        .filter_map(|r| match r {
            RouteNetlinkMessage::NewLink(l) => Some(link_from(l)),
            _ => None,
        })
        .collect())
}

/// The interface kube-proxy's IPVS mode binds every Service address to.
pub const IPVS_DUMMY: &str = "kube-ipvs0";

/// Whether an address on `interface` is one of the node's own. kube-proxy
/// (IPVS mode) puts every ClusterIP on a dummy interface: taken for the
/// node's, they would be "always allowed", and the backends behind them
/// with them.
pub fn is_node_address_interface(interface: &str) -> bool {
    interface != IPVS_DUMMY
}

/// The namespace's own unicast addresses, loopback, link-local and the
/// IPVS Service addresses left out: the node's addresses, always allowed
/// to reach its pods.
pub fn local_addresses() -> Result<Vec<IpAddr>, Error> {
    let replies = request(
        "address dump",
        RouteNetlinkMessage::GetAddress(AddressMessage::default()),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    let excluded: Vec<u32> = links()?
        .into_iter()
        .filter(|l| !is_node_address_interface(&l.name))
        .map(|l| l.index)
        .collect();
    let mut out = Vec::new();
    for r in replies {
        let RouteNetlinkMessage::NewAddress(a) = r else {
            continue;
        };
        if excluded.contains(&a.header.index) {
            continue;
        }
        for attr in &a.attributes {
            let ip = match attr {
                AddressAttribute::Local(ip) => *ip,
                AddressAttribute::Address(ip) if a.header.family == AddressFamily::Inet6 => *ip,
                _ => continue,
            };
            let skip = ip.is_loopback()
                || ip.is_unspecified()
                || matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
            if !skip && !out.contains(&ip) {
                out.push(ip);
            }
        }
    }
    out.sort();
    Ok(out)
}
