//! Local endpoints: one entry per host-side pod interface.
use crate::assert_size;

/// The pod is isolated for ingress: only allowed peers may reach it.
pub const ENDPOINT_INGRESS_ISOLATED: u32 = 1 << 0;
/// The pod is isolated for egress: it may reach only allowed peers.
pub const ENDPOINT_EGRESS_ISOLATED: u32 = 1 << 1;

/// Some ClusterNetworkPolicy rule of either tier applies to traffic
/// reaching the pod: its policy entries carry tier verdicts, and a new
/// flow is judged by all of them (see [`crate::policy::Tiers`]).
pub const ENDPOINT_INGRESS_TIERED: u32 = 1 << 4;
/// The same for traffic the pod sends.
pub const ENDPOINT_EGRESS_TIERED: u32 = 1 << 5;

/// A change of this endpoint's tier entries is landing: new flows in that
/// direction are dropped until it has (tier verdicts are not monotonic:
/// half the old entries and half the new ones could admit what neither
/// set does). Set before the change's first write, cleared after its last.
pub const ENDPOINT_INGRESS_UPDATING: u32 = 1 << 6;
/// The same for traffic the pod sends.
pub const ENDPOINT_EGRESS_UPDATING: u32 = 1 << 7;

/// A staged policy would judge the pod where no enforced one does: its
/// connections are tracked, so each new flow is recorded once and the
/// agent can report what the staged policies would decide (see
/// `policy-agent`'s staged view). Verdicts do not change.
pub const ENDPOINT_STAGED: u32 = 1 << 8;

/// [`EndpointInfo::ipv4`] holds the pod's IPv4 address.
pub const ENDPOINT_HAS_V4: u32 = 1 << 2;
/// [`EndpointInfo::ipv6`] holds the pod's IPv6 address.
pub const ENDPOINT_HAS_V6: u32 = 1 << 3;

/// Marks a used slot of the `ENDPOINT_SLOTS` array (an unused slot is all
/// zero). Only the BPF map writer sets it; compiled state never carries it.
pub const ENDPOINT_SLOT_USED: u32 = 1 << 31;

/// Bits of [`EndpointInfo::ingress_lookups`] / [`EndpointInfo::egress_lookups`].
///
/// They tell the classifier which policy-key shapes exist for this endpoint
/// identity and direction, so it probes only those. Bit `n` for `n` in
/// `0..=16` means "some entry has port prefix length `n`" (16 = one port,
/// 0 = every port of one protocol).
pub mod lookups {
    /// Some entry allows every protocol (protocol 0, prefix 0).
    pub const ANY_PROTOCOL: u32 = 1 << 17;
    /// Some entry has the wildcard peer ([`crate::identity::ANY`]).
    pub const ANY_PEER: u32 = 1 << 18;
    /// Some entry names an address class (or any other peer that is not
    /// a label identity) as its peer: the class probe is needed.
    pub const CLASS_PEER: u32 = 1 << 19;
    /// Mask of the port-prefix-length bits.
    pub const PORT_PREFIXES: u32 = (1 << 17) - 1;

    /// The stored form of an endpoint's bits: [`CLASS_PEER`] inverted, so
    /// that an entry written before the bit existed (zero there) still
    /// probes the class rather than skipping a Deny it holds.
    #[inline(always)]
    pub const fn stored(bits: u32) -> u32 {
        bits ^ CLASS_PEER
    }

    /// The bit for a port prefix length (0..=16).
    pub const fn port_prefix(len: u8) -> u32 {
        1 << len
    }
}

/// Value of the `ENDPOINTS` map, keyed by the host-side ifindex (u32).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct EndpointInfo {
    /// The pod's label identity.
    pub identity: u32,
    /// `ENDPOINT_*_ISOLATED` bits.
    pub flags: u32,
    /// Bumped whenever this endpoint's verdicts may change; conntrack
    /// entries judged under an older revision are judged again.
    pub revision: u32,
    /// [`lookups`] bits for traffic reaching the pod, in their stored
    /// form ([`lookups::stored`]; read them with [`EndpointInfo::lookups`]).
    pub ingress_lookups: u32,
    /// [`lookups`] bits for traffic the pod sends, stored likewise.
    pub egress_lookups: u32,
    pub _reserved: u32,
    /// The pod's IPv6 address (with [`ENDPOINT_HAS_V6`]): what it may send
    /// from, and receive tracked flows at.
    pub ipv6: [u8; 16],
    /// The pod's IPv4 address (with [`ENDPOINT_HAS_V4`]).
    pub ipv4: [u8; 4],
    pub _pad: u32,
}
assert_size!(EndpointInfo, 48);

