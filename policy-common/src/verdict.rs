//! Why a packet passed or dropped. Each reason has a counter per direction.

/// Verdict reasons. Values below [`FIRST_DROP`] pass the packet.
#[repr(u8)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// A policy entry allowed a new flow.
    AllowPolicy = 1,
    /// Conntrack: a later packet of a flow allowed in this direction.
    AllowEstablished = 2,
    /// Conntrack: a reply to a flow allowed in the other direction.
    AllowReply = 3,
    /// An ICMP error about a tracked flow.
    AllowRelated = 4,
    /// The peer is the local node (kubelet probes and the like).
    AllowNode = 5,
    /// The pod is not isolated in this direction.
    AllowNotIsolated = 6,
    /// The pod talking to itself (source == destination).
    AllowSelf = 7,
    /// Not IPv4/IPv6 (ARP and friends): no policy governs it.
    AllowNonIp = 8,
    /// ICMPv6 router/neighbour discovery (types 133-137).
    AllowNeighborDiscovery = 9,
    /// A non-first fragment of a datagram whose first fragment passed.
    AllowFragment = 10,
    /// The interface has no endpoint entry (being set up or torn down).
    PassNoEndpoint = 11,
    /// To a Service frontend: passed on, judged after DNAT where the
    /// backend is known.
    PassService = 12,
    /// An Admin-tier ClusterNetworkPolicy rule accepted a new flow.
    AllowAdminTier = 13,
    /// A Baseline-tier ClusterNetworkPolicy rule accepted a new flow.
    AllowBaselineTier = 14,
    /// No policy entry allows the flow.
    DropPolicy = 32,
    /// A tracked flow judged again after a policy change, and denied.
    DropPolicyChanged = 33,
    /// Bad or truncated IP/L4 header: the packet cannot be judged.
    DropMalformed = 34,
    /// A non-first fragment whose first fragment was not seen passing.
    DropFragmentUnknown = 35,
    /// Sent by the pod with a source address that is not the pod's.
    DropSpoofed = 36,
    /// To or from an address in the node's pod ranges (`--pod-cidr`) that
    /// no enforced endpoint holds yet: a pod whose veth the agent has not
    /// attached to (see `policy_common::pod_range_guard`).
    DropUnenforced = 37,
    /// An Admin-tier ClusterNetworkPolicy rule denied a new flow.
    DropAdminTier = 38,
    /// A Baseline-tier ClusterNetworkPolicy rule denied a new flow.
    DropBaselineTier = 39,
    /// A change of the endpoint's tier entries was landing: new flows wait
    /// (fail closed; see `ENDPOINT_*_UPDATING`).
    DropUpdating = 40,
    /// Not a verdict: a drop event lost because the ring buffer was full.
    EventLost = 48,
    /// Not a verdict: a conntrack entry could not be created.
    CtCreateFailed = 49,
    /// Not a verdict: a TCP segment without SYN found no conntrack entry at
    /// an endpoint that tracks flows (an evicted entry, or a flow opened
    /// before its pod was isolated): conntrack pressure.
    CtMidstreamMiss = 50,
    /// Not a verdict: a flow was not tracked because its interface holds
    /// its whole share of `CONNTRACK` (see `crate::conntrack_share`).
    CtShareFull = 51,
    /// Not a verdict: a flow record held back by the per-CPU record budget
    /// (see `crate::event::FlowBudget`).
    RecordLimited = 52,
}

/// Reasons at or above this value drop the packet.
pub const FIRST_DROP: u8 = 32;
/// Values at or above this one are events, not verdicts.
pub const FIRST_EVENT: u8 = 48;
/// Number of reason slots (each with two directions).
pub const REASON_SLOTS: u32 = 64;
/// Size of the `COUNTERS` array.
pub const COUNTER_SLOTS: u32 = REASON_SLOTS * 2;

/// Index of the counter for `reason` in `direction`.
#[inline(always)]
pub const fn counter_index(reason: Reason, direction: u8) -> u32 {
    (reason as u32) * 2 + (direction as u32 & 1)
}

impl Reason {
    pub const ALL: [Reason; 28] = [
        Reason::AllowPolicy,
        Reason::AllowEstablished,
        Reason::AllowReply,
        Reason::AllowRelated,
        Reason::AllowNode,
        Reason::AllowNotIsolated,
        Reason::AllowSelf,
        Reason::AllowNonIp,
        Reason::AllowNeighborDiscovery,
        Reason::AllowFragment,
        Reason::AllowAdminTier,
        Reason::AllowBaselineTier,
        Reason::PassNoEndpoint,
        Reason::PassService,
        Reason::DropPolicy,
        Reason::DropPolicyChanged,
        Reason::DropMalformed,
        Reason::DropFragmentUnknown,
        Reason::DropSpoofed,
        Reason::DropUnenforced,
        Reason::DropAdminTier,
        Reason::DropBaselineTier,
        Reason::DropUpdating,
        Reason::EventLost,
        Reason::CtCreateFailed,
        Reason::CtMidstreamMiss,
        Reason::CtShareFull,
        Reason::RecordLimited,
    ];

