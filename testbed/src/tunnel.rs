//! An L3 link for the pod network between the two nodes of a
//! [`crate::SimCluster`]: each node routes the other's pod CIDRs through a
//! device without a link-layer header, as Calico's IP-in-IP, flannel's
//! ipip backend or WireGuard do. Where the kernel has GRE, a GRE tunnel
//! between the nodes' addresses; where it has none (this project's 6.18
//! host), a tun device in each node and a thread that carries what one
//! sends to the other (as a VPN daemon would).
use std::{
    fs::File,
    io::{Read as _, Write as _},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use crate::{ClusterNode, Error, NetNs, netns::run};

/// The tunnel device on both nodes.
pub const TUNNEL_DEV: &str = "pal3";

/// How the tunnel is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelKind {
    /// A kernel GRE tunnel (ARPHRD_IPGRE).
    Gre,
    /// tun devices with a relay (ARPHRD_NONE).
    Tun,
}

/// The tunnel; dropping it stops the relay (the devices go with their
/// namespaces).
#[derive(Debug)]
pub struct Tunnel {
    pub kind: TunnelKind,
    stop: Arc<AtomicBool>,
    relay: Option<JoinHandle<()>>,
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.relay.take() {
            let _ = r.join();
        }
    }
}

/// Whether this kernel makes GRE devices (the module may be missing).
pub fn kernel_has_gre() -> bool {
    run("modprobe", &["ip_gre"]).is_ok() || std::path::Path::new("/sys/module/ip_gre").exists()
}

/// Routes each node's pod CIDRs from the other through a tunnel of `kind`
/// instead of the veth link (node addresses stay on the link, which also
/// carries the GRE packets).
pub fn tunnel(nodes: [&ClusterNode; 2], kind: TunnelKind) -> Result<Tunnel, Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let relay = match kind {
        TunnelKind::Gre => {
            for (me, other) in [(nodes[0], nodes[1]), (nodes[1], nodes[0])] {
                let (local, remote) = (me.v4.to_string(), other.v4.to_string());
                me.sim.node.ip(&[
                    "link", "add", TUNNEL_DEV, "type", "gre", "local", &local, "remote", &remote,
                    "ttl", "64",
                ])?;
            }
            None
        }
        TunnelKind::Tun => {
            let a = open_tun(&nodes[0].sim.node)?;
            let b = open_tun(&nodes[1].sim.node)?;
            let stop = stop.clone();
            Some(
                std::thread::Builder::new()
                    .name("tun-relay".into())
                    .spawn(move || relay(a, b, &stop))
                    .map_err(Error::Thread)?,
            )
        }
    };
    for (me, other) in [(nodes[0], nodes[1]), (nodes[1], nodes[0])] {
        let ns = &me.sim.node;
        let (c4, c6) = (
            other.pod_cidrs[0].to_string(),
            other.pod_cidrs[1].to_string(),
        );
        ns.sysctl(&format!("net.ipv6.conf.{TUNNEL_DEV}.accept_dad"), "0")
            .ok();
        for args in [
            vec!["link", "set", TUNNEL_DEV, "up"],
            vec!["route", "replace", &c4, "dev", TUNNEL_DEV],
            vec!["-6", "route", "replace", &c6, "dev", TUNNEL_DEV],
        ] {
            ns.ip(&args)?;
        }
        // A packet entering at the tunnel leaves by a pod's veth: no
        // reverse-path check against the link that carries the tunnel.
        ns.sysctl(&format!("net.ipv4.conf.{TUNNEL_DEV}.rp_filter"), "0")
            .ok();
    }
    Ok(Tunnel { kind, stop, relay })
}

/// A tun device named [`TUNNEL_DEV`] in `ns` (IFF_TUN | IFF_NO_PI: IP
/// packets, no header of its own), non-blocking.
fn open_tun(ns: &NetNs) -> Result<File, Error> {
    let name = ns.name.clone();
    let sock_err = move |source| Error::Socket {
        netns: name.clone(),
        source,
    };
    let opened = ns.spawn(|| -> std::io::Result<File> {
        let file = File::options()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        // struct ifreq: the name, then the flags.
        let mut ifr = [0u8; 40];
        ifr[..TUNNEL_DEV.len()].copy_from_slice(TUNNEL_DEV.as_bytes());
        let flags: u16 = 0x0001 | 0x1000; // IFF_TUN | IFF_NO_PI
        ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
        const TUNSETIFF: libc::c_ulong = 0x400454ca;
        // SAFETY: ifr is a valid struct ifreq image for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fcntl on an open descriptor.
        unsafe {
            let fl = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(file.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        Ok(file)
    })?;
    opened
        .join()
        .map_err(|_| Error::Invalid("tun thread panicked".into()))??
        .map_err(sock_err)
}

/// Carries every packet one device sends to the other until `stop`.
fn relay(mut a: File, mut b: File, stop: &AtomicBool) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        let ready = crate::poll::readable([a.as_raw_fd(), b.as_raw_fd()], 100);
        for fd in ready {
            let (from, to) = if fd == a.as_raw_fd() {
                (&mut a, &mut b)
            } else {
                (&mut b, &mut a)
            };
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = to.write(&buf[..n]);
            }
        }
    }
}
