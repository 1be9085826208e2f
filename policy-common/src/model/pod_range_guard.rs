//! The pod-range guard (see [`crate::pod_range_guard`]): an address in the node's pod
//! ranges that is not enforced is nobody traffic may reach or come from.
//!
//! - at a pod's hooks: its peer (step 3a of the verdict order);
//! - at the uplink's egress (`to_uplink`), after the Service judgement:
//!   the source ([`Datapath::uplink`]);
//! - at the uplink's ingress (`from_uplink`): the destination
//!   ([`Datapath::uplink_ingress`]).
//!
//! Without ranges nothing is looked up (the kernel's `CONFIG_POD_RANGES`
//! bit is clear).
use std::net::IpAddr;

use crate::{ipcache::IpcacheEntry, verdict::Reason};

use super::{Datapath, Judgement, Maps, Outcome, Packet, maps::masked};

impl Maps {
    /// Adds a pod range (masked as the kernel would).
    pub fn insert_pod_range(&mut self, addr: IpAddr, prefix_len: u32) {
        match addr {
            IpAddr::V4(a) => {
                self.pod_ranges_v4
                    .insert((prefix_len, masked(a.octets(), prefix_len)));
            }
            IpAddr::V6(a) => {
                self.pod_ranges_v6
                    .insert((prefix_len, masked(a.octets(), prefix_len)));
            }
        }
    }

    /// Whether `addr` is in the pod ranges.
    pub fn in_pod_ranges(&self, addr: IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => {
                (0..=32).any(|len| self.pod_ranges_v4.contains(&(len, masked(a.octets(), len))))
            }
            IpAddr::V6(a) => {
                (0..=128).any(|len| self.pod_ranges_v6.contains(&(len, masked(a.octets(), len))))
            }
        }
    }

    /// In the pod ranges and not enforced: traffic to or from it drops.
    pub fn unenforced(&self, addr: IpAddr) -> bool {
        self.in_pod_ranges(addr) && !self.enforced.contains_key(&addr)
    }
}

/// The guard's judgement: an unenforced peer.
pub(super) fn dropped() -> Judgement {
    Judgement {
        reason: Reason::DropUnenforced,
        matched: None,
        peer: IpcacheEntry::UNKNOWN,
        rule: crate::event::RuleRef::default(),
    }
}

/// The uplink egress's own verdict: a packet leaving from an unenforced
/// local address drops; None: it goes by unjudged.
pub(super) fn uplink_out(maps: &Maps, pkt: &Packet) -> Option<Judgement> {
    maps.unenforced(pkt.src).then(dropped)
}

impl Datapath {
    /// What the uplink's ingress hook (`from_uplink`) does with a packet:
    /// one for an unenforced local address drops, anything else goes by
    /// unjudged.
    pub fn uplink_ingress(&mut self, pkt: &Packet) -> Outcome {
        Outcome {
            after_dnat: None,
            judgement: self.maps.unenforced(pkt.dst).then(dropped),
            mark: pkt.mark,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::{
        direction,
        endpoint::{ENDPOINT_HAS_V4, EndpointInfo},
        model::tests::udp_packet as udp,
    };

    fn v4(d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 244, 1, d))
    }

    /// A pod at ifindex 7 (10.244.1.5, isolated nowhere) in 10.244.1.0/24,
    /// the gateway .1 a node address, .9 a new pod not enforced yet.
    fn node() -> Datapath {
        let mut m = Maps::default();
        m.endpoints.insert(
            7,
            EndpointInfo {
                identity: 300,
                flags: ENDPOINT_HAS_V4,
                ipv4: [10, 244, 1, 5],
                ..Default::default()
            },
        );
        m.insert_pod_range(v4(0), 24);
        m.enforced.insert(v4(5), 7);
        m.enforced.insert(v4(1), 0);
        Datapath::new(m)
    }

