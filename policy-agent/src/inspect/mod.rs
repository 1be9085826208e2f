//! Reading the pinned datapath back into names: `dump`.
mod dump;

pub use self::dump::{Dump, dump};
