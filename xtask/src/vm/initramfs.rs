//! The initramfs: busybox, `scripts/vm/init` and the modules mounting the
//! 9p root needs, built here and cached next to the kernel.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};

use super::Kernel;

/// The initramfs's /init.
const INIT: &str = include_str!("../../../scripts/vm/init");
/// Statically linked (package busybox-static).
const BUSYBOX: &str = "/bin/busybox";
/// What mounting the root needs, with their dependencies (from
/// modules.dep); built-in ones are skipped.
const ROOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];

/// The modules `roots` need, dependencies first, as paths relative to the
/// modules directory; built-in ones are left out.
fn module_closure(modules: &Path, roots: &[&str]) -> anyhow::Result<Vec<String>> {
    let dep = fs::read_to_string(modules.join("modules.dep"))
        .with_context(|| format!("reading {}/modules.dep", modules.display()))?;
    let builtin = fs::read_to_string(modules.join("modules.builtin")).unwrap_or_default();
    let name = |path: &str| -> String {
        let file = path.rsplit('/').next().unwrap_or(path);
        let stem = file.split(".ko").next().unwrap_or(file);
        stem.replace('-', "_")
    };
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in dep.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        let needs = rest.split_whitespace().map(&name).collect();
        deps.insert(name(path), (path.to_owned(), needs));
    }
    let builtin: BTreeSet<String> = builtin.lines().map(&name).collect();

    fn visit(
        m: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) {
        if !seen.insert(m.to_owned()) {
            return;
        }
        if let Some((path, needs)) = deps.get(m) {
            for n in needs {
                visit(n, deps, seen, out);
            }
            out.push(path.clone());
        }
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for root in roots {
        let root = root.replace('-', "_");
        if !deps.contains_key(&root) && !builtin.contains(&root) {
            bail!("module {root} is neither in modules.dep nor built in");
        }
        visit(&root, &deps, &mut seen, &mut out);
    }
    Ok(out)
}

/// A newc cpio archive, written in memory.
#[derive(Default)]
struct Cpio {
    data: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), body: &[u8]) {
        self.ino += 1;
        let namesize = name.len() + 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            body.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            namesize,
            0
        );
        self.data.extend_from_slice(header.as_bytes());
        self.data.extend_from_slice(name.as_bytes());
        self.data.push(0);
        self.pad();
        self.data.extend_from_slice(body);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.data.len().is_multiple_of(4) {
            self.data.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, mode: u32, body: &[u8]) {
        self.entry(name, 0o100_000 | mode, (0, 0), body);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.data
    }
}

fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

/// The initramfs for `kernel`, built once per content of its inputs (init,
/// busybox, modules) and cached next to the kernel.
pub fn initramfs(kernel: &Kernel) -> anyhow::Result<PathBuf> {
    let modules = module_closure(&kernel.modules(), ROOT_MODULES)?;
    let busybox =
        fs::read(BUSYBOX).with_context(|| format!("reading {BUSYBOX} (package busybox-static)"))?;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut order = String::new();
    for m in &modules {
        let base = m.rsplit('/').next().unwrap_or(m).to_owned();
        if !base.ends_with(".ko") {
            bail!("{m}: compressed modules are not supported by the initramfs");
        }
        let body =
            fs::read(kernel.modules().join(m)).with_context(|| format!("reading module {m}"))?;
        order.push_str(&base);
        order.push('\n');
        files.push((format!("modules/{base}"), body));
    }

    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for part in [INIT.as_bytes(), &busybox, order.as_bytes()] {
        fnv1a(&mut hash, part);
    }
    for (_, body) in &files {
        fnv1a(&mut hash, body);
    }
    let path = kernel.dir.join(format!("initramfs-{hash:016x}.cpio"));
    if path.is_file() {
        return Ok(path);
    }

    let mut cpio = Cpio::default();
    for d in ["bin", "dev", "proc", "sys", "newroot", "modules"] {
        cpio.dir(d);
    }
    // The kernel opens it for init's stdin, stdout and stderr.
    cpio.entry("dev/console", 0o020_600, (5, 1), &[]);
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("bin/busybox", 0o755, &busybox);
    cpio.file("modules/order", 0o644, order.as_bytes());
    for (name, body) in &files {
        cpio.file(name, 0o644, body);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, cpio.finish()).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    // Older ones are for other inputs.
    if let Ok(dir) = fs::read_dir(&kernel.dir) {
        for e in dir.flatten() {
            let n = e.file_name();
            let n = n.to_string_lossy();
            if n.starts_with("initramfs-") && e.path() != path {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closure_puts_dependencies_first_and_skips_builtins() {
        let dir = std::env::temp_dir().join(format!("xtask-vm-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("modules.dep"),
            "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko\n\
             kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko\n\
             kernel/fs/netfs/netfs.ko:\n\
             kernel/net/9p/9pnet.ko:\n",
        )
        .unwrap();
        fs::write(
            dir.join("modules.builtin"),
            "kernel/drivers/virtio/virtio_pci.ko\n",
        )
        .unwrap();
        let got = module_closure(&dir, &["virtio_pci", "9p"]).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got,
            [
                "kernel/net/9p/9pnet.ko",
                "kernel/fs/netfs/netfs.ko",
                "kernel/fs/fscache/fscache.ko",
                "kernel/fs/9p/9p.ko"
            ]
        );
    }

    #[test]
    fn cpio_entries_are_aligned() {
        let mut c = Cpio::default();
        c.file("init", 0o755, b"abc");
        let data = c.finish();
        assert!(data.len().is_multiple_of(4));
        assert!(data.starts_with(b"070701"));
    }
}
