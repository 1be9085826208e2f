//! Map names (as the ELF and the pin directory name them) and default sizes.
//!
//! The names are the contract between the kernel object, the agent's pins
//! and `bpftool map dump pinned <pin dir>/maps/<NAME>`.

/// ifindex → [`crate::endpoint::EndpointInfo`] (array indexed by ifindex,
/// for every ifindex below its size). The classifier's endpoint lookup
/// then costs no hashing: the verifier inlines array lookups. A slot
/// holds an endpoint only if its flags carry
/// [`crate::endpoint::ENDPOINT_SLOT_USED`].
pub const ENDPOINT_SLOTS: &str = "ENDPOINT_SLOTS";
/// ifindex → [`crate::endpoint::EndpointInfo`] (hash) for ifindexes beyond
/// [`ENDPOINT_SLOTS`] (a node that has created many interfaces since boot).
pub const ENDPOINTS: &str = "ENDPOINTS";
/// IPv4 prefix → [`crate::ipcache::IpcacheEntry`] (LPM trie).
pub const IPCACHE_V4: &str = "IPCACHE_V4";
/// IPv6 prefix → [`crate::ipcache::IpcacheEntry`] (LPM trie).
pub const IPCACHE_V6: &str = "IPCACHE_V6";
/// IPv4 address → [`crate::ipcache::IpcacheEntry`] (hash): the ipcache's
/// full-length prefixes (every pod's address), looked up before the trie
/// at the cost of one hash probe. An address has at most one entry, here
/// or in the trie, and one here is its longest prefix.
pub const IPCACHE_HOSTS_V4: &str = "IPCACHE_HOSTS_V4";
/// IPv6 address → [`crate::ipcache::IpcacheEntry`] (hash), as
/// [`IPCACHE_HOSTS_V4`].
pub const IPCACHE_HOSTS_V6: &str = "IPCACHE_HOSTS_V6";
/// [`crate::policy::PolicyKey`] → [`crate::policy::PolicyEntry`] (hash).
pub const POLICY: &str = "POLICY";
/// [`crate::conntrack::CtKey`] → [`crate::conntrack::CtEntry`] (LRU hash).
pub const CONNTRACK: &str = "CONNTRACK";
/// [`crate::conntrack::FragKey`] → [`crate::conntrack::FragEntry`] (LRU hash).
pub const FRAGMENTS: &str = "FRAGMENTS";
/// [`crate::conntrack_share::CtUsageKey`] → u64 (hash): what each
/// interface opened in `CONNTRACK`, and what of it the agent found gone.
pub const CT_USAGE: &str = "CT_USAGE";
/// Single-slot array holding [`crate::conntrack_share::CtShare`]: the
/// bound on one interface's entries, and when the agent last counted.
pub const CT_SHARE: &str = "CT_SHARE";
/// [`crate::service::ServiceAddr`] prefix → [`crate::service::ServiceEntry`]:
/// the Service frontend addresses and ranges (LPM trie, both families).
pub const SERVICES: &str = "SERVICES";
/// [`crate::service::ServiceFlowKey`] → [`crate::service::ServiceFlow`]
/// (LRU hash): clients' flows to frontends and the backends they reached.
pub const SERVICE_FLOWS: &str = "SERVICE_FLOWS";
/// [`crate::pod_range_guard::LocalAddr`] prefix → [`crate::pod_range_guard::POD_RANGE`]:
/// the ranges the node hands to its own pods (`--pod-cidr`; LPM trie,
/// both families).
pub const POD_RANGES: &str = "POD_RANGES";
/// [`crate::pod_range_guard::LocalAddr`] → ifindex (hash): the local addresses
/// that are enforced (a pod's once both classifiers are attached; node
/// addresses inside the ranges with [`crate::pod_range_guard::ENFORCED_NODE`]).
pub const ENFORCED: &str = "ENFORCED";
/// Verdict counters, per CPU, indexed by [`crate::verdict::counter_index`].
pub const COUNTERS: &str = "COUNTERS";
/// Ring buffer of [`crate::event::FlowRecord`]: new flows judged by
/// policy and dropped packets (the name is older than the records).
pub const DROP_EVENTS: &str = "DROP_EVENTS";
/// Per-CPU single-slot array of [`crate::event::FlowBudget`]: the flow
/// record rate limit. Pins of an older agent may lack it.
pub const FLOW_BUDGET: &str = "FLOW_BUDGET";
/// Single-slot array holding [`crate::config::Config`].
pub const CONFIG: &str = "CONFIG";
/// identity → [`crate::identity::IdentityName`]; written and read by
/// userspace only (dump, explain, identity adoption on restart).
pub const IDENTITY_NAMES: &str = "IDENTITY_NAMES";
/// ifindex → [`crate::endpoint::EndpointMeta`]; userspace only.
pub const ENDPOINT_META: &str = "ENDPOINT_META";
/// [`crate::rule_name::RuleKey`] → [`crate::rule_name::RuleName`]: the
/// rules `POLICY` entries reference; userspace only (dump). Pins of an
/// older agent may lack it: the loader creates it, `dump` does without.
pub const RULE_NAMES: &str = "RULE_NAMES";

