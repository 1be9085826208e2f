//! The maps, as BTF map definitions so `bpftool map dump` prints fields.
//! Sizes are defaults; the agent may override them at load time.
use crate::{classify::ClockCache, parse::IpPacket};
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
    macros::btf_map,
};
use policy_common::{
    config::Config,
    conntrack::{CtEntry, CtKey, FragEntry, FragKey},
    conntrack_share::{CtShare, CtUsageKey},
    endpoint::{EndpointInfo, EndpointMeta},
    event::{FlowBudget, FlowRecord},
    identity::IdentityName,
    ipcache::{IpcacheEntry, Ipv4Bytes, Ipv6Bytes},
    maps::capacity,
    pod_range_guard::LocalAddr,
    policy::{PolicyEntry, PolicyKey, Tiers},
    rule_name::{RuleKey, RuleName},
    service::{ServiceAddr, ServiceEntry, ServiceFlow, ServiceFlowKey},
    verdict::COUNTER_SLOTS,
};

const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

#[btf_map]
pub static CONFIG: Array<Config, 1> = Array::new();

/// Per-CPU scratch space for the packet and the keys built from it: the
/// BPF stack (512 bytes for the whole call chain) is too small for them.
#[repr(C)]
pub struct Scratch {
    pub pkt: IpPacket,
    pub ct: CtKey,
    pub frag: FragKey,
    pub flow: ServiceFlowKey,
    /// What the policy entries of a new flow say, tier by tier (kept here,
    /// not on the stack: in map memory the verifier does not follow each
    /// probe's outcome into the next, so the states of the probe loop
    /// prune).
    pub tiers: Tiers,
    /// The peer `judge_flow` judged a flow by (a global function returns
    /// one scalar: its reason).
    pub judged_peer: IpcacheEntry,
    /// A peer address `judge_flow` reads from here (see `Peer`).
    pub judged_addr: [u8; 16],
    /// This CPU's last reading of the clock.
    pub clock: ClockCache,
}

#[btf_map]
pub static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

#[btf_map]
pub static ENDPOINT_SLOTS: Array<EndpointInfo, { capacity::ENDPOINT_SLOTS as usize }> =
    Array::new();

#[btf_map]
pub static ENDPOINTS: HashMap<u32, EndpointInfo, { capacity::ENDPOINTS as usize }> = HashMap::new();

// Not preallocated: sized for the cluster, filled as pods come.
#[btf_map]
pub static IPCACHE_HOSTS_V4: HashMap<
    Ipv4Bytes,
    IpcacheEntry,
    { capacity::IPCACHE as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static IPCACHE_HOSTS_V6: HashMap<
    Ipv6Bytes,
    IpcacheEntry,
    { capacity::IPCACHE as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static IPCACHE_V4: LpmTrie<Ipv4Bytes, IpcacheEntry, { capacity::IPCACHE as usize }> =
    LpmTrie::new();

#[btf_map]
pub static IPCACHE_V6: LpmTrie<Ipv6Bytes, IpcacheEntry, { capacity::IPCACHE as usize }> =
    LpmTrie::new();

// Not preallocated: the map is sized for large clusters but usually sparse.
#[btf_map]
pub static POLICY: HashMap<PolicyKey, PolicyEntry, { capacity::POLICY as usize }, NO_PREALLOC> =
    HashMap::new();

#[btf_map]
pub static CONNTRACK: LruHashMap<CtKey, CtEntry, { capacity::CONNTRACK as usize }> =
    LruHashMap::new();

/// Each interface's share of `CONNTRACK`: see
/// `policy_common::conntrack_share`.
#[btf_map]
pub static CT_SHARE: Array<CtShare, 1> = Array::new();

#[btf_map]
pub static CT_USAGE: HashMap<CtUsageKey, u64, { capacity::CT_USAGE as usize }> = HashMap::new();

#[btf_map]
pub static SERVICES: LpmTrie<ServiceAddr, ServiceEntry, { capacity::SERVICES as usize }> =
    LpmTrie::new();

#[btf_map]
pub static SERVICE_FLOWS: LruHashMap<
    ServiceFlowKey,
    ServiceFlow,
    { capacity::SERVICE_FLOWS as usize },
> = LruHashMap::new();

/// The node's pod ranges (`--pod-cidr`) and its enforced local addresses:
/// see `crate::pod_range_guard`.
#[btf_map]
pub static POD_RANGES: LpmTrie<LocalAddr, u32, { capacity::POD_RANGES as usize }> = LpmTrie::new();

#[btf_map]
pub static ENFORCED: HashMap<LocalAddr, u32, { capacity::ENFORCED as usize }, NO_PREALLOC> =
    HashMap::new();

#[btf_map]
pub static FRAGMENTS: LruHashMap<FragKey, FragEntry, { capacity::FRAGMENTS as usize }> =
    LruHashMap::new();

#[btf_map]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_SLOTS as usize }> = PerCpuArray::new();

#[btf_map]
pub static DROP_EVENTS: RingBuf<FlowRecord, { capacity::DROP_EVENTS_BYTES as usize }> =
    RingBuf::new();

/// The flow-record rate limit, a token bucket per CPU (see `FlowBudget`).
#[btf_map]
pub static FLOW_BUDGET: PerCpuArray<FlowBudget, 1> = PerCpuArray::new();

// Userspace-only metadata, pinned with the rest so `dump` can name things
// and a restarted agent can adopt identity numbers.
#[btf_map]
pub static IDENTITY_NAMES: HashMap<
    u32,
    IdentityName,
    { capacity::IDENTITIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static ENDPOINT_META: HashMap<
    u32,
    EndpointMeta,
    { capacity::ENDPOINTS as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static RULE_NAMES: HashMap<RuleKey, RuleName, { capacity::RULE_NAMES as usize }, NO_PREALLOC> =
    HashMap::new();