impl EndpointInfo {
    /// Whether a NetworkPolicy isolates the pod in `direction`.
    #[inline(always)]
    pub const fn isolated(&self, direction: u8) -> bool {
        self.has(
            direction,
            ENDPOINT_INGRESS_ISOLATED,
            ENDPOINT_EGRESS_ISOLATED,
        )
    }

    /// Whether the flag of `direction` (one bit for each) is set.
    #[inline(always)]
    const fn has(&self, direction: u8, ingress: u32, egress: u32) -> bool {
        let bit = if direction == crate::direction::INGRESS {
            ingress
        } else {
            egress
        };
        self.flags & bit != 0
    }

    /// Whether ClusterNetworkPolicy rules apply to the pod in `direction`.
    #[inline(always)]
    pub const fn tiered(&self, direction: u8) -> bool {
        self.has(direction, ENDPOINT_INGRESS_TIERED, ENDPOINT_EGRESS_TIERED)
    }

    /// Whether a change of its tier entries in `direction` is landing.
    #[inline(always)]
    pub const fn updating(&self, direction: u8) -> bool {
        self.has(
            direction,
            ENDPOINT_INGRESS_UPDATING,
            ENDPOINT_EGRESS_UPDATING,
        )
    }

    /// Whether a new flow in `direction` is judged by policy at all (a
    /// NetworkPolicy isolates the pod, or a ClusterNetworkPolicy applies).
    #[inline(always)]
    pub const fn judged(&self, direction: u8) -> bool {
        self.isolated(direction) || self.tiered(direction)
    }

    /// Whether a new flow the pod's `direction` admitted with `reason` is
    /// tracked: every admitted one, and what the node (or the pod itself,
    /// through a Service) opens to a pod whose egress tiers judge (such
    /// traffic is otherwise untracked; the pod's answers would meet the
    /// tiers as new flows).
    #[inline(always)]
    pub const fn tracks_new(&self, reason: crate::verdict::Reason, direction: u8) -> bool {
        reason.admits_new_flow()
            || (matches!(
                reason,
                crate::verdict::Reason::AllowNode | crate::verdict::Reason::AllowSelf
            ) && direction == crate::direction::INGRESS
                && self.tiered(crate::direction::EGRESS))
    }

    /// Whether `addr` (a 16-byte field, IPv4 in its first 4 bytes) of
    /// family `fam` is the pod's own address.
    #[inline(always)]
    pub fn owns(&self, fam: u8, addr: &[u8; 16]) -> bool {
        if fam == crate::family::IPV4 {
            self.flags & ENDPOINT_HAS_V4 != 0
                && addr[0] == self.ipv4[0]
                && addr[1] == self.ipv4[1]
                && addr[2] == self.ipv4[2]
                && addr[3] == self.ipv4[3]
        } else {
            self.flags & ENDPOINT_HAS_V6 != 0 && crate::addr_eq(addr, &self.ipv6)
        }
    }

