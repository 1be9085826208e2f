//! The few bpf(2) commands aya 0.14 does not wrap, issued directly.
use std::{
    ffi::CString,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
    path::Path,
};

use aya::programs::TcAttachType;

use super::pins::Hook;

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_DETACH: libc::c_long = 34;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// One bpf(2) call; `attr` is the zero-padded `union bpf_attr`.
fn bpf(cmd: libc::c_long, attr: &mut [u64; 8]) -> std::io::Result<libc::c_long> {
    // SAFETY: attr is a valid, zeroed union bpf_attr of the size passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr) as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A bpf(2) call that returns a new fd.
fn bpf_fd(cmd: libc::c_long, attr: &mut [u64; 8]) -> std::io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    // SAFETY: the kernel just returned this fd to us; we own it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)
}

/// BPF_LINK_DETACH (Linux 5.9): detaches the link pinned at `pin` at once,
/// whoever else still holds it.
pub(crate) fn link_detach(pin: &Path) -> std::io::Result<()> {
    let path = c_path(pin)?;
    // BPF_OBJ_GET: { __u64 pathname; __u32 bpf_fd; __u32 file_flags; }
    let mut attr = [0u64; 8];
    attr[0] = path.as_ptr() as u64;
    let fd = bpf_fd(BPF_OBJ_GET, &mut attr)?;
    // BPF_LINK_DETACH: { __u32 link_fd; }
    let mut attr = [0u64; 8];
    attr[0] = u64::from(fd.as_raw_fd() as u32);
    bpf(BPF_LINK_DETACH, &mut attr).map(|_| ())
}

/// Raw TCX attach (BPF_LINK_CREATE) and pin (BPF_OBJ_PIN), usable from
/// several threads at once: each TCX attach waits for an RCU grace period
/// in the kernel, so attaching many interfaces one by one is slow.
pub(crate) fn tcx_attach_and_pin(
    prog_fd: RawFd,
    ifindex: u32,
    hook: Hook,
    pin: &Path,
) -> std::io::Result<()> {
    let attach_type = match hook {
        h if h.at_ingress() => BPF_TCX_INGRESS,
        _ => BPF_TCX_EGRESS,
    };
    // BPF_LINK_CREATE: { u32 prog_fd; u32 target_ifindex; u32 attach_type;
    // u32 flags; tcx { u32 relative_fd; u64 expected_revision } }.
    // BPF_F_BEFORE without a relative program: first in the chain, so a
    // program attached earlier cannot pass packets before ours judges them.
    const BPF_F_BEFORE: u64 = 1 << 3;
    let mut attr = [0u64; 8];
    attr[0] = u64::from(prog_fd as u32) | (u64::from(ifindex) << 32);
    attr[1] = u64::from(attach_type) | (BPF_F_BEFORE << 32);
    let link = bpf_fd(BPF_LINK_CREATE, &mut attr)?;
    let path = c_path(pin)?;
    // BPF_OBJ_PIN: { u64 pathname; u32 bpf_fd; u32 file_flags }
    let mut attr = [0u64; 8];
    attr[0] = path.as_ptr() as u64;
    attr[1] = u64::from(link.as_raw_fd() as u32);
    bpf(BPF_OBJ_PIN, &mut attr).map(|_| ())
}

/// The tc attach point of a hook.
pub(crate) fn tc_type(hook: Hook) -> TcAttachType {
    match hook {
        h if h.at_ingress() => TcAttachType::Ingress,
        _ => TcAttachType::Egress,
    }
}

/// Inode of the calling thread's network namespace (0 if unknown).
pub fn current_netns() -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino())
        .unwrap_or(0)
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// The kernel's own "not supported" (not in libc: it never reaches a
/// process from most calls, but bpf(2) returns it).
const ENOTSUPP: i32 = 524;
/// Entries asked for per call: a few dozen calls read a full map.
const BATCH_ENTRIES: usize = 1024;

/// Every entry of the hash map behind `fd`, by BPF_MAP_LOOKUP_BATCH
/// (Linux 5.6): one call per thousand entries where iterating takes two
/// per entry (a restart at 10,000 pods reads some 25,000 entries twice).
/// `None` when this kernel or map type has no batch lookup (the caller
/// iterates). The agent is the maps' only writer, so nothing moves while
/// they are read.
pub(crate) fn lookup_batch<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
) -> std::io::Result<Option<Vec<(K, V)>>> {
    let (ksz, vsz) = (std::mem::size_of::<K>(), std::mem::size_of::<V>());
    let mut room = BATCH_ENTRIES;
    let mut keys = vec![0u8; room * ksz];
    let mut values = vec![0u8; room * vsz];
    // The position between calls: a bucket index for a hash map, a key
    // for the generic batch; room for either.
    let token = ksz.max(8);
    let (mut from, mut next) = (vec![0u8; token], vec![0u8; token]);
    let mut out = Vec::new();
    let mut first = true;
    loop {
        // BPF_MAP_*_BATCH: { u64 in_batch; u64 out_batch; u64 keys;
        // u64 values; u32 count; u32 map_fd; u64 elem_flags; u64 flags; }
        let mut attr = [0u64; 8];
        attr[0] = if first { 0 } else { from.as_ptr() as u64 };
        attr[1] = next.as_mut_ptr() as u64;
        attr[2] = keys.as_mut_ptr() as u64;
        attr[3] = values.as_mut_ptr() as u64;
        attr[4] = room as u64 | (u64::from(fd.as_raw_fd() as u32) << 32);
        let done = match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
            Ok(_) => false,
            Err(e) => match e.raw_os_error() {
                // The end: `count` says how many this last call read.
                Some(libc::ENOENT) => true,
                // One bucket holds more than `room`: ask again with more.
                Some(libc::ENOSPC) if room < (1 << 20) => {
                    room *= 4;
                    keys.resize(room * ksz, 0);
                    values.resize(room * vsz, 0);
                    continue;
                }
                Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP) if first => return Ok(None),
                _ => return Err(e),
            },
        };
        let read = (attr[4] & 0xffff_ffff) as usize;
        for i in 0..read.min(room) {
            // SAFETY: each slot holds `size_of::<K>()` (`V`) bytes the
            // kernel wrote, and both are Pod: any bytes are a value.
            let (k, v) = unsafe {
                (
                    std::ptr::read_unaligned(keys.as_ptr().add(i * ksz).cast::<K>()),
                    std::ptr::read_unaligned(values.as_ptr().add(i * vsz).cast::<V>()),
                )
            };
            out.push((k, v));
        }
        if done {
            return Ok(Some(out));
        }
        std::mem::swap(&mut from, &mut next);
        first = false;
    }
}