    /// The reason a tracked flow is cut with when judging it again denied
    /// it (`self`): its peer no longer enforced says so; any other denial
    /// is a policy change.
    #[inline(always)]
    pub const fn when_judged_again(self) -> Self {
        match self {
            Reason::DropUnenforced => Reason::DropUnenforced,
            _ => Reason::DropPolicyChanged,
        }
    }

    /// Whether packets with this reason are dropped.
    #[inline(always)]
    pub const fn is_drop(self) -> bool {
        (self as u8) >= FIRST_DROP && self.is_verdict()
    }

    /// Whether this is a verdict (every packet counts exactly one) rather
    /// than an event counted beside it.
    #[inline(always)]
    pub const fn is_verdict(self) -> bool {
        (self as u8) < FIRST_EVENT
    }

    /// Whether a new flow judged by policy with this reason is admitted
    /// (and may open a conntrack entry).
    #[inline(always)]
    pub const fn admits_new_flow(self) -> bool {
        matches!(
            self,
            Reason::AllowPolicy
                | Reason::AllowNotIsolated
                | Reason::AllowAdminTier
                | Reason::AllowBaselineTier
        )
    }

    /// Decodes a reason byte (from an event or a counter index).
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Reason::AllowPolicy,
            2 => Reason::AllowEstablished,
            3 => Reason::AllowReply,
            4 => Reason::AllowRelated,
            5 => Reason::AllowNode,
            6 => Reason::AllowNotIsolated,
            7 => Reason::AllowSelf,
            8 => Reason::AllowNonIp,
            9 => Reason::AllowNeighborDiscovery,
            10 => Reason::AllowFragment,
            11 => Reason::PassNoEndpoint,
            12 => Reason::PassService,
            13 => Reason::AllowAdminTier,
            14 => Reason::AllowBaselineTier,
            32 => Reason::DropPolicy,
            33 => Reason::DropPolicyChanged,
            34 => Reason::DropMalformed,
            35 => Reason::DropFragmentUnknown,
            36 => Reason::DropSpoofed,
            37 => Reason::DropUnenforced,
            38 => Reason::DropAdminTier,
            39 => Reason::DropBaselineTier,
            40 => Reason::DropUpdating,
            48 => Reason::EventLost,
            49 => Reason::CtCreateFailed,
            50 => Reason::CtMidstreamMiss,
            51 => Reason::CtShareFull,
            52 => Reason::RecordLimited,
            _ => return None,
        })
    }

    /// A stable snake_case name for logs and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::AllowPolicy => "allow_policy",
            Reason::AllowEstablished => "allow_established",
            Reason::AllowReply => "allow_reply",
            Reason::AllowRelated => "allow_related",
            Reason::AllowNode => "allow_node",
            Reason::AllowNotIsolated => "allow_not_isolated",
            Reason::AllowSelf => "allow_self",
            Reason::AllowNonIp => "allow_non_ip",
            Reason::AllowNeighborDiscovery => "allow_neighbor_discovery",
            Reason::AllowFragment => "allow_fragment",
            Reason::PassNoEndpoint => "pass_no_endpoint",
            Reason::PassService => "pass_service",
            Reason::AllowAdminTier => "allow_admin_tier",
            Reason::AllowBaselineTier => "allow_baseline_tier",
            Reason::DropPolicy => "drop_policy",
            Reason::DropPolicyChanged => "drop_policy_changed",
            Reason::DropMalformed => "drop_malformed",
            Reason::DropFragmentUnknown => "drop_fragment_unknown",
            Reason::DropSpoofed => "drop_spoofed",
            Reason::DropUnenforced => "drop_unenforced",
            Reason::DropAdminTier => "drop_admin_tier",
            Reason::DropBaselineTier => "drop_baseline_tier",
            Reason::DropUpdating => "drop_updating",
            Reason::EventLost => "event_lost",
            Reason::CtCreateFailed => "ct_create_failed",
            Reason::CtMidstreamMiss => "ct_midstream_miss",
            Reason::CtShareFull => "ct_share_full",
            Reason::RecordLimited => "record_limited",
        }
    }
}
