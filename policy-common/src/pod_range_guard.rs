//! The pod-range guard for pods the agent does not enforce yet.
//!
//! The node's main CNI plugin creates and routes a new pod's veth before
//! the agent attaches to it (the chained plugin tells it afterwards; the
//! API server later still). In that window the pod's veth carries no
//! program, so its traffic would pass unjudged. With `--pod-cidr` the
//! agent writes the ranges its node hands to local pods (`POD_RANGES`) and
//! every local address that is enforced (`ENFORCED`): a pod's address
//! only once both its classifiers are attached, the node's own addresses
//! inside the ranges always. An address inside the ranges that is not
//! enforced is nobody the classifier may let traffic reach or come from:
//! the hooks around it (the peer pod's veth, the uplinks) drop it
//! ([`crate::verdict::Reason::DropUnenforced`]).
//!
//! Both maps share the `SERVICES` key shape ([`crate::service::service_addr`]):
//! the family byte, three zero bytes, the address.
pub use crate::service::{ServiceAddr as LocalAddr, service_addr as local_addr};

/// The `POD_RANGES` prefix length of an address prefix of `bits` bits.
#[inline(always)]
pub const fn range_prefix_len(bits: u8) -> u32 {
    crate::service::service_prefix_len(bits)
}

/// Value of `POD_RANGES`: reserved (the prefix is the information).
pub const POD_RANGE: u32 = 1;

/// `ENFORCED` value of a node address inside the ranges (no interface:
/// traffic between a pod and its node is always allowed).
pub const ENFORCED_NODE: u32 = 0;
