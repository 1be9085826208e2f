//! Building [`IdentityName`] values.
use policy_common::identity::{IDENTITY_NAME_LEN, IdentityName};

/// FNV-1a, 64 bit: stable across runs and builds, unlike std's hasher.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The stored form of an identity's canonical name (cut to fit; the hash
/// covers the whole name).
pub fn identity_name(kind: u32, canonical: &str) -> IdentityName {
    let bytes = canonical.as_bytes();
    let mut name = [0u8; IDENTITY_NAME_LEN];
    let n = bytes.len().min(IDENTITY_NAME_LEN);
    name[..n].copy_from_slice(&bytes[..n]);
    IdentityName {
        name_hash: fnv1a64(bytes),
        kind,
        name_len: u32::try_from(bytes.len()).unwrap_or(u32::MAX),
        name,
    }
}

/// The (possibly cut) name as text, marked with "…" when cut.
pub fn identity_name_str(n: &IdentityName) -> String {
    let stored = (n.name_len as usize).min(IDENTITY_NAME_LEN);
    let text = String::from_utf8_lossy(&n.name[..stored]).into_owned();
    if n.name_len as usize > IDENTITY_NAME_LEN {
        format!("{text}…")
    } else {
        text
    }
}
