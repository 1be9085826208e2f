//! Reading a whole hash map back: in batches where the kernel can
//! (BPF_MAP_LOOKUP_BATCH), entry by entry where it cannot.
use std::os::fd::AsFd as _;

use aya::{
    Pod,
    maps::{HashMap, IterableMap as _, MapData, MapError},
    sys::SyscallError,
};

use super::error::Error;

/// Every entry of `map` (called `name` in errors), collected into what
/// the caller keeps.
pub(super) fn hash_entries<K: Pod, V: Pod, C: FromIterator<(K, V)>>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<C, Error> {
    match super::sys::lookup_batch::<K, V>(map.map().fd().as_fd()) {
        Ok(Some(entries)) => Ok(entries.into_iter().collect()),
        Ok(None) => map.iter().map(|r| r.map_err(Error::map(name))).collect(),
        Err(io_error) => Err(Error::map(name)(MapError::SyscallError(SyscallError {
            call: "bpf_map_lookup_batch",
            io_error,
        }))),
    }
}
