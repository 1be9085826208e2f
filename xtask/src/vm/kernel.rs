//! The guest's kernel: what `scripts/setup.sh` unpacked into the cache.
use std::{fs, path::PathBuf};

use anyhow::{Context as _, bail};

/// Where `scripts/setup.sh` unpacks the kernel (`current` → `<release>/`).
const DEFAULT_CACHE: &str = "/var/cache/policy-agent/vm";

/// The unpacked kernel: `<dir>/boot/vmlinuz-<release>` and
/// `<dir>/lib/modules/<release>/`.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub dir: PathBuf,
    pub release: String,
}

impl Kernel {
    /// The kernel `scripts/setup.sh` fetched (`POLICY_AGENT_VM_CACHE`
    /// overrides the cache directory).
    pub fn cached() -> anyhow::Result<Self> {
        let cache = std::env::var_os("POLICY_AGENT_VM_CACHE")
            .map_or_else(|| DEFAULT_CACHE.into(), PathBuf::from);
        let current = cache.join("current");
        let dir = fs::canonicalize(&current).with_context(|| {
            format!(
                "no test VM kernel at {} (run `cargo xtask setup`)",
                current.display()
            )
        })?;
        let release = dir
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned)
            .with_context(|| format!("kernel directory {}", dir.display()))?;
        // The guest reaches it through the host's root, where these are
        // its own tmpfs.
        if super::hidden_in_guest(&dir) {
            bail!(
                "{}: the VM kernel cache must not be under /tmp, /run or /var/tmp",
                dir.display()
            );
        }
        let kernel = Self { dir, release };
        for p in [kernel.vmlinuz(), kernel.modules().join("modules.dep")] {
            if !p.is_file() {
                bail!("{} missing (run `cargo xtask setup`)", p.display());
            }
        }
        Ok(kernel)
    }

    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join(format!("boot/vmlinuz-{}", self.release))
    }

    /// What QEMU boots: the uncompressed ELF (PVH entry, no decompression)
    /// when setup unpacked it, else the bzImage.
    pub fn image(&self) -> PathBuf {
        let elf = self.dir.join(format!("boot/vmlinux-{}", self.release));
        if elf.is_file() { elf } else { self.vmlinuz() }
    }

    /// `lib/modules/<release>`.
    pub fn modules(&self) -> PathBuf {
        self.dir.join("lib/modules").join(&self.release)
    }
}
