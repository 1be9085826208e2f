//! The uplink classifier: on every interface of the node that is not a
//! local endpoint's (loopback aside), at egress. A pod's packet to a
//! Service is marked at the pod's veth and judged at the first hook after
//! DNAT: the backend's veth when the backend is local, else the interface
//! the rewritten packet leaves through (an uplink, a tunnel, a bridge, or
//! the veth of a pod not known yet), which this keeps covered.
//!
//! With `--pod-cidr` the same interfaces also carry `from_uplink` at
//! ingress, and `to_uplink` also drops what leaves from a local address
//! that is not enforced yet (see `policy_common::pod_range_guard`).
//!
//! A veth that appears while the agent runs also gets the pod classifiers,
//! at once (standby, [`standby`]): without an endpoint entry they pass
//! everything on to these, and the pod's CNI hand-off finds them in place.
use std::collections::{BTreeMap, BTreeSet};

use policy_common::endpoint::{ATTACH_ANY_UPLINK, ATTACH_STANDBY};
use tracing::{info, warn};

use super::{
    attach::hook_bit,
    loader::{PinnedClassifier, standby_label, uplink_label},
    pins::Hook,
};
use crate::{
    cluster::Problem,
    datapath::SyncReport,
    netlink::{self, Framing, Link},
};

/// The interfaces the uplink classifier belongs on: every one but
/// loopback and those carrying the pod classifiers (which judge marked
/// packets themselves), with how their packets are framed.
pub fn uplink_candidates(
    links: Vec<Link>,
    pods: &BTreeSet<u32>,
) -> BTreeMap<u32, (String, Framing)> {
    links
        .into_iter()
        .filter(|l| l.name != "lo" && l.framing != Framing::Loopback && !pods.contains(&l.index))
        .map(|l| (l.index, (l.name, l.framing)))
        .collect()
}

/// The uplink hooks wanted on a device of `framing` (the ingress one only
/// when `ingress`: pod ranges are configured) and their attach bits; None:
/// no classifier can read its packets.
fn wanted_hooks(framing: Framing, ingress: bool) -> Option<(Vec<Hook>, u32)> {
    let [egress, at_ingress] = Hook::uplinks(framing)?;
    let hooks = if ingress {
        vec![egress, at_ingress]
    } else {
        vec![egress]
    };
    let bits = hooks.iter().fold(0, |b, h| b | hook_bit(*h));
    Some((hooks, bits))
}

