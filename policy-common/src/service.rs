//! Service frontends, and how a pod's egress to one is judged after the
//! node's Service implementation (kube-proxy) rewrote it to a backend.
//!
//! The classifier on the client's veth cannot see the backend: DNAT runs
//! later, in netfilter, and picks it at random. So a packet of an isolated
//! pod to a frontend address (`SERVICES`) is marked (`skb->mark`: [`mark`]) with
//! the client's interface and passed; the first tc hook after DNAT (the
//! backend's veth, or the node's uplink for a remote backend) judges the
//! client's egress against the backend it landed on. The client's own
//! conntrack entry (the pre-DNAT tuple) waits for that verdict, found
//! through `SERVICE_FLOWS` by the client's source; it remembers the
//! backend so the flow can be judged again where it started.
use crate::assert_size;

/// Data of a `SERVICES` LPM key: the family byte and three zero bytes
/// (the value's alignment), then the address (IPv4 in the first 4 bytes).
/// One trie holds both families: the prefix length counts those 4 bytes
/// ([`service_prefix_len`]).
pub type ServiceAddr = [u8; 20];

/// The `SERVICES` key data of an address.
#[inline(always)]
pub const fn service_addr(family: u8, addr: &[u8; 16]) -> ServiceAddr {
    let mut out = [0u8; 20];
    out[0] = family;
    let mut i = 0;
    while i < 16 {
        out[i + 4] = addr[i];
        i += 1;
    }
    out
}

/// The `SERVICES` prefix length of an address prefix of `bits` bits.
#[inline(always)]
pub const fn service_prefix_len(bits: u8) -> u32 {
    32 + bits as u32
}

/// [`ServiceEntry::flags`]: one of this node's addresses (kube-proxy
/// rewrites its nodePorts).
pub const SERVICE_NODE_ADDRESS: u32 = 1 << 0;
/// [`ServiceEntry::flags`]: a configured Service range (`--service-cidr`):
/// every address in it is a frontend, known to the agent or not yet.
pub const SERVICE_RANGE: u32 = 1 << 1;

/// Value of `SERVICES`: why the prefix is a frontend (for `dump`).
///
/// Frontends are addresses, not address and port: a packet deferred to a
/// port kube-proxy does not rewrite leaves unchanged and is judged by the
/// same address at the next hook. A backend on this node's host network
/// needs nothing: DNAT delivers it locally (no tc hook sees it after
/// DNAT), and traffic between a pod and its node is always allowed.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceEntry {
    pub flags: u32,
    pub _reserved: u32,
}
assert_size!(ServiceEntry, 8);

/// Key of `SERVICE_FLOWS`: a client's flow to a frontend, by what survives
/// DNAT (its interface and source; masquerade would change the source, and
/// then the flow is judged after DNAT at every packet instead).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceFlowKey {
    pub ifindex: u32,
    pub src: [u8; 16],
    pub sport: u16,
    pub protocol: u8,
    pub family: u8,
}
assert_size!(ServiceFlowKey, 24);

/// [`ServiceFlow::flags`]: the backend is known (judged after DNAT).
pub const SERVICE_FLOW_RESOLVED: u32 = 1 << 0;

/// Value of `SERVICE_FLOWS`: the frontend the flow was sent to and the
/// backend it landed on.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceFlow {
    pub frontend: [u8; 16],
    pub backend: [u8; 16],
    pub frontend_port: u16,
    pub backend_port: u16,
    pub flags: u32,
}
assert_size!(ServiceFlow, 40);

/// `skb->mark` bits carrying "the egress of the pod behind this interface
/// is still to be judged" from the client's veth, through netfilter, to the
/// first hook after DNAT. kube-proxy uses 0x4000 (and once 0x8000);
/// these bits stay clear of them (see docs/ARCHITECTURE.md for other CNIs).
pub mod mark {
    /// The packet's egress is still to be judged.
    pub const PENDING: u32 = 1 << 30;
    /// Bits 16..=29 hold the client's ifindex (below 16384: the slot
    /// array's range; a client beyond it cannot defer).
    pub const IFINDEX_SHIFT: u32 = 16;
    pub const IFINDEX_MASK: u32 = 0x3fff;
    /// Every bit the classifier owns.
    pub const MASK: u32 = PENDING | (IFINDEX_MASK << IFINDEX_SHIFT);

    /// The mark for a client at `ifindex`, if it can carry it.
    #[inline(always)]
    pub const fn pending(ifindex: u32) -> Option<u32> {
        if ifindex > IFINDEX_MASK {
            None
        } else {
            Some(PENDING | (ifindex << IFINDEX_SHIFT))
        }
    }

    /// The client interface a marked packet waits on.
    #[inline(always)]
    pub const fn client(mark: u32) -> Option<u32> {
        if mark & PENDING == 0 {
            None
        } else {
            Some((mark >> IFINDEX_SHIFT) & IFINDEX_MASK)
        }
    }
}

#[cfg(feature = "user")]
crate::user_pod!(ServiceEntry, ServiceFlowKey, ServiceFlow);
