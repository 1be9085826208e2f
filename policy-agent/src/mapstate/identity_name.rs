//! Building [`IdentityName`] values.
use std::sync::{Arc, LazyLock};

use policy_common::identity::{IDENTITY_NAME_LEN, IdentityName};

use crate::cluster::Interner;

static SHARED_IDENTITY_NAMES: LazyLock<Interner<IdentityName>> = LazyLock::new(Interner::default);

/// The shared value equal to `name`: the compiler's output, the driver's
/// copy of what it wrote and the flow namer's table (read back from the
/// pins) hold one 256-byte value per identity between them.
pub fn shared_identity_name(name: &IdentityName) -> Arc<IdentityName> {
    SHARED_IDENTITY_NAMES.share(name, || Arc::new(*name))
}

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
