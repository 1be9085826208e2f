//! The classifier object, built by `build.rs` (aya-build) and embedded.

/// The eBPF object bytes, 8-byte aligned as the ELF parser wants.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/policy-ebpf"));

/// A short fingerprint of the embedded object: pinned programs built from
/// another object are replaced.
pub fn object_hash() -> u32 {
    // FNV-1a 32: stable across runs, cheap at load time.
    OBJECT.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}
