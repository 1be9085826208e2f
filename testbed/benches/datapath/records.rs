//! What flow records cost a packet: a new flow denied with the typical
//! shape (its drop is recorded), with records switched off, with records
//! on and the ring read (each record written), on with the ring full
//! (the reservation fails: counted, nothing written), and on with the
//! per-CPU budget spent (counted before any reservation). Each over the
//! one-lookup floor of the same round. Records a core can carry follow
//! from the ring-read figure.
use aya::maps::{PerCpuArray, PerCpuValues, RingBuf};
use policy_agent::{
    datapath::bpf::{pins::Hook, unpinned::Unpinned},
    mapstate::diff,
};
use policy_common::{
    config::CONFIG_NO_DROP_EVENTS,
    event::{FlowBudget, FlowRecord},
    maps as names,
};

use super::{median, run_once, state};

/// Packets per call with the ring read: fewer than the ring holds
/// (2^18 bytes, 104 per record), so every one is written.
const DRAINED_REPEAT: u32 = 2_000;

fn set_budget(dp: &mut Unpinned, budget: FlowBudget) {
    let mut map: PerCpuArray<_, FlowBudget> =
        PerCpuArray::try_from(dp.ebpf.map_mut(names::FLOW_BUDGET).unwrap()).unwrap();
    let cpus = aya::util::nr_cpus().unwrap();
    map.set(0, PerCpuValues::try_from(vec![budget; cpus]).unwrap(), 0)
        .unwrap();
}

fn set_records(dp: &mut Unpinned, on: bool) {
    let mut config = dp.maps.config().unwrap();
    if on {
        config.flags &= !CONFIG_NO_DROP_EVENTS;
    } else {
        config.flags |= CONFIG_NO_DROP_EVENTS;
    }
    dp.maps.set_config(config).unwrap();
}

fn drain(ring: &mut RingBuf<aya::maps::MapData>) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        assert!(item.len() >= std::mem::size_of::<FlowRecord>());
        n += 1;
    }
    n
}

/// The figures, as JSON; printed as they are measured.
pub fn records(
    floors: &mut Unpinned,
    new_denied: &[u8],
    established: &[u8],
    repeat: u32,
    rounds: usize,
) -> serde_json::Value {
    let mut dp = Unpinned::load_with(&[(names::CONNTRACK, 65536)]).unwrap();
    let s = state(1_000);
    let old = dp.maps.read_state().unwrap();
    dp.maps.apply(&diff(&old, &s)).unwrap();
    let mut ring = RingBuf::try_from(dp.ebpf.take_map(names::DROP_EVENTS).unwrap()).unwrap();
    let (mut off, mut on, mut full, mut spent) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut written = 0usize;
    for _ in 0..rounds {
        let f = run_once(
            floors.extra_program("floor_one_lookup").unwrap(),
            established,
            repeat,
        );
        set_budget(&mut dp, FlowBudget::new(0, 0));
        set_records(&mut dp, false);
        off.push(run_once(dp.program(Hook::Egress).unwrap(), new_denied, repeat) / f);
        set_records(&mut dp, true);
        drain(&mut ring);
        let n = DRAINED_REPEAT.min(repeat);
        on.push(run_once(dp.program(Hook::Egress).unwrap(), new_denied, n) / f);
        written += drain(&mut ring);
        // Filled, then measured full: every reservation fails.
        run_once(
            dp.program(Hook::Egress).unwrap(),
            new_denied,
            4 * DRAINED_REPEAT,
        );
        full.push(run_once(dp.program(Hook::Egress).unwrap(), new_denied, repeat) / f);
        drain(&mut ring);
        // A budget of one record a second: all but the first are held back.
        set_budget(&mut dp, FlowBudget::new(1, 1));
        spent.push(run_once(dp.program(Hook::Egress).unwrap(), new_denied, repeat) / f);
        assert!(drain(&mut ring) <= 2, "the budget holds records back");
        set_budget(&mut dp, FlowBudget::new(0, 0));
    }
    assert!(
        written >= rounds * DRAINED_REPEAT.min(repeat) as usize * 9 / 10,
        "records were written: {written}"
    );
    let floor = median(
        (0..rounds)
            .map(|_| {
                run_once(
                    floors.extra_program("floor_one_lookup").unwrap(),
                    established,
                    repeat,
                )
            })
            .collect(),
    );
    let [off, on, full, spent] = [off, on, full, spent].map(median);
    let record_ns = (on - off) * floor;
    let per_core = if record_ns > 0.0 {
        1e9 / (on * floor)
    } else {
        f64::NAN
    };
    println!(
        "flow records, new flow denied (1,000 entries): records off {off:.2}x the floor, on and read {on:.2}x (+{record_ns:.0} ns a record), on with the ring full {full:.2}x, on with the budget spent {spent:.2}x; one core judges and records {per_core:.0} such flows a second"
    );
    serde_json::json!({
        "policy_entries": 1000, "floor_one_lookup_ns": floor,
        "off_over_floor": off, "on_read_over_floor": on,
        "on_ring_full_over_floor": full, "on_budget_spent_over_floor": spent,
        "record_ns": record_ns, "recorded_flows_per_core_second": per_core,
    })
}
