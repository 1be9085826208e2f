//! What flow records cost a packet: a new flow denied with the typical
//! shape (its drop is recorded), with records switched off, with records
//! on and the ring read (each record written), on with the ring full
//! (the reservation fails: counted, nothing written), and on with the
//! per-CPU budget spent (counted before any reservation). Each over the
//! one-lookup floor of the same round. Records a core can carry follow
//! from the ring-read figure.
use std::time::Instant;

use aya::maps::{PerCpuArray, PerCpuValues, RingBuf};
use policy_agent::{
    datapath::bpf::{
        flows::{
            FlowRate,
            clock::WallClock,
            naming::{Names, name_record},
            stats::FlowStats,
        },
        loader::endpoint_meta,
        pins::Hook,
        unpinned::Unpinned,
    },
    mapstate::{diff, identity_name, rule_name},
};
use policy_common::{
    config::CONFIG_NO_DROP_EVENTS,
    direction,
    event::{FlowBudget, FlowRecord, RECORD_NEW_FLOW, RuleRef},
    identity::kind,
    maps as names,
    rule_name::{RuleKey, kind as rule_kind},
    verdict::Reason,
};

use super::{median, run_once, state, worst_state};

/// Packets per call with the ring read: fewer than the ring holds
/// (2^18 bytes, 104 per record), so every one is written.
const DRAINED_REPEAT: u32 = 2_000;

pub(super) fn set_budget(dp: &mut Unpinned, budget: FlowBudget) {
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
    (new_denied, new_worst): (&[u8], &[u8]),
    established: &[u8],
    repeat: u32,
    rounds: usize,
) -> serde_json::Value {
    let mut dp = Unpinned::load_with(&[(names::CONNTRACK, 65536)]).unwrap();
    let s = state(1_000);
    let old = dp.maps.read_state().unwrap();
    dp.maps.apply(&diff(&old, &s)).unwrap();
    let mut ring = RingBuf::try_from(dp.ebpf.take_map(names::DROP_EVENTS).unwrap()).unwrap();
    // The worst lookup shape the agent writes (24 probes), off and written.
    let mut worst = Unpinned::load_with(&[(names::CONNTRACK, 65536)]).unwrap();
    let w = worst_state(1_000);
    let old = worst.maps.read_state().unwrap();
    worst.maps.apply(&diff(&old, &w)).unwrap();
    let mut worst_ring =
        RingBuf::try_from(worst.ebpf.take_map(names::DROP_EVENTS).unwrap()).unwrap();
    set_budget(&mut worst, FlowBudget::new(0, 0));
    let (mut worst_off, mut worst_on) = (Vec::new(), Vec::new());
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
        set_records(&mut worst, false);
        worst_off.push(run_once(worst.program(Hook::Egress).unwrap(), new_worst, repeat) / f);
        set_records(&mut worst, true);
        drain(&mut worst_ring);
        worst_on.push(run_once(worst.program(Hook::Egress).unwrap(), new_worst, n) / f);
        drain(&mut worst_ring);
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
    let [off, on, full, spent, worst_off, worst_on] =
        [off, on, full, spent, worst_off, worst_on].map(median);
    let record_ns = (on - off) * floor;
    let per_core = if record_ns > 0.0 {
        1e9 / (on * floor)
    } else {
        f64::NAN
    };
    let user_ns = userspace_ns_per_record();
    // What the daemon spends at the default budget on this machine's CPUs
    // (each may emit that many a second).
    let cpus = aya::util::nr_cpus().unwrap_or(1) as f64;
    let core_share = user_ns * FlowRate::DEFAULT.per_second as f64 * cpus / 1e9;
    println!(
        "flow records in userspace: {user_ns:.0} ns a record named, counted and serialized; at the default budget ({} a second per CPU, {cpus} CPUs) {:.2}% of a core",
        FlowRate::DEFAULT.per_second,
        core_share * 100.0
    );
    println!(
        "flow records, worst shape (24 probes): records off {worst_off:.2}x the floor, on and read {worst_on:.2}x"
    );
    println!(
        "flow records, new flow denied (1,000 entries): records off {off:.2}x the floor, on and read {on:.2}x (+{record_ns:.0} ns a record), on with the ring full {full:.2}x, on with the budget spent {spent:.2}x; one core judges and records {per_core:.0} such flows a second"
    );
    serde_json::json!({
        "policy_entries": 1000, "floor_one_lookup_ns": floor,
        "off_over_floor": off, "on_read_over_floor": on,
        "on_ring_full_over_floor": full, "on_budget_spent_over_floor": spent,
        "record_ns": record_ns, "recorded_flows_per_core_second": per_core,
        "worst_off_over_floor": worst_off, "worst_on_read_over_floor": worst_on,
        "userspace_ns_per_record": user_ns, "default_budget_core_share": core_share,
    })
}

/// The daemon's work per record (named, counted for `/metrics`,
/// serialized for the log and subscribers), in ns: the median of five
/// runs of 20,000 allowed and denied records.
fn userspace_ns_per_record() -> f64 {
    let mut n = Names::default();
    let rule = 0x1234_5678;
    n.tables.rules.insert(
        RuleKey::new(rule_kind::NETWORK_POLICY, direction::INGRESS, rule),
        rule_name(direction::INGRESS, 1, 0, "shop", "allow-frontend", ""),
    );
    n.tables.rules.insert(
        RuleKey::isolating(direction::INGRESS, 300, 0),
        rule_name(direction::INGRESS, 0xffff, 0, "shop", "allow-frontend", ""),
    );
    n.tables.identities.insert(
        301,
        std::sync::Arc::new(identity_name(kind::LABELS, "ns=shop;app=frontend")),
    );
    n.tables.endpoints.insert(7, endpoint_meta("shop/db-0", 0));
    let clock = WallClock::now();
    let stats = FlowStats::default();
    let record = |i: u32, allow: bool| FlowRecord {
        ifindex: 7,
        endpoint_identity: 300,
        peer_identity: 301,
        src: [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        dst: [10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        sport: 30000 + (i % 30000) as u16,
        dport: 5432,
        protocol: 6,
        family: policy_common::family::IPV4,
        direction: direction::INGRESS,
        reason: if allow {
            Reason::AllowPolicy as u8
        } else {
            Reason::DropPolicy as u8
        },
        rule: RuleRef {
            network_policy: if allow { rule } else { 0 },
            ..RuleRef::default()
        },
        flags: RECORD_NEW_FLOW,
        ..FlowRecord::default()
    };
    let runs: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            let mut bytes = 0;
            for i in 0..20_000u32 {
                let r = record(i, i % 2 == 0);
                let event = name_record(&n, &clock, &r);
                stats.count(Reason::from_u8(r.reason), &event.flow);
                bytes += serde_json::to_string(&event).unwrap().len();
            }
            assert!(bytes > 0);
            t.elapsed().as_nanos() as f64 / 20_000.0
        })
        .collect();
    median(runs)
}
