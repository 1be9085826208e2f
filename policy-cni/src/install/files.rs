//! Writing into the node's directories so that a reader never sees half a
//! file: write a hidden temporary in the same directory, fsync, rename
//! over the target (the runtimes skip dot files and other extensions).
use std::{
    fs::{self, File, OpenOptions},
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::Path,
};

fn temporary(target: &Path) -> io::Result<std::path::PathBuf> {
    let dir = target
        .parent()
        .ok_or_else(|| io::Error::other("no parent directory"))?;
    let name = target
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other("no file name"))?;
    Ok(dir.join(format!(".{name}.tmp.{}", std::process::id())))
}

/// Replaces `target` with `contents` unless it already holds exactly that.
/// Returns whether it wrote.
pub fn write_atomic(target: &Path, contents: &[u8], mode: u32) -> io::Result<bool> {
    if fs::read(target).is_ok_and(|old| old == contents) {
        let perms_ok = fs::metadata(target).is_ok_and(|m| m.permissions().mode() & 0o7777 == mode);
        if perms_ok {
            return Ok(false);
        }
    }
    let tmp = temporary(target)?;
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(contents)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, target)?;
        if let Some(dir) = target.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(true)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Copies the executable `source` to `target` (0755) if it differs. A
/// runtime executing the old file keeps its inode; the next exec gets the
/// new one.
pub fn install_binary(source: &Path, target: &Path) -> io::Result<bool> {
    let new = fs::read(source)?;
    write_atomic(target, &new, 0o755)
}

/// Removes `path`; a missing file is fine. Returns whether it removed.
pub fn remove(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
