//! With `POLICY_AGENT_BENCH_BASE_OBJECT` naming another build of the
//! classifier's object, the main table's paths (1,000 policy entries)
//! measured for both builds in the same rounds, one after the other: a
//! change's effect without the drift of a shared machine between two
//! runs, which moves absolute times by 20% and more. Each build's
//! figure is over its own one-lookup floor (the floor shares the parse:
//! a cheaper parse lowers both), and the last column compares the builds'
//! absolute times.
//!
//! The base object of an earlier commit, built beside this checkout:
//!
//! ```text
//! git worktree add /tmp/base <commit>
//! (cd /tmp/base && CARGO_TARGET_DIR=/tmp/base-target cargo build --release -p policy-agent)
//! POLICY_AGENT_BENCH_BASE_OBJECT=$(ls /tmp/base-target/release/build/policy-agent-*/out/policy-ebpf) \
//!     cargo xtask bench --only datapath
//! ```
use aya::programs::{TestRun as _, TestRunOptions};
use policy_agent::{
    datapath::bpf::{pins::Hook, unpinned::Unpinned},
    mapstate::{MapState, diff},
};

use super::{median, run_once};

/// The frames of the main table.
pub struct Frames<'a> {
    pub opening: &'a [u8],
    pub established: &'a [u8],
    /// The pod's answer on the established flow, at its egress.
    pub reply: &'a [u8],
    pub new_denied: &'a [u8],
    pub new_worst: &'a [u8],
}

/// One build, loaded twice: with the typical state and the worst one.
struct Build {
    typical: Unpinned,
    worst: Unpinned,
}

/// `object` (None: this build) with the maps holding `state`.
pub(super) fn loaded(object: Option<&[u8]>, state: &MapState<u32>) -> Unpinned {
    let capacities = [(policy_common::maps::CONNTRACK, 65536)];
    let mut dp = match object {
        Some(bytes) => Unpinned::load_object(bytes, &capacities).unwrap(),
        None => Unpinned::load_with(&capacities).unwrap(),
    };
    let old = dp.maps.read_state().unwrap();
    dp.maps.apply(&diff(&old, state)).unwrap();
    dp
}

impl Build {
    fn load(
        object: Option<&[u8]>,
        state: &MapState<u32>,
        worst: &MapState<u32>,
        f: &Frames,
    ) -> Self {
        let mut typical = loaded(object, state);
        let r = typical
            .program(Hook::Egress)
            .unwrap()
            .test_run(TestRunOptions {
                data_in: Some(f.opening),
                ..TestRunOptions::default()
            })
            .unwrap();
        assert_ne!(r.return_value, 2, "the established flow's SYN is allowed");
        Self {
            typical,
            worst: loaded(object, worst),
        }
    }

    /// One round: the floor, then each path (ns).
    fn round(&mut self, f: &Frames, repeat: u32) -> [f64; 5] {
        let floor = run_once(
            self.typical.extra_program("floor_one_lookup").unwrap(),
            f.established,
            repeat,
        );
        let prog = self.typical.program(Hook::Egress).unwrap();
        let established = run_once(prog, f.established, repeat);
        let new = run_once(prog, f.new_denied, repeat);
        let worst = run_once(
            self.worst.program(Hook::Egress).unwrap(),
            f.new_worst,
            repeat,
        );
        let reply = run_once(
            self.typical.program(Hook::Ingress).unwrap(),
            f.reply,
            repeat,
        );
        [floor, established, new, worst, reply]
    }
}

const PATHS: [&str; 4] = [
    "established, conntrack hit (to_pod)",
    "new flow denied, typical shape",
    "new flow denied, worst shape",
    "established, the pod's reply (from_pod)",
];

/// The comparison, when a base object is named.
pub fn against_base(
    state: &MapState<u32>,
    worst: &MapState<u32>,
    f: &Frames,
    repeat: u32,
    rounds: usize,
) -> Option<serde_json::Value> {
    let path = std::env::var_os("POLICY_AGENT_BENCH_BASE_OBJECT")?;
    let bytes = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("POLICY_AGENT_BENCH_BASE_OBJECT {path:?}: {e}"));
    let mut base = Build::load(Some(&bytes), state, worst, f);
    let mut this = Build::load(None, state, worst, f);
    let (mut b, mut t) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        b.push(base.round(f, repeat));
        t.push(this.round(f, repeat));
    }
    let col = |v: &[[f64; 5]], i: usize| median(v.iter().map(|r| r[i]).collect());
    let over = |v: &[[f64; 5]], i: usize| median(v.iter().map(|r| r[i] / r[0]).collect());
    let ratio = |i: usize| median(b.iter().zip(&t).map(|(b, t)| t[i] / b[i]).collect());
    println!(
        "against the base object {path:?} (1,000 policy entries, {rounds} rounds): floor {:.0} ns -> {:.0} ns ({:.2}x)",
        col(&b, 0),
        col(&t, 0),
        ratio(0)
    );
    let mut rows = Vec::new();
    for (i, name) in PATHS.iter().enumerate().map(|(i, n)| (i + 1, n)) {
        println!(
            "  {name}: {:.0} -> {:.0} ns ({:.2}x); over its floor {:.2}x -> {:.2}x",
            col(&b, i),
            col(&t, i),
            ratio(i),
            over(&b, i),
            over(&t, i)
        );
        rows.push(serde_json::json!({
            "path": name, "base_ns": col(&b, i), "this_ns": col(&t, i),
            "this_over_base": ratio(i), "base_over_floor": over(&b, i),
            "this_over_floor": over(&t, i),
        }));
    }
    Some(serde_json::json!({
        "base_object": path.to_string_lossy(),
        "floor_base_ns": col(&b, 0), "floor_this_ns": col(&t, 0), "floor_this_over_base": ratio(0),
        "rows": rows,
    }))
}
