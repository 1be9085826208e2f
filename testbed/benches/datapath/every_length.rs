//! The worst shape the classifier can take at all, and the worst of
//! another split of port ranges, beside the worst the agent writes, in the
//! same rounds: port blocks of all 17 prefix lengths (54 probes for a peer
//! that misses everywhere, as endPort ranges compiled before the agent
//! split them into the lengths it probes), of strides of 4 bits (16, 12,
//! 8, 4, 0: 18 probes, at about twice the entries of the agent's split)
//! and of `PORT_PREFIX_LENGTHS` (24 probes). All at 1,000 entries, over
//! the one-lookup floor measured in the same round.
use policy_agent::datapath::bpf::{pins::Hook, unpinned::Unpinned};
use policy_common::policy::PORT_PREFIX_LENGTHS;

use super::{against_base, median, run_once, worst_state_of};

fn loaded(lengths: &[u8]) -> Unpinned {
    against_base::loaded(None, &worst_state_of(1_000, lengths))
}

pub fn every_length(
    floors: &mut Unpinned,
    new_worst: &[u8],
    repeat: u32,
    rounds: usize,
) -> serde_json::Value {
    let every: Vec<u8> = (0..=16).collect();
    let mut builds = [
        loaded(&every),
        loaded(&[16, 12, 8, 4, 0]),
        loaded(&PORT_PREFIX_LENGTHS),
    ];
    let mut ns: [Vec<f64>; 3] = Default::default();
    let mut over: [Vec<f64>; 3] = Default::default();
    for _ in 0..rounds {
        let f = run_once(
            floors.extra_program("floor_one_lookup").unwrap(),
            new_worst,
            repeat,
        );
        for (i, dp) in builds.iter_mut().enumerate() {
            let t = run_once(dp.program(Hook::Egress).unwrap(), new_worst, repeat);
            ns[i].push(t);
            over[i].push(t / f);
        }
    }
    let [a, s4, g] = ns.map(median);
    let [ar, s4r, gr] = over.map(median);
    println!(
        "worst shape, 1,000 entries: every prefix length (54 probes) {a:.1} ns ({ar:.2}x the floor); strides of 4 bits (18 probes) {s4:.1} ns ({s4r:.2}x); the lengths the agent writes (24 probes) {g:.1} ns ({gr:.2}x)"
    );
    serde_json::json!({
        "every_length_ns": a, "every_length_over_floor": ar,
        "stride_4_ns": s4, "stride_4_over_floor": s4r,
        "given_lengths_ns": g, "given_lengths_over_floor": gr,
    })
}
