//! A loaded classifier with private maps, driven by BPF_PROG_TEST_RUN.
//!
//! A test's classifier goes back to a per-process pool when the test
//! passes, its maps put back as they were after the load
//! ([`super::map_reset`]), and the next test of the same kind takes it
//! instead of loading (and verifying) the object again. A classifier is
//! not reused after a failed test, after a test took one of its maps (a
//! ring buffer reader, the kernel logger), or with capacities of its own.
use std::{
    net::IpAddr,
    ops::{Deref, DerefMut},
    sync::Mutex,
};

use aya::programs::{TestRun as _, TestRunOptions};
use ipnet::IpNet;
use policy_agent::{
    datapath::bpf::{Hook, Unpinned},
    mapstate::{MapState, diff},
};
use policy_common::{
    direction,
    endpoint::{ENDPOINT_HAS_V4, ENDPOINT_HAS_V6, EndpointInfo},
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    service::ServiceEntry,
    verdict::Reason,
};

use super::map_reset::Snapshot;

/// The ifindex BPF_PROG_TEST_RUN gives an skb: the loopback device.
pub const TEST_IFINDEX: u32 = 1;
/// The test pod's addresses: 10.0.0.10 and fd00::10.
pub const POD_V4: [u8; 4] = [10, 0, 0, 10];
pub const POD_V6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];

pub struct Harness {
    pub dp: Loaded,
    pub state: MapState<u32>,
}

/// The kinds of classifier the pool keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Default capacities.
    Default,
    /// A one-slot endpoint array.
    OverflowHash,
}

struct Pooled {
    kind: Kind,
    dp: Unpinned,
    snapshot: Snapshot,
}

/// Passed tests' classifiers, their maps already put back.
static POOL: Mutex<Vec<Pooled>> = Mutex::new(Vec::new());

/// A test's classifier (derefs to [`Unpinned`]).
pub struct Loaded {
    dp: Option<Unpinned>,
    /// Where it goes back to when the test passes.
    reuse: Option<Reuse>,
}

struct Reuse {
    kind: Kind,
    snapshot: Snapshot,
    /// Maps left in `ebpf` after the load: fewer at the end means the
    /// test took one.
    maps: usize,
}

impl Loaded {
    fn get(kind: Kind, load: impl FnOnce() -> Unpinned) -> Self {
        let pooled = {
            let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
            let i = pool.iter().position(|p| p.kind == kind);
            i.map(|i| pool.swap_remove(i))
        };
        let (dp, snapshot) = match pooled {
            Some(p) => (p.dp, Some(p.snapshot)),
            None => {
                let dp = load();
                let snapshot = dp
                    .map_ids
                    .as_deref()
                    .and_then(|ids| Snapshot::take(ids).ok().flatten());
                (dp, snapshot)
            }
        };
        let maps = dp.ebpf.maps().count();
        Self {
            dp: Some(dp),
            reuse: snapshot.map(|snapshot| Reuse {
                kind,
                snapshot,
                maps,
            }),
        }
    }

    fn fresh(dp: Unpinned) -> Self {
        Self {
            dp: Some(dp),
            reuse: None,
        }
    }
}

impl Deref for Loaded {
    type Target = Unpinned;
    fn deref(&self) -> &Unpinned {
        self.dp.as_ref().expect("a classifier until dropped")
    }
}

impl DerefMut for Loaded {
    fn deref_mut(&mut self) -> &mut Unpinned {
        self.dp.as_mut().expect("a classifier until dropped")
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let (Some(dp), Some(reuse)) = (self.dp.take(), self.reuse.take()) else {
            return;
        };
        if dp.ebpf.maps().count() != reuse.maps {
            return;
        }
        if let Err(e) = reuse.snapshot.restore() {
            eprintln!("not reusing a classifier whose maps could not be put back: {e}");
            return;
        }
        POOL.lock().unwrap_or_else(|e| e.into_inner()).push(Pooled {
            kind: reuse.kind,
            dp,
            snapshot: reuse.snapshot,
        });
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
}

/// What one run at a chosen interface with a chosen mark did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub verdict: Verdict,
    /// `skb->mark` as the program left it.
    pub mark: u32,
    /// The verdict counters that moved, as (reason, direction), sorted.
    pub counted: Vec<(Reason, u8)>,
}

