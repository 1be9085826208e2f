//! Raw IP packets from inside a pod's namespace: a hostile tenant's
//! forged headers. Judged at the receiver, never by the sender's errors.
use std::net::SocketAddr;

use policy_agent::sim::{NetNs, packet::Packet};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Sends `packets` (headers as given) from inside `netns`.
pub fn send_raw(netns: &NetNs, packets: Vec<Packet>) {
    netns
        .spawn(move || {
            for p in packets {
                let domain = Domain::for_address(SocketAddr::new(p.dst, 0));
                // IPPROTO_RAW: the packet carries its own IP header.
                let s = Socket::new(domain, Type::RAW, Some(Protocol::from(255))).unwrap();
                let to = SockAddr::from(SocketAddr::new(p.dst, 0));
                // The sender's errors mean nothing here: the victim judges.
                let _ = s.send_to(&p.ip_bytes(), &to);
            }
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
}
