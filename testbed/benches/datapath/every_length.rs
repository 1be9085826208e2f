//! The worst shape the classifier can take at all, beside the worst the
//! agent writes, in the same rounds: port blocks of all 17 prefix lengths
//! (54 probes for a peer that misses everywhere, as endPort ranges
//! compiled before the agent split them on hexadecimal digits) against
//! blocks of `PORT_PREFIX_LENGTHS` only (18 probes). Both at 1,000
//! entries, over the one-lookup floor measured in the same round.
use policy_agent::{
    datapath::bpf::{pins::Hook, unpinned::Unpinned},
    mapstate::diff,
};
use policy_common::{maps as names, policy::PORT_PREFIX_LENGTHS};

use super::{median, run_once, worst_state_of};

fn loaded(lengths: &[u8]) -> Unpinned {
    let mut dp = Unpinned::load_with(&[(names::CONNTRACK, 65536)]).unwrap();
    let old = dp.maps.read_state().unwrap();
    dp.maps
        .apply(&diff(&old, &worst_state_of(1_000, lengths)))
        .unwrap();
    dp
}

pub fn every_length(
    floors: &mut Unpinned,
    new_worst: &[u8],
    repeat: u32,
    rounds: usize,
) -> serde_json::Value {
    let every: Vec<u8> = (0..=16).collect();
    let mut all = loaded(&every);
    let mut given = loaded(&PORT_PREFIX_LENGTHS);
    let (mut all_ns, mut given_ns, mut all_r, mut given_r) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let f = run_once(
            floors.extra_program("floor_one_lookup").unwrap(),
            new_worst,
            repeat,
        );
        let a = run_once(all.program(Hook::Egress).unwrap(), new_worst, repeat);
        let g = run_once(given.program(Hook::Egress).unwrap(), new_worst, repeat);
        all_ns.push(a);
        given_ns.push(g);
        all_r.push(a / f);
        given_r.push(g / f);
    }
    let (a, g, ar, gr) = (
        median(all_ns),
        median(given_ns),
        median(all_r),
        median(given_r),
    );
    println!(
        "worst shape, 1,000 entries: every prefix length (54 probes) {a:.1} ns ({ar:.2}x the floor); the lengths the agent writes (18 probes) {g:.1} ns ({gr:.2}x)"
    );
    serde_json::json!({
        "every_length_ns": a, "every_length_over_floor": ar,
        "given_lengths_ns": g, "given_lengths_over_floor": gr,
    })
}
