//! Finding each local pod's host-side interface by the route to its IPs
//! (works for routed veths: Calico, kindnet, Cilium-style ptp).
use std::{
    collections::{BTreeMap, btree_map::Entry},
    net::IpAddr,
};

use crate::{
    cluster::{ObjectKind, PodRef, Problem},
    netlink,
};

/// A pod's host-side interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub ifindex: u32,
    pub name: String,
}

/// Resolves every pod in the calling thread's namespace. A pod is left out
/// (with a problem) when an IP has no route, routes through a gateway or
/// by a route it shares with other addresses (a subnet or default route:
/// before the pod's own route exists, its address may route on-link out of
/// the node's uplink), its IPs route to different interfaces, or the
/// interface is not a veth: attaching to the node's uplink by mistake
/// would judge all traffic.
pub fn resolve_interfaces(
    pods: &BTreeMap<PodRef, Vec<IpAddr>>,
) -> (BTreeMap<PodRef, Interface>, Vec<Problem>) {
    let mut found = BTreeMap::new();
    let mut problems = Vec::new();
    if pods.is_empty() {
        return (found, problems);
    }
    let links: BTreeMap<u32, netlink::Link> = match netlink::links() {
        Ok(l) => l.into_iter().map(|l| (l.index, l)).collect(),
        Err(e) => {
            problems.push(Problem::node(format!("listing interfaces: {e}")));
            return (found, problems);
        }
    };
    for (pod, ips) in pods {
        let mut problem =
            |reason: String| problems.push(Problem::object(ObjectKind::Pod, pod.clone(), reason));
        let mut ifindex = None;
        let mut bad = false;
        for ip in ips {
            match netlink::route_to(*ip) {
                Ok(Some(route)) if route.gateway.is_some() => {
                    problem(format!(
                        "{ip} routes through a gateway ({:?}), not to a local pod interface",
                        route.gateway
                    ));
                    bad = true;
                }
                Ok(Some(route)) if !route.is_host_route_of(*ip) => {
                    problem(format!(
                        "{ip} has no route of its own yet (it matches a /{} route on ifindex {}, which other addresses share): not attaching there",
                        route.prefix_len, route.oif
                    ));
                    bad = true;
                }
                Ok(Some(route)) => match ifindex {
                    None => ifindex = Some(route.oif),
                    Some(i) if i == route.oif => {}
                    Some(i) => {
                        problem(format!(
                            "its IPs route to different interfaces ({i} and {})",
                            route.oif
                        ));
                        bad = true;
                    }
                },
                Ok(None) => {
                    problem(format!(
                        "no route to {ip}: its interface is missing (not attached)"
                    ));
                    bad = true;
                }
                Err(e) => {
                    problem(format!("route lookup for {ip}: {e}"));
                    bad = true;
                }
            }
        }
        let Some(ifindex) = ifindex.filter(|_| !bad) else {
            continue;
        };
        match links.get(&ifindex) {
            Some(link) if link.kind.as_deref() == Some("veth") => {
                found.insert(
                    pod.clone(),
                    Interface {
                        ifindex,
                        name: link.name.clone(),
                    },
                );
            }
            Some(link) => problem(format!(
                "its IPs route to {} (kind {}), not a veth: refusing to attach there",
                link.name,
                link.kind.as_deref().unwrap_or("unknown")
            )),
            None => problem(format!(
                "its IPs route to ifindex {ifindex}, which does not exist"
            )),
        }
    }
    (found, problems)
}

/// Interfaces found so far, by pod and the IPs they were found for: a sync
/// looks up only pods that are new or whose IPs changed. Cleared on link
/// events and periodic resyncs (which also re-verify every attachment).
#[derive(Debug, Default)]
pub struct InterfaceCache {
    found: BTreeMap<PodRef, (Vec<IpAddr>, Interface)>,
    /// Set by a clear: the next full sync re-verifies every attachment.
    verify: bool,
    /// Set by a link event: the next sync looks again at the pods whose
    /// interface is missing or gone (not at every pod).
    links: bool,
}

impl InterfaceCache {
    /// An empty cache whose first full sync re-verifies every attachment.
    pub fn verifying() -> Self {
        Self {
            verify: true,
            ..Self::default()
        }
    }

