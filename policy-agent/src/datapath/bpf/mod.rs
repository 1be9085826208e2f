//! The eBPF datapath: the classifier object, its pinned maps and programs,
//! and attachments to pod interfaces.
mod attach;
mod error;
mod loader;
mod maps;
mod object;
pub mod packet;
mod pins;
mod reset;
mod sys;

pub use self::{
    attach::{AttachMode, Attachment, NETLINK_HANDLE, NETLINK_PRIORITY, if_name},
    error::Error,
    loader::{BpfDatapath, Classifiers, LoadOptions, Unpinned, endpoint_meta, endpoint_meta_name},
    maps::BpfMaps,
    object::{OBJECT, object_hash},
    pins::{DEFAULT_PIN_ROOT, Hook, PinLayout},
    reset::{ResetReport, reset},
};
