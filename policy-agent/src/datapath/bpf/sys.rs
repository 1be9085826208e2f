//! The few bpf(2) commands aya 0.14 does not wrap, issued directly.
use std::{
    ffi::CString,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
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