    pub fn clear(&mut self) {
        self.found.clear();
        self.verify = true;
    }

    /// Links came or went: the next sync re-checks what they can change.
    pub fn links_changed(&mut self) {
        self.links = true;
    }

    /// Whether links came or went since the last call.
    pub fn take_links_changed(&mut self) -> bool {
        std::mem::take(&mut self.links)
    }

    /// Whether every attachment should be checked this sync (once).
    pub fn take_verify(&mut self) -> bool {
        std::mem::take(&mut self.verify)
    }

    /// Whether the next sync must look at every pod (after a clear).
    pub fn needs_full_pass(&self) -> bool {
        self.verify
    }

    /// One pod's interface (cached unless its IPs changed).
    pub fn resolve_one(
        &mut self,
        pod: &PodRef,
        ips: &[IpAddr],
    ) -> (Option<Interface>, Vec<Problem>) {
        if let Some((known, iface)) = self.found.get(pod)
            && known.as_slice() == ips
        {
            return (Some(iface.clone()), Vec::new());
        }
        let one: BTreeMap<PodRef, Vec<IpAddr>> =
            [(pod.clone(), ips.to_vec())].into_iter().collect();
        let (mut fresh, problems) = resolve_interfaces(&one);
        match fresh.remove(pod) {
            Some(iface) => {
                self.found
                    .insert(pod.clone(), (ips.to_vec(), iface.clone()));
                (Some(iface), problems)
            }
            None => {
                self.found.remove(pod);
                (None, problems)
            }
        }
    }

    /// The interface last found for `pod`.
    pub fn get(&self, pod: &PodRef) -> Option<&Interface> {
        self.found.get(pod).map(|(_, i)| i)
    }

    /// The addresses `pod`'s interface was last found for.
    pub fn ips(&self, pod: &PodRef) -> Option<&[IpAddr]> {
        self.found.get(pod).map(|(ips, _)| ips.as_slice())
    }

    /// Drops a pod that is gone, returning the interface it had.
    pub fn forget(&mut self, pod: &PodRef) -> Option<Interface> {
        self.found.remove(pod).map(|(_, i)| i)
    }

    /// Every pod's interface; a pod whose interface another pod already
    /// has is left out, with a problem.
    pub fn resolve(
        &mut self,
        pods: &BTreeMap<PodRef, Vec<IpAddr>>,
    ) -> (BTreeMap<PodRef, Interface>, Vec<Problem>) {
        self.found
            .retain(|pod, (ips, _)| pods.get(pod) == Some(ips));
        let missing: BTreeMap<PodRef, Vec<IpAddr>> = pods
            .iter()
            .filter(|(p, _)| !self.found.contains_key(*p))
            .map(|(p, i)| (p.clone(), i.clone()))
            .collect();
        let (fresh, mut problems) = resolve_interfaces(&missing);
        for (pod, iface) in fresh {
            let ips = pods.get(&pod).cloned().unwrap_or_default();
            self.found.insert(pod, (ips, iface));
        }
        let mut interfaces = self
            .found
            .iter()
            .map(|(p, (_, i))| (p.clone(), i.clone()))
            .collect();
        drop_shared_interfaces(&mut interfaces, &mut problems);
        (interfaces, problems)
    }
}

/// Two pods routed to one interface cannot both be that endpoint: keep
/// the first, report the rest.
fn drop_shared_interfaces(
    interfaces: &mut BTreeMap<PodRef, Interface>,
    problems: &mut Vec<Problem>,
) {
    let mut owner: BTreeMap<u32, PodRef> = BTreeMap::new();
    let mut drop = Vec::new();
    for (pod, iface) in interfaces.iter() {
        match owner.entry(iface.ifindex) {
            Entry::Occupied(first) => {
                problems.push(Problem::object(
                    ObjectKind::Pod,
                    pod.clone(),
                    format!(
                        "its interface {} already belongs to pod {}",
                        iface.name,
                        first.get()
                    ),
                ));
                drop.push(pod.clone());
            }
            Entry::Vacant(v) => {
                v.insert(pod.clone());
            }
        }
    }
    for pod in drop {
        interfaces.remove(&pod);
    }
}