    /// The pod's address of family `fam` in the 16-byte form (IPv4 in its
    /// first 4 bytes), if it has one.
    #[inline(always)]
    pub const fn address(&self, fam: u8) -> Option<[u8; 16]> {
        if fam == crate::family::IPV4 {
            if self.flags & ENDPOINT_HAS_V4 == 0 {
                return None;
            }
            let a = self.ipv4;
            Some([a[0], a[1], a[2], a[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        } else if self.flags & ENDPOINT_HAS_V6 != 0 {
            Some(self.ipv6)
        } else {
            None
        }
    }

    /// Whether connections of this endpoint are tracked: only where an
    /// entry decides something (the pod is judged in some direction), or
    /// where a staged policy would ([`ENDPOINT_STAGED`]).
    #[inline(always)]
    pub const fn tracks(&self) -> bool {
        self.flags
            & (ENDPOINT_INGRESS_ISOLATED
                | ENDPOINT_EGRESS_ISOLATED
                | ENDPOINT_INGRESS_TIERED
                | ENDPOINT_EGRESS_TIERED
                | ENDPOINT_STAGED)
            != 0
    }

    /// The lookup bits for `direction`.
    #[inline(always)]
    pub const fn lookups(&self, direction: u8) -> u32 {
        lookups::stored(if direction == crate::direction::INGRESS {
            self.ingress_lookups
        } else {
            self.egress_lookups
        })
    }
}

/// Length of [`EndpointMeta::name`].
pub const ENDPOINT_NAME_LEN: usize = 112;

/// [`EndpointMeta::attach`]: programs attached through TCX links (pinned).
pub const ATTACH_TCX: u32 = 1 << 0;
/// [`EndpointMeta::attach`]: programs attached as netlink clsact filters.
pub const ATTACH_NETLINK: u32 = 1 << 1;
/// [`EndpointMeta::attach`]: the agent created the clsact qdisc.
pub const ATTACH_CREATED_CLSACT: u32 = 1 << 2;
/// [`EndpointMeta::attach`]: the pod classifiers are attached (a local
/// endpoint's interface).
pub const ATTACH_POD: u32 = 1 << 3;
/// [`EndpointMeta::attach`]: the uplink classifier is attached at egress.
pub const ATTACH_UPLINK: u32 = 1 << 4;
/// [`EndpointMeta::attach`]: the uplink's ingress classifier is attached
/// (`from_uplink`, with `--pod-cidr`: traffic to local addresses not
/// enforced yet).
pub const ATTACH_UPLINK_INGRESS: u32 = 1 << 5;
/// [`EndpointMeta::attach`]: the uplink classifier for a device without a
/// link-layer header is attached at egress (`to_uplink_l3`).
pub const ATTACH_UPLINK_L3: u32 = 1 << 7;
/// [`EndpointMeta::attach`]: its ingress one (`from_uplink_l3`).
pub const ATTACH_UPLINK_INGRESS_L3: u32 = 1 << 8;
/// Every uplink attachment bit, of either framing.
pub const ATTACH_ANY_UPLINK: u32 =
    ATTACH_UPLINK | ATTACH_UPLINK_INGRESS | ATTACH_UPLINK_L3 | ATTACH_UPLINK_INGRESS_L3;
/// [`EndpointMeta::attach`]: the pod classifiers were attached to a new
/// veth before any pod was known to hold it (standby). Until the pod's
/// endpoint entry is written they pass everything on (`TC_ACT_UNSPEC`) to
/// the programs after them — the uplink classifiers while no pod holds
/// the veth — so the CNI hand-off finds them in place and only writes the
/// entry.
pub const ATTACH_STANDBY: u32 = 1 << 6;

/// Value of `ENDPOINT_META` (userspace only): who the endpoint is and how
/// the agent attached to it, so `dump` can name it and `reset` can undo
/// exactly what was done.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct EndpointMeta {
    /// `ATTACH_*` bits.
    pub attach: u32,
    pub name_len: u32,
    /// Inode of the network namespace the ifindex belongs to: ifindexes
    /// mean nothing in another namespace, so netlink cleanup is skipped
    /// there rather than aimed at a stranger's interface.
    pub netns: u64,
    /// "namespace/pod", NUL-padded.
    pub name: [u8; ENDPOINT_NAME_LEN],
}
assert_size!(EndpointMeta, 128);

#[cfg(feature = "user")]
impl EndpointInfo {
    /// Records the pod's addresses (the first of each family: Kubernetes
    /// gives a pod at most one): the classifier lets it send only from
    /// these, and opens flows only for what it receives at them.
    pub fn with_addresses(mut self, ips: &[std::net::IpAddr]) -> Self {
        for ip in ips {
            match ip {
                std::net::IpAddr::V4(v4) if self.flags & ENDPOINT_HAS_V4 == 0 => {
                    self.ipv4 = v4.octets();
                    self.flags |= ENDPOINT_HAS_V4;
                }
                std::net::IpAddr::V6(v6) if self.flags & ENDPOINT_HAS_V6 == 0 => {
                    self.ipv6 = v6.octets();
                    self.flags |= ENDPOINT_HAS_V6;
                }
                _ => {}
            }
        }
        self
    }
}

#[cfg(feature = "user")]
crate::user_pod!(EndpointInfo, EndpointMeta);