/// Attaches the uplink classifiers where they are missing (every
/// candidate, re-checked when `verify`; the ingress one only when
/// `ingress`: pod ranges are configured), and removes them from interfaces
/// that are no longer candidates (they became endpoints, or are gone).
/// Each device gets the programs that read its framing; one whose packets
/// no program here can read gets none and is reported, rather than judged
/// by a parse that would misread it.
pub fn sync_uplinks(
    dp: &mut PinnedClassifier,
    pods: &BTreeSet<u32>,
    ingress: bool,
    verify: bool,
    report: &mut SyncReport,
) {
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
    let present: BTreeSet<u32> = links.iter().map(|l| l.index).collect();
    let wanted = uplink_candidates(links, pods);
    let meta = match dp.maps().read_meta() {
        Ok(meta) => meta,
        Err(e) => {
            report.incomplete = true;
            report
                .problems
                .push(Problem::node(format!("reading endpoint metadata: {e}")));
            return;
        }
    };
    for (ifindex, (name, framing)) in &wanted {
        let Some((hooks, bits)) = wanted_hooks(*framing, ingress) else {
            report.problems.push(Problem::node(format!(
                "not attaching the uplink classifier to {name}: no classifier here reads its packets ({framing:?}); a pod's traffic to a Service whose backend is reached through it is not judged after DNAT"
            )));
            continue;
        };
        let known = meta.get(ifindex).map_or(0, |m| m.attach);
        let standby = known & ATTACH_STANDBY != 0;
        if standby
            && verify
            && let Err(e) = dp.attach_standby(*ifindex)
        {
            // Only the hand-off's attach is slower then: no report.
            warn!(interface = %name, error = %e, "standby classifiers not attached");
        }
        // The other framing's programs (an interface index reused by a
        // device of another kind) go first.
        let pair = Hook::uplinks(*framing).unwrap_or([hooks[0], hooks[0]]);
        let stale: Vec<Hook> = Hook::ALL
            .into_iter()
            .filter(|h| known & ATTACH_ANY_UPLINK & hook_bit(*h) != 0 && !pair.contains(h))
            .collect();
        if !stale.is_empty()
            && let Err(errors) = dp.detach_uplink(*ifindex, &stale)
        {
            for e in errors {
                warn!(interface = %name, error = %e, "uplink classifier of another framing detach");
            }
        }
        let has = known & bits == bits && stale.is_empty();
        if has && !verify {
            continue;
        }
        let label = if standby {
            standby_label(*ifindex)
        } else {
            uplink_label(*ifindex)
        };
        match dp.attach_uplink(*ifindex, &label, &hooks) {
            Ok(()) => {
                if !has {
                    info!(interface = %name, framing = ?framing, "uplink classifier attached");
                }
                check_order(dp, *ifindex, name, report);
            }
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
        if m.attach & ATTACH_STANDBY != 0 && !present.contains(ifindex) {
            // The veth went before any pod claimed it: its pins go too.
            if let Err(errors) = dp.detach_all(*ifindex) {
                for e in errors {
                    warn!(ifindex, error = %e, "standby classifiers detach");
                }
            }
            continue;
        }
        let gone: Vec<Hook> = match wanted.get(ifindex) {
            // --pod-cidr no longer given: the ingress ones go.
            Some(_) if !ingress => [Hook::UplinkIngress, Hook::UplinkIngressL3]
                .into_iter()
                .filter(|h| m.attach & hook_bit(*h) != 0)
                .collect(),
            Some(_) => Vec::new(),
            None => Hook::ALL
                .into_iter()
                .filter(|h| m.attach & ATTACH_ANY_UPLINK & hook_bit(*h) != 0)
                .collect(),
        };
        if gone.is_empty() {
            continue;
        }
        if let Err(errors) = dp.detach_uplink(*ifindex, &gone) {
            for e in errors {
                warn!(ifindex, error = %e, "uplink classifier detach");
                report.problems.push(Problem::node(format!(
                    "detaching the uplink classifier from ifindex {ifindex}: {e}"
                )));
            }
        }
    }
}

/// The order check of an uplink (see `PinnedClassifier::check_order`): a
/// foreign TCX program ahead of the netlink filters moves the interface to
/// TCX links; what still runs ahead is a node problem (a pod's packet to a
/// Service whose backend is reached through here would pass unjudged).
fn check_order(dp: &mut PinnedClassifier, ifindex: u32, name: &str, report: &mut SyncReport) {
    let check = dp.check_order(ifindex);
    match check.moved {
        Some(Ok(leftovers)) => {
            warn!(interface = %name, "foreign TCX programs ran before the uplink classifier's filters: moved to TCX links, first in the chain");
            for e in leftovers {
                warn!(interface = %name, error = %e, "filter left after the move to TCX");
            }
        }
        Some(Err(e)) => report.problems.push(Problem::node(format!(
            "moving {name} to TCX, ahead of foreign programs: {e}"
        ))),
        None => {}
    }
    for (hook, what) in check.ahead {
        warn!(interface = %name, hook = hook.name(), ahead = %what, "foreign programs run before the classifier");
        report.problems.push(Problem::node(format!(
            "{what} run before the classifier at {name} {}: they can pass packets unjudged",
            hook.name()
        )));
    }
}

/// A veth that appears while the agent runs is most likely a pod's whose
/// hand-off is on its way: the pod classifiers go on now (they pass what
/// has no endpoint entry on to the programs after them: the uplink
/// classifiers, which the next sync adds while no pod holds the veth), so
/// the hand-off only writes the entry. False: not attached (nothing left
/// behind).
pub(super) fn standby(dp: &mut PinnedClassifier, ifindex: u32, name: &str) -> bool {
    match dp.attach_standby(ifindex) {
        Ok(()) => {
            info!(interface = %name, "pod classifiers attached ahead of the pod (standby)");
            true
        }
        Err(super::Error::NoInterface(_)) => {
            // Gone already (created and deleted in one burst).
            let _ = dp.detach(ifindex);
            false
        }
        Err(e) => {
            warn!(interface = %name, error = %e, "standby classifiers not attached; the pod's hand-off attaches them");
            if let Err(errors) = dp.detach(ifindex) {
                for e in errors {
                    warn!(interface = %name, error = %e, "standby classifiers detach");
                }
            }
            false
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
            framing: if name == "lo" {
                Framing::Loopback
            } else {
                Framing::Ethernet
            },
        }
    }

    #[test]
    fn each_framing_gets_the_programs_that_read_it_and_no_other() {
        assert_eq!(
            wanted_hooks(Framing::Ethernet, true),
            Some((
                vec![Hook::Uplink, Hook::UplinkIngress],
                policy_common::endpoint::ATTACH_UPLINK
                    | policy_common::endpoint::ATTACH_UPLINK_INGRESS
            ))
        );
        assert_eq!(
            wanted_hooks(Framing::Ip, false),
            Some((
                vec![Hook::UplinkL3],
                policy_common::endpoint::ATTACH_UPLINK_L3
            ))
        );
        // A device no program here reads (SLIP, say) gets none.
        assert_eq!(wanted_hooks(Framing::Other(256), true), None);
        assert_eq!(wanted_hooks(Framing::Loopback, true), None);
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
