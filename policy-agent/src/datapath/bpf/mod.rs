//! The eBPF datapath: the classifier object, its pinned maps and programs,
//! and attachments to pod interfaces.
mod attach;
mod catchall;
mod driver;
mod error;
mod events;
pub mod fit;
mod kernel_log;
mod loader;
mod maps;
pub mod names;
mod object;
mod observe;
mod order;
mod pins;
pub mod probe;
mod reset;
pub mod sizing;
mod standing;
mod sys;
mod uplinks;
mod verifier;

pub use self::{
    attach::{Ahead, AttachMode, Attachment, NETLINK_HANDLE, NETLINK_PRIORITY, if_name},
    driver::BpfDriver,
    error::Error,
    events::{DropEventReader, DropRecord},
    kernel_log::{KernelLog, follow_kernel_log},
    loader::{
        BpfDatapath, Classifiers, LoadOptions, OrderCheck, Unpinned, endpoint_meta,
        endpoint_meta_name,
    },
    maps::BpfMaps,
    object::{OBJECT, object_hash},
    pins::{DEFAULT_PIN_ROOT, Hook, PinLayout},
    reset::{ResetReport, reset},
    sys::current_netns,
};
