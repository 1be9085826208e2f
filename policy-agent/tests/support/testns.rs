//! A fresh network namespace for one test, entered by the test's thread.
//!
//! BPF_PROG_TEST_RUN takes the skb's interface from `__sk_buff.ifindex`,
//! which must name a device in the calling thread's namespace. A test
//! that runs packets at chosen interfaces makes its own namespace, gives
//! it devices at those ifindexes, and deletes it when dropped (a
//! failing test too). The thread stays in it until the test ends.
use std::sync::atomic::{AtomicU32, Ordering};

use policy_agent::sim::NetNs;

/// Namespaces of this kind are named `<PREFIX><pid>-<n>-<tag>`.
const PREFIX: &str = "pa-tns-";
/// Where [`TestNs::device`] puts a device's veth peer.
pub const PEER_OFFSET: u32 = 100_000;

pub struct TestNs {
    ns: NetNs,
}

impl TestNs {
    /// Creates a namespace named after `tag` and moves the calling thread
    /// into it. Namespaces left by killed runs (their pid is gone) go first.
    pub fn enter(tag: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        remove_stale();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{}-{n}-{tag}", std::process::id());
        let ns = NetNs::create(&name).expect("create network namespace");
        ns.enter().expect("enter network namespace");
        Self { ns }
    }

    /// A device at a chosen ifindex: one end of a veth pair (dummy may
    /// be missing from the kernel), its peer at `ifindex + PEER_OFFSET`.
    pub fn device(&self, name: &str, ifindex: u32) -> u32 {
        let peer = format!("{name}-p");
        let index = ifindex.to_string();
        let peer_index = (ifindex + PEER_OFFSET).to_string();
        self.ns
            .ip(&[
                "link",
                "add",
                "name",
                name,
                "index",
                &index,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
                "index",
                &peer_index,
            ])
            .expect("create a veth pair");
        ifindex
    }
}

/// Deletes namespaces of this kind whose creating process is gone.
fn remove_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = policy_agent::sim::run("ip", &["netns", "del", &name]);
        }
    }
}