/// Every map the agent pins, in the order `dump` prints them.
pub const ALL: [&str; 22] = [
    CONFIG,
    ENDPOINT_SLOTS,
    ENDPOINTS,
    ENDPOINT_META,
    IPCACHE_HOSTS_V4,
    IPCACHE_HOSTS_V6,
    IPCACHE_V4,
    IPCACHE_V6,
    IDENTITY_NAMES,
    POLICY,
    RULE_NAMES,
    SERVICES,
    CONNTRACK,
    CT_SHARE,
    CT_USAGE,
    SERVICE_FLOWS,
    POD_RANGES,
    ENFORCED,
    FRAGMENTS,
    COUNTERS,
    DROP_EVENTS,
    FLOW_BUDGET,
];

/// Default capacities. The agent can override them at load time.
pub mod capacity {
    /// ifindexes `0..ENDPOINT_SLOTS` live in the array (24 B each).
    pub const ENDPOINT_SLOTS: u32 = 16384;
    pub const ENDPOINTS: u32 = 4096;
    pub const IPCACHE: u32 = 65536;
    pub const POLICY: u32 = 262_144;
    pub const CONNTRACK: u32 = 131_072;
    pub const FRAGMENTS: u32 = 8192;
    /// Two counters per interface that opened a flow since the last count.
    pub const CT_USAGE: u32 = 8192;
    pub const IDENTITIES: u32 = 65536;
    /// One per rule some policy entry references.
    pub const RULE_NAMES: u32 = 65536;
    pub const SERVICES: u32 = 65536;
    pub const SERVICE_FLOWS: u32 = 65536;
    /// `--pod-cidr` ranges (a node has one or two).
    pub const POD_RANGES: u32 = 64;
    /// Local addresses: two per endpoint slot, and node addresses.
    pub const ENFORCED: u32 = 32768;
    /// Bytes of the flow-record ring buffer (a power of two, page
    /// multiple): about 2,500 records of 104 bytes.
    pub const DROP_EVENTS_BYTES: u32 = 1 << 18;
}

/// Program names in the object (and under `<pin dir>/progs/`).
pub mod programs {
    /// Attached at host-veth ingress: judges what the pod sends (egress).
    pub const FROM_POD: &str = "from_pod";
    /// Attached at host-veth egress: judges what reaches the pod (ingress).
    pub const TO_POD: &str = "to_pod";
    /// Attached at the egress of the node's uplinks: judges a pod's egress
    /// to a Service whose backend is on another node, after DNAT.
    pub const TO_UPLINK: &str = "to_uplink";
    /// Attached at the ingress of the node's uplinks (with `--pod-cidr`):
    /// drops traffic to a local address that is not enforced yet.
    pub const FROM_UPLINK: &str = "from_uplink";
    /// [`TO_UPLINK`] for a device without a link-layer header (IP-in-IP,
    /// GRE, sit, WireGuard, tun: the packet starts with its IP header).
    pub const TO_UPLINK_L3: &str = "to_uplink_l3";
    /// [`FROM_UPLINK`] for such a device.
    pub const FROM_UPLINK_L3: &str = "from_uplink_l3";
}
