//! Finding the host side of the pod's interface, in this process's (the
//! host's) network namespace.
//!
//! No CNI result carries an ifindex, and not every main plugin lists its
//! host interface (bridge lists two, some none), so the kernel is asked
//! first, as Cilium's generic-veth chaining does: on a thread entered into
//! `CNI_NETNS`, `CNI_IFNAME` must be a veth whose `IFLA_LINK` is its peer's
//! index; back in the host namespace that index must be a veth pointing
//! back at it. `prevResult`'s host-side entry is the cross-check (a
//! disagreement is logged; the kernel wins), and the fallback when the
//! kernel gives no answer (exactly one candidate, resolved by name here).
use std::{fs::File, os::fd::AsRawFd, os::unix::fs::MetadataExt};

use super::{
    error::{CniError, codes},
    netlink::{Link, Query, get_link},
};
use crate::protocol::{HostInterface, code};

/// The answer, and what was noticed on the way (for the log).
#[derive(Debug)]
pub struct Found {
    pub interface: HostInterface,
    pub notes: Vec<String>,
}

/// Resolves the host interface of `ifname` in `netns`, given the names
/// `prevResult` lists outside any sandbox.
pub fn resolve(netns: &str, ifname: &str, candidates: &[String]) -> Result<Found, CniError> {
    let mut notes = Vec::new();
    match from_kernel(netns, ifname) {
        Ok(found) => {
            if !candidates.is_empty() && !candidates.contains(&found.name) {
                notes.push(format!(
                    "prevResult names {candidates:?} on the host but {ifname}'s veth peer is {}; using the peer",
                    found.name
                ));
            }
            return Ok(Found {
                interface: found,
                notes,
            });
        }
        Err(reason) => notes.push(format!("kernel: {reason}")),
    }
    let resolved: Vec<Link> = candidates
        .iter()
        .filter_map(|name| match get_link(Query::Name(name)) {
            Ok(Some(link)) => Some(link),
            Ok(None) => {
                notes.push(format!("prevResult's {name} does not exist on the host"));
                None
            }
            Err(e) => {
                notes.push(format!("reading {name}: {e}"));
                None
            }
        })
        .collect();
    match resolved.as_slice() {
        [one] => Ok(Found {
            interface: HostInterface {
                name: one.name.clone(),
                ifindex: one.index,
            },
            notes,
        }),
        _ => Err(CniError::new(
            code::NO_HOST_INTERFACE,
            "cannot find the pod's host-side interface",
            format!(
                "{ifname} in {netns}: {} (prevResult host-side candidates: {candidates:?})",
                notes.join("; ")
            ),
        )),
    }
}

/// The veth peer of `ifname` in `netns`, checked from both ends.
fn from_kernel(netns: &str, ifname: &str) -> Result<HostInterface, String> {
    let path = netns.to_owned();
    let name = ifname.to_owned();
    let inside = std::thread::Builder::new()
        .name("cni-netns".into())
        .spawn(move || -> Result<Link, String> {
            let file = File::open(&path).map_err(|e| format!("opening {path}: {e}"))?;
            // SAFETY: setns on a namespace fd moves only this thread, which
            // ends with this closure.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!(
                    "entering {path}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            get_link(Query::Name(&name))
                .map_err(|e| format!("reading {name} in {path}: {e}"))?
                .ok_or_else(|| format!("no {name} in {path}"))
        })
        .map_err(|e| format!("starting a thread: {e}"))?
        .join()
        .map_err(|_| "the netns thread panicked".to_owned())??;
    if inside.kind.as_deref() != Some("veth") {
        return Err(format!(
            "{ifname} is a {} link, not a veth",
            inside.kind.as_deref().unwrap_or("plain")
        ));
    }
    let peer = inside
        .peer
        .filter(|&p| p != 0)
        .ok_or_else(|| format!("{ifname} has no peer index"))?;
    if inside.peer_netnsid.is_none() {
        return Err(format!("{ifname}'s peer is inside the pod's namespace too"));
    }
    let host = get_link(Query::Index(peer))
        .map_err(|e| format!("reading ifindex {peer} on the host: {e}"))?
        .ok_or_else(|| format!("{ifname}'s peer ifindex {peer} does not exist on the host"))?;
    if host.kind.as_deref() != Some("veth")
        || host.peer != Some(inside.index)
        || host.peer_netnsid.is_none()
    {
        return Err(format!(
            "host ifindex {peer} ({}) is not the veth peer of {ifname} (ifindex {})",
            host.name, inside.index
        ));
    }
    Ok(HostInterface {
        name: host.name,
        ifindex: host.index,
    })
}

/// Code 8 when the plugin runs inside the pod's namespace (the runtime
/// must run it in the host's; the host-side lookups would be wrong).
pub fn check_not_inside(netns: &str) -> Result<(), CniError> {
    let ours = std::fs::metadata("/proc/self/ns/net");
    let theirs = std::fs::metadata(netns).map_err(|e| {
        CniError::new(
            codes::INVALID_NETNS,
            "invalid network namespace",
            format!("{netns}: {e}"),
        )
    })?;
    if ours.is_ok_and(|o| o.dev() == theirs.dev() && o.ino() == theirs.ino()) {
        return Err(CniError::new(
            codes::INVALID_NETNS,
            "invalid network namespace",
            format!("the plugin runs inside {netns}, the pod's own namespace"),
        ));
    }
    Ok(())
}