/// Size of the `__sk_buff` image passed in and read back (the kernel's
/// is 192 bytes; a larger output buffer is fine, a larger input must be
/// zero beyond it).
const SKB_CTX: usize = 192;
/// Offsets in `struct __sk_buff`.
const SKB_MARK: usize = 8;
const SKB_IFINDEX: usize = 40;

impl Harness {
    pub fn new() -> Self {
        Self {
            dp: Loaded::get(Kind::Default, || {
                Unpinned::load().expect("load classifier (are you root?)")
            }),
            state: MapState::default(),
        }
    }

    /// Like [`Self::new`], but with a one-slot endpoint array, so the
    /// test interface (ifindex 1) lives in the overflow hash: the path a
    /// node takes once it has created more interfaces than the array has
    /// slots.
    #[allow(dead_code)]
    pub fn with_endpoints_in_overflow_hash() -> Self {
        Self {
            dp: Loaded::get(Kind::OverflowHash, || {
                Unpinned::load_with(&[(policy_common::maps::ENDPOINT_SLOTS, 1)])
                    .expect("load classifier (are you root?)")
            }),
            state: MapState::default(),
        }
    }

    /// Like [`Self::new`], with map capacity overrides.
    #[allow(dead_code)]
    pub fn with_capacities(capacities: &[(&str, u32)]) -> Self {
        Self {
            dp: Loaded::fresh(
                Unpinned::load_with(capacities).expect("load classifier (are you root?)"),
            ),
            state: MapState::default(),
        }
    }

    /// Writes `self.state` (after finalize) to the maps.
    pub fn sync(&mut self) {
        let old = self.dp.maps.read_state().unwrap();
        self.state.finalize();
        let ops = diff(&old, &self.state);
        self.dp.maps.apply(&ops).unwrap();
    }

    /// The test interface's endpoint: the pod at [`POD_V4`] and [`POD_V6`].
    pub fn endpoint(&mut self, identity: u32, flags: u32, revision: u32) {
        self.state.endpoints.insert(
            TEST_IFINDEX,
            EndpointInfo {
                identity,
                flags: flags | ENDPOINT_HAS_V4 | ENDPOINT_HAS_V6,
                revision,
                ipv4: POD_V4,
                ipv6: POD_V6,
                ..Default::default()
            },
        );
    }

    /// An endpoint at any interface, for the pod holding `addrs`.
    pub fn endpoint_at(
        &mut self,
        ifindex: u32,
        identity: u32,
        flags: u32,
        revision: u32,
        addrs: &[IpAddr],
    ) {
        self.state.endpoints.insert(
            ifindex,
            EndpointInfo {
                identity,
                flags,
                revision,
                ..Default::default()
            }
            .with_addresses(addrs),
        );
    }

    /// A Service frontend address or range.
    pub fn frontend(&mut self, net: &str) {
        let net: IpNet = net.parse().unwrap();
        self.state
            .services
            .insert(net.trunc(), ServiceEntry::default());
    }

    pub fn ipcache(&mut self, net: &str, identity: u32, cidr_identity: u32) {
        let net: IpNet = net.parse().unwrap();
        self.state.ipcache.insert(
            net.trunc(),
            IpcacheEntry {
                identity,
                cidr_identity,
            },
        );
    }

    pub fn allow(&mut self, key: PolicyKey) {
        self.state.policy.insert(key, PolicyEntry::default());
    }

    /// Adds a pod range (`--pod-cidr`) and turns the catch-all on.
    #[allow(dead_code)]
    pub fn pod_range(&mut self, net: &str) {
        use policy_common::catchall::{POD_RANGE, local_addr, range_prefix_len};
        let net: IpNet = net.parse().unwrap();
        let (fam, bytes) = family_bytes(net.trunc().addr());
        let key = aya::maps::lpm_trie::Key::new(
            range_prefix_len(net.prefix_len()),
            local_addr(fam, &bytes),
        );
        self.dp.maps.pod_ranges.insert(&key, POD_RANGE, 0).unwrap();
        self.catchall(true);
    }

    /// Sets or clears `CONFIG_POD_RANGES`.
    #[allow(dead_code)]
    pub fn catchall(&mut self, on: bool) {
        let mut c = self.dp.maps.config().unwrap();
        c.flags &= !policy_common::config::CONFIG_POD_RANGES;
        if on {
            c.flags |= policy_common::config::CONFIG_POD_RANGES;
        }
        self.dp.maps.set_config(c).unwrap();
    }

