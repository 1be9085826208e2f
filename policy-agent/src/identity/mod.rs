//! Identities: the numbers the datapath keys policy by.
//!
//! - label identities: one per distinct [`LabelKey`] (namespace name,
//!   namespace labels, pod labels, named container ports);
//! - address-class identities: one per prefix carved by some ipBlock
//!   `cidr` or `except` (canonical name: the normalized prefix).
//!
//! [`IdentityAllocator`] keeps the numbers stable across compiles and
//! restarts; see its module for the reuse rule.
mod allocator;
mod key;

pub use self::{
    allocator::{IdentityAllocator, IdentityError},
    key::{LabelKey, NAMESPACE_NAME_LABEL, NamedPort, default_namespace_labels, protocol_name},
};
