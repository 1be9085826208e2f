//! Network namespaces, created with iproute2 and entered per thread.
use std::{fs::File, os::fd::AsRawFd, path::PathBuf, process::Command};

use crate::Error;

/// Runs a command, failing with its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<String, Error> {
    Ok(policy_agent::exec::run(program, args)?)
}

/// A named network namespace (`/run/netns/<name>`), deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    pub name: String,
    owned: bool,
}

impl NetNs {
    /// Creates the namespace, replacing a stale one of the same name.
    pub fn create(name: &str) -> Result<Self, Error> {
        if Self::exists(name) {
            let _ = run("ip", &["netns", "del", name]);
        }
        run("ip", &["netns", "add", name])?;
        let ns = Self {
            name: name.to_owned(),
            owned: true,
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A handle on an existing namespace that is not deleted on drop.
    pub fn borrow(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            owned: false,
        }
    }

    pub fn exists(name: &str) -> bool {
        Self::path_of(name).exists()
    }

    fn path_of(name: &str) -> PathBuf {
        PathBuf::from("/run/netns").join(name)
    }

    pub fn path(&self) -> PathBuf {
        Self::path_of(&self.name)
    }

    /// `ip -n <ns> ...`
    pub fn ip(&self, args: &[&str]) -> Result<String, Error> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// `ip -n <ns> -batch -`: the commands (one per item, words split on
    /// whitespace, no global options) in one process, which stops at the
    /// first that fails and names it. One process instead of one per
    /// command: spawning is what building a node costs on a slow (e.g.
    /// emulated) machine.
    pub fn ip_batch(&self, commands: &[String]) -> Result<(), Error> {
        if commands.is_empty() {
            return Ok(());
        }
        let input = commands.join("\n") + "\n";
        policy_agent::exec::run_with_input("ip", &["-n", &self.name, "-batch", "-"], Some(&input))?;
        Ok(())
    }

    /// A sysctl inside the namespace (/proc/sys/net is per namespace): its
    /// file written from a thread inside, no process spawned. `key` is
    /// dotted (`net.ipv4.ip_forward`), so its parts hold no dots.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<(), Error> {
        let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
        let value = value.to_owned();
        self.spawn(move || std::fs::write(path, value))?
            .join()
            .map_err(|_| Error::Invalid(format!("sysctl thread in {} panicked", self.name)))??
            .map_err(|source| Error::Sysctl {
                netns: self.name.clone(),
                key: key.to_owned(),
                source,
            })
    }

    /// Runs a program inside the namespace. nsenter keeps the mount
    /// namespace, so /sys/fs/bpf stays visible (`ip netns exec` would
    /// remount /sys and hide it).
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String, Error> {
        let net = format!("--net={}", self.path().display());
        let mut all = vec![net.as_str(), program];
        all.extend_from_slice(args);
        run("nsenter", &all)
    }

    /// A `Command` that runs inside the namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path().display()))
            .arg(program);
        c
    }

    /// Moves the calling thread into the namespace (for this thread only).
    pub fn enter(&self) -> Result<(), Error> {
        let file = File::open(self.path()).map_err(|source| Error::Enter {
            name: self.name.clone(),
            source,
        })?;
        // SAFETY: setns on a valid namespace fd affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(Error::Enter {
                name: self.name.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Runs `f` on a new thread inside the namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<std::thread::JoinHandle<Result<T, Error>>, Error> {
        let ns = NetNs::borrow(&self.name);
        std::thread::Builder::new()
            .name(format!("netns-{}", self.name))
            .spawn(move || {
                ns.enter()?;
                Ok(f())
            })
            .map_err(Error::Thread)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if self.owned && Self::exists(&self.name) {
            let _ = run("ip", &["netns", "del", &self.name]);
        }
    }
}
