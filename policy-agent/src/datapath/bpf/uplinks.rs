//! The uplink classifier: on every interface of the node that is not a
//! local endpoint's (loopback aside), at egress. A pod's packet to a
//! Service is marked at the pod's veth and judged at the first hook after
//! DNAT: the backend's veth when the backend is local, else the interface
//! the rewritten packet leaves through (an uplink, a tunnel, a bridge, or
//! the veth of a pod not known yet), which this keeps covered.
//!
//! With `--pod-cidr` the same interfaces also carry `from_uplink` at
//! ingress, and `to_uplink` also drops what leaves from a local address
//! that is not enforced yet (see `policy_common::catchall`).
use std::collections::{BTreeMap, BTreeSet};

use policy_common::endpoint::{ATTACH_UPLINK, ATTACH_UPLINK_INGRESS};
use tracing::{info, warn};

use super::{BpfDatapath, Hook, loader::uplink_label};
use crate::{
    cluster::Problem,
    datapath::SyncReport,
    netlink::{self, Link},
};

/// The interfaces the uplink classifier belongs on: every one but
/// loopback and those carrying the pod classifiers (which judge marked
/// packets themselves).
pub fn uplink_candidates(links: Vec<Link>, pods: &BTreeSet<u32>) -> BTreeMap<u32, String> {
    links
        .into_iter()
        .filter(|l| l.name != "lo" && !pods.contains(&l.index))
        .map(|l| (l.index, l.name))
        .collect()
}

/// Attaches the uplink classifiers where they are missing (every
/// candidate, re-checked when `verify`; the ingress one only when
/// `ingress`: pod ranges are configured), and removes them from interfaces
/// that are no longer candidates (they became endpoints, or are gone).
pub fn sync_uplinks(
    dp: &mut BpfDatapath,
    pods: &BTreeSet<u32>,
    ingress: bool,
    verify: bool,
    report: &mut SyncReport,
) {
    let (hooks, bits): (&[Hook], u32) = if ingress {
        (
            &[Hook::Uplink, Hook::UplinkIngress],
            ATTACH_UPLINK | ATTACH_UPLINK_INGRESS,
        )
    } else {
        (&[Hook::Uplink], ATTACH_UPLINK)
    };
    let links = match netlink::links() {
        Ok(links) => links,
        Err(e) => {
            // Without the list, a Service backend reached through an
            // uncovered interface would go unjudged: say so, retry.
            report.incomplete = true;
            report.problems.push(Problem::node(format!(
                "cannot list interfaces for the uplink classifier: {e}"
            )));
            return;
        }
    };
    let wanted = uplink_candidates(links, pods);
    let meta = match dp.maps.read_meta() {
        Ok(meta) => meta,
        Err(e) => {
            report.incomplete = true;
            report
                .problems
                .push(Problem::node(format!("reading endpoint metadata: {e}")));
            return;
        }
    };
    for (ifindex, name) in &wanted {
        let has = meta.get(ifindex).is_some_and(|m| m.attach & bits == bits);
        if has && !verify {
            continue;
        }
        match dp.attach_uplink(*ifindex, &uplink_label(*ifindex), hooks) {
            Ok(()) if !has => info!(interface = %name, "uplink classifier attached"),
            Ok(()) => {}
            Err(e) => {
                warn!(interface = %name, error = %e, "uplink classifier not attached");
                report.incomplete = true;
                report.problems.push(Problem::node(format!(
                    "uplink classifier not attached to {name}: a pod's traffic to a Service whose backend is reached through it is not judged ({e})"
                )));
            }
        }
    }
    for (ifindex, m) in &meta {
        let gone: &[Hook] = if wanted.contains_key(ifindex) {
            if ingress || m.attach & ATTACH_UPLINK_INGRESS == 0 {
                continue;
            }
            &[Hook::UplinkIngress] // --pod-cidr no longer given.
        } else if m.attach & (ATTACH_UPLINK | ATTACH_UPLINK_INGRESS) != 0 {
            &[Hook::Uplink, Hook::UplinkIngress]
        } else {
            continue;
        };
        if let Err(errors) = dp.detach_uplink(*ifindex, gone) {
            for e in errors {
                warn!(ifindex, error = %e, "uplink classifier detach");
                report.problems.push(Problem::node(format!(
                    "detaching the uplink classifier from ifindex {ifindex}: {e}"
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, kind: Option<&str>) -> Link {
        Link {
            index,
            name: name.to_owned(),
            kind: kind.map(str::to_owned),
        }
    }

    #[test]
    fn every_interface_but_loopback_and_endpoints_is_an_uplink() {
        let links = vec![
            link(1, "lo", None),
            link(2, "eth0", None),
            link(3, "vxlan.calico", Some("vxlan")),
            link(7, "cali1234", Some("veth")),
            link(8, "cali5678", Some("veth")),
        ];
        let pods = BTreeSet::from([7]);
        let got = uplink_candidates(links, &pods);
        assert_eq!(
            got.keys().copied().collect::<Vec<_>>(),
            vec![2, 3, 8],
            "eth0, the tunnel, and the veth of a pod not known yet"
        );
    }
}
