//! Reading the pinned datapath back into names: `dump` and `events`.
mod dump;
mod events;
mod kernel_log;
mod names;

pub use self::{
    dump::{Dump, dump},
    events::{DropEventReader, DropRecord},
    kernel_log::{KernelLog, follow_kernel_log},
    names::Names,
};
