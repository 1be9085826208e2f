//! Where everything is pinned.
//!
//! `<root>/v<LAYOUT_VERSION>/maps/<MAP>`, `.../progs/<program>`,
//! `.../links/<ifindex>-<ingress|egress|uplink|uplink-ingress>` (TCX links). The version in the
//! path keeps an agent from ever opening a map of another layout.
use std::path::{Path, PathBuf};

use policy_common::LAYOUT_VERSION;

use super::error::Error;

/// Default pin root.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/policy-agent";

/// Where a program is attached: host-veth ingress or egress of a pod, or
/// the egress of any other interface of the node (an uplink).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// Host-veth ingress: packets the pod sends.
    Ingress,
    /// Host-veth egress: packets delivered to the pod.
    Egress,
    /// Egress of an interface that is not a local endpoint's: a pod's
    /// packet to a Service, judged after DNAT when its backend is reached
    /// through here (see `policy_common::service`).
    Uplink,
    /// Ingress of such an interface (with `--pod-cidr`): nothing enters
    /// the node for a local address not enforced yet (see
    /// `policy_common::pod_range_guard`).
    UplinkIngress,
    /// [`Hook::Uplink`] on a device without a link-layer header (its
    /// packets start with the IP header).
    UplinkL3,
    /// [`Hook::UplinkIngress`] on such a device.
    UplinkIngressL3,
}

impl Hook {
    /// The two hooks of a pod's interface.
    pub const BOTH: [Hook; 2] = [Hook::Ingress, Hook::Egress];
    /// Every hook (what `reset` undoes).
    pub const ALL: [Hook; 6] = [
        Hook::Ingress,
        Hook::Egress,
        Hook::Uplink,
        Hook::UplinkIngress,
        Hook::UplinkL3,
        Hook::UplinkIngressL3,
    ];
    /// The hooks whose programs are loaded at start; those of a device
    /// without a link-layer header only once the node has one.
    pub const CORE: [Hook; 4] = [
        Hook::Ingress,
        Hook::Egress,
        Hook::Uplink,
        Hook::UplinkIngress,
    ];

    /// The uplink hooks (egress, ingress) for a device of `framing`; None:
    /// no program here can read its packets.
    pub fn uplinks(framing: crate::netlink::Framing) -> Option<[Hook; 2]> {
        match framing {
            crate::netlink::Framing::Ethernet => Some([Hook::Uplink, Hook::UplinkIngress]),
            crate::netlink::Framing::Ip => Some([Hook::UplinkL3, Hook::UplinkIngressL3]),
            crate::netlink::Framing::Loopback | crate::netlink::Framing::Other(_) => None,
        }
    }

    /// Whether the hook is at the interface's ingress.
    pub fn at_ingress(self) -> bool {
        matches!(
            self,
            Hook::Ingress | Hook::UplinkIngress | Hook::UplinkIngressL3
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Hook::Ingress => "ingress",
            Hook::Egress => "egress",
            Hook::Uplink => "uplink",
            Hook::UplinkIngress => "uplink-ingress",
            Hook::UplinkL3 => "uplink-l3",
            Hook::UplinkIngressL3 => "uplink-ingress-l3",
        }
    }

    /// The program attached at this hook.
    pub fn program(self) -> &'static str {
        use policy_common::maps::programs;
        match self {
            Hook::Ingress => programs::FROM_POD,
            Hook::Egress => programs::TO_POD,
            Hook::Uplink => programs::TO_UPLINK,
            Hook::UplinkIngress => programs::FROM_UPLINK,
            Hook::UplinkL3 => programs::TO_UPLINK_L3,
            Hook::UplinkIngressL3 => programs::FROM_UPLINK_L3,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    /// The layout under `root` (the versioned subdirectory is added).
    pub fn new(root: impl AsRef<Path>) -> Self {
        Self {
            root: root.as_ref().to_path_buf(),
        }
    }

    /// The unversioned root given by the user.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/v<LAYOUT_VERSION>`.
    pub fn versioned(&self) -> PathBuf {
        self.root.join(format!("v{LAYOUT_VERSION}"))
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.versioned().join("maps")
    }

    pub fn progs_dir(&self) -> PathBuf {
        self.versioned().join("progs")
    }

    pub fn links_dir(&self) -> PathBuf {
        self.versioned().join("links")
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    pub fn program(&self, name: &str) -> PathBuf {
        self.progs_dir().join(name)
    }

    pub fn link(&self, ifindex: u32, hook: Hook) -> PathBuf {
        self.links_dir().join(format!("{ifindex}-{}", hook.name()))
    }

    /// Whether anything is pinned here.
    pub fn exists(&self) -> bool {
        self.versioned().exists()
    }

    /// Creates the unversioned root alone (on a bpf filesystem, mounted at
    /// the standard place if it is not yet).
    pub fn create_root(&self) -> Result<(), Error> {
        if check_bpffs(&self.root).is_err() && self.root.starts_with(BPFFS) {
            mount_bpffs()?;
        }
        check_bpffs(&self.root)?;
        std::fs::create_dir_all(&self.root).map_err(|source| Error::PinDir {
            path: self.root.clone(),
            source,
        })
    }

    /// Creates the directories (the root must be on a bpf filesystem; the
    /// standard /sys/fs/bpf is mounted if it is not yet, as Cilium does).
    pub fn create(&self) -> Result<(), Error> {
        self.create_root()?;
        for dir in [self.maps_dir(), self.progs_dir(), self.links_dir()] {
            std::fs::create_dir_all(&dir).map_err(|source| Error::PinDir {
                path: dir.clone(),
                source,
            })?;
        }
        Ok(())
    }
}

const BPFFS: &str = "/sys/fs/bpf";

fn mount_bpffs() -> Result<(), Error> {
    let target = std::ffi::CString::new(BPFFS).map_err(|_| Error::NoBpffs(BPFFS.into()))?;
    let fstype = std::ffi::CString::new("bpf").map_err(|_| Error::NoBpffs(BPFFS.into()))?;
    // SAFETY: all pointers are valid NUL-terminated strings; data may be null.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(Error::PinDir {
            path: BPFFS.into(),
            source: std::io::Error::last_os_error(),
        });
    }
    tracing::info!("mounted the bpf filesystem at {BPFFS}");
    Ok(())
}

/// Refuses a root that is not on bpffs: pins elsewhere fail obscurely.
fn check_bpffs(root: &Path) -> Result<(), Error> {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    // The root may not exist yet: check its closest existing ancestor.
    let mut probe = root.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            return Err(Error::NoBpffs(root.to_path_buf()));
        }
    }
    let c = std::ffi::CString::new(probe.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::NoBpffs(root.to_path_buf()))?;
    // SAFETY: statfs writes into the zeroed struct we pass; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc != 0 || st.f_type as i64 != BPF_FS_MAGIC {
        return Err(Error::NoBpffs(root.to_path_buf()));
    }
    Ok(())
}

/// Removes one pin; a pin already gone is fine.
pub(crate) fn remove_pin(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(Error::Io {
            what: "removing pin",
            path: path.to_path_buf(),
            source,
        }),
    }
}