    #[test]
    fn a_pod_neither_reaches_nor_hears_an_unenforced_neighbour() {
        let mut dp = node();
        let out = dp.classify(&udp(direction::EGRESS, v4(5), v4(9)));
        assert_eq!(out.reason(), Some(Reason::DropUnenforced));
        let inn = dp.classify(&udp(direction::INGRESS, v4(9), v4(5)));
        assert_eq!(inn.reason(), Some(Reason::DropUnenforced));
        // The gateway (a node address) and addresses outside the range pass.
        let gw = dp.classify(&udp(direction::EGRESS, v4(5), v4(1)));
        assert_eq!(gw.reason(), Some(Reason::AllowNotIsolated));
        let far = IpAddr::V4(Ipv4Addr::new(10, 244, 2, 9));
        let far_out = dp.classify(&udp(direction::EGRESS, v4(5), far));
        assert_eq!(far_out.reason(), Some(Reason::AllowNotIsolated));
        // Enforced once written.
        dp.maps.enforced.insert(v4(9), 8);
        let now = dp.classify(&udp(direction::EGRESS, v4(5), v4(9)));
        assert_eq!(now.reason(), Some(Reason::AllowNotIsolated));
    }

    #[test]
    fn the_uplinks_drop_what_comes_from_or_goes_to_an_unenforced_address() {
        let mut dp = node();
        let far = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(
            dp.uplink(&udp(direction::EGRESS, v4(9), far)).reason(),
            Some(Reason::DropUnenforced)
        );
        assert!(dp.uplink(&udp(direction::EGRESS, v4(5), far)).passes());
        assert!(dp.uplink(&udp(direction::EGRESS, v4(1), far)).passes());
        assert_eq!(
            dp.uplink_ingress(&udp(direction::INGRESS, far, v4(9)))
                .reason(),
            Some(Reason::DropUnenforced)
        );
        assert!(
            dp.uplink_ingress(&udp(direction::INGRESS, far, v4(5)))
                .passes()
        );
        // Only the destination counts at ingress, the source at egress.
        assert!(
            dp.uplink_ingress(&udp(direction::INGRESS, v4(9), far))
                .passes()
        );
        assert!(dp.uplink(&udp(direction::EGRESS, far, v4(9))).passes());
    }

    /// A packet of a flow tracked at the current revision skips the
    /// guard; once the revision moves the flow is judged again, its peer
    /// first, and cut.
    #[test]
    fn a_tracked_flow_meets_the_guard_again_once_the_revision_moves() {
        use crate::{
            endpoint::{ENDPOINT_EGRESS_ISOLATED, lookups},
            identity,
            policy::{PolicyEntry, PolicyKey},
            proto,
        };
        let mut dp = node();
        let mut ep = dp.maps.endpoints[&7];
        ep.flags |= ENDPOINT_EGRESS_ISOLATED;
        ep.egress_lookups = lookups::ANY_PROTOCOL | lookups::ANY_PEER;
        ep.revision = 1;
        dp.maps.endpoints.insert(7, ep);
        dp.maps.policy.insert(
            PolicyKey::new(300, direction::EGRESS, identity::ANY, proto::ANY, 0, 0),
            PolicyEntry::default(),
        );
        dp.maps.enforced.insert(v4(9), 8);
        let out = udp(direction::EGRESS, v4(5), v4(9));
        let back = udp(direction::INGRESS, v4(9), v4(5));
        let back = Packet {
            sport: out.dport,
            dport: out.sport,
            ..back
        };
        assert_eq!(dp.classify(&out).reason(), Some(Reason::AllowPolicy));
        assert_eq!(dp.classify(&back).reason(), Some(Reason::AllowReply));
        dp.maps.enforced.remove(&v4(9));
        assert_eq!(dp.classify(&out).reason(), Some(Reason::AllowEstablished));
        ep.revision = 2;
        dp.maps.endpoints.insert(7, ep);
        assert_eq!(dp.classify(&back).reason(), Some(Reason::DropUnenforced));
        // Forgotten: the next packet is a new flow, refused as well.
        assert_eq!(dp.classify(&out).reason(), Some(Reason::DropUnenforced));
    }

    #[test]
    fn without_ranges_nothing_is_unenforced() {
        let mut dp = node();
        dp.maps.pod_ranges_v4.clear();
        let out = dp.classify(&udp(direction::EGRESS, v4(5), v4(9)));
        assert_eq!(out.reason(), Some(Reason::AllowNotIsolated));
        let six = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 9));
        dp.maps.insert_pod_range(six, 64);
        assert!(dp.maps.unenforced(six));
        assert!(!dp.maps.unenforced(v4(9)));
    }
}