    /// Marks a local address enforced (`ENFORCED`), or not.
    #[allow(dead_code)]
    pub fn enforce(&mut self, addr: &str, ifindex: Option<u32>) {
        let (fam, bytes) = family_bytes(ip(addr));
        let key = policy_common::catchall::local_addr(fam, &bytes);
        match ifindex {
            Some(i) => self.dp.maps.enforced.insert(key, i, 0).unwrap(),
            // Absent already is fine.
            None => {
                let _ = self.dp.maps.enforced.remove(&key);
            }
        }
    }

    /// Runs one frame through the program at `hook`.
    pub fn run(&mut self, hook: Hook, frame: &[u8]) -> Verdict {
        let prog = self.dp.program(hook).unwrap();
        let opts = TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        };
        let r = prog.test_run(opts).expect("BPF_PROG_TEST_RUN");
        match r.return_value as i32 {
            -1 => Verdict::Pass,
            2 => Verdict::Drop,
            other => panic!("unexpected tc verdict {other}"),
        }
    }

    /// Runs one frame through the program at `hook` as if it crossed
    /// interface `ifindex` (a device in the calling thread's network
    /// namespace, or 0 for loopback) carrying `mark`; reports the verdict,
    /// the mark it leaves with and every verdict counter that moved.
    pub fn run_at(&mut self, hook: Hook, frame: &[u8], ifindex: u32, mark: u32) -> Run {
        let before = self.dp.maps.counters().unwrap();
        let mut ctx_in = [0u8; SKB_CTX];
        ctx_in[SKB_MARK..SKB_MARK + 4].copy_from_slice(&mark.to_ne_bytes());
        ctx_in[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifindex.to_ne_bytes());
        let mut ctx_out = [0u8; 2 * SKB_CTX];
        let prog = self.dp.program(hook).unwrap();
        let opts = TestRunOptions {
            data_in: Some(frame),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            ..TestRunOptions::default()
        };
        let r = prog
            .test_run(opts)
            .expect("BPF_PROG_TEST_RUN with a context");
        let verdict = match r.return_value as i32 {
            -1 => Verdict::Pass,
            2 => Verdict::Drop,
            other => panic!("unexpected tc verdict {other}"),
        };
        let ifindex_out =
            u32::from_ne_bytes(ctx_out[SKB_IFINDEX..SKB_IFINDEX + 4].try_into().unwrap());
        assert_eq!(
            ifindex_out,
            if ifindex == 0 { 1 } else { ifindex },
            "the run took the interface asked for"
        );
        let after = self.dp.maps.counters().unwrap();
        let mut counted: Vec<(Reason, u8)> = after
            .iter()
            .filter(|((r, _), _)| r.is_verdict())
            .filter(|(k, n)| before.get(k) != Some(n))
            .map(|(k, _)| *k)
            .collect();
        counted.sort();
        Run {
            verdict,
            mark: u32::from_ne_bytes(ctx_out[SKB_MARK..SKB_MARK + 4].try_into().unwrap()),
            counted,
        }
    }

    /// Runs a frame and reports which reason counter moved.
    pub fn run_reason(&mut self, hook: Hook, frame: &[u8]) -> (Verdict, Reason) {
        let before = self.dp.maps.counters().unwrap();
        let verdict = self.run(hook, frame);
        let after = self.dp.maps.counters().unwrap();
        let dir = hook_direction(hook);
        let moved: Vec<Reason> = after
            .iter()
            .filter(|((r, d), n)| *d == dir && before.get(&(*r, *d)) != Some(n) && r.is_verdict())
            .map(|((r, _), _)| *r)
            .collect();
        assert_eq!(
            moved.len(),
            1,
            "exactly one verdict counter must move, moved: {moved:?}"
        );
        assert_eq!(
            verdict == Verdict::Drop,
            moved[0].is_drop(),
            "counter {:?} disagrees with verdict {verdict:?}",
            moved[0]
        );
        (verdict, moved[0])
    }
}

/// Host-veth ingress judges the pod's egress, host-veth egress its
/// ingress; the uplink judges a client's egress after DNAT.
pub fn hook_direction(hook: Hook) -> u8 {
    match hook {
        Hook::Ingress | Hook::Uplink => direction::EGRESS,
        Hook::Egress | Hook::UplinkIngress => direction::INGRESS,
    }
}

fn family_bytes(a: IpAddr) -> (u8, [u8; 16]) {
    match a {
        IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            (policy_common::family::IPV4, b)
        }
        IpAddr::V6(v6) => (policy_common::family::IPV6, v6.octets()),
    }
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}
