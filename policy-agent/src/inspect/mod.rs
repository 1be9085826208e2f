//! Reading the pinned datapath back into names: `dump` and `events`.
mod dump;
mod events;
mod names;

pub use self::{
    dump::{Dump, dump},
    events::{DropEventReader, DropRecord},
    names::{Names, direction_label},
};
