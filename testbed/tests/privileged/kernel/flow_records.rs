//! Flow records on the real kernel: the per-CPU record budget
//! (`FLOW_BUDGET`) lets out at most its burst plus its rate, counts what
//! it holds back (`RecordLimited`), and changes no verdict; without a
//! limit every new flow and every drop gives its record. Also the ring
//! and budget helpers the differential test reads records with.
//!
//! The maps are the harness's private ones (nothing pinned): reached here
//! through fds of their own, so the harness keeps them and its pool may
//! reuse the classifier; every fd closes when the test ends, passed or
//! not.
use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData, PerCpuArray, PerCpuValues, RingBuf};
use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction::INGRESS,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    event::{FlowBudget, FlowRecord},
    maps::{DROP_EVENTS, FLOW_BUDGET},
    policy::PolicyKey,
    proto::TCP,
    verdict::Reason::{self, *},
};
use policy_testbed::fixtures::harness::{Harness, PEER, POD, TEST_IFINDEX, Verdict, ip};
use policy_testbed::packet::{Packet, TCP_SYN};

/// A map of the harness's classifier through an fd of its own.
fn own_fd(h: &Harness, name: &str) -> MapData {
    let map =
        h.dp.ebpf
            .map(name)
            .unwrap_or_else(|| panic!("{name} in the object"));
    let data = match map {
        Map::RingBuf(d) | Map::PerCpuArray(d) => d,
        other => panic!("{name}: unexpected map kind {other:?}"),
    };
    let id = data.info().expect("map info").id();
    MapData::from_id(id).expect("map by id")
}

/// The `DROP_EVENTS` ring of a harness, read without taking it away.
pub(super) struct Records {
    ring: RingBuf<MapData>,
}

impl Records {
    pub(super) fn open(h: &Harness) -> Self {
        let ring = RingBuf::try_from(Map::RingBuf(own_fd(h, DROP_EVENTS))).expect("ring buffer");
        Self { ring }
    }

    /// Every record in the ring, oldest first; the ring is empty after.
    pub(super) fn drain(&mut self) -> Vec<FlowRecord> {
        let mut out = Vec::new();
        while let Some(item) = self.ring.next() {
            let size = std::mem::size_of::<FlowRecord>();
            assert!(item.len() >= size, "a record of {} bytes", item.len());
            out.push(bytemuck::pod_read_unaligned(&item[..size]));
        }
        out
    }
}

/// The budget on every CPU, as the agent would write it; read back.
pub(super) fn set_budget(h: &Harness, budget: FlowBudget) -> Vec<FlowBudget> {
    let mut map: PerCpuArray<MapData, FlowBudget> =
        PerCpuArray::try_from(Map::PerCpuArray(own_fd(h, FLOW_BUDGET))).expect("FLOW_BUDGET");
    let cpus = aya::util::nr_cpus().expect("CPU count");
    let values = PerCpuValues::try_from(vec![budget; cpus]).expect("one value per CPU");
    map.set(0, values, 0).expect("write FLOW_BUDGET");
    map.get(&0, 0).expect("read FLOW_BUDGET").to_vec()
}

/// Keeps the calling thread on the CPU it runs on until dropped (the
/// budget is per CPU: one bucket makes the bound exact), then gives it
/// back the CPUs it had, also when the test fails.
struct Pinned {
    before: libc::cpu_set_t,
}

impl Pinned {
    fn here() -> Self {
        // SAFETY: plain syscalls on this thread's affinity with a zeroed
        // cpu_set_t of the size passed.
        unsafe {
            let mut before: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            assert_eq!(libc::sched_getaffinity(0, size, &mut before), 0);
            let cpu = libc::sched_getcpu();
            assert!(cpu >= 0, "sched_getcpu");
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu as usize, &mut one);
            assert_eq!(libc::sched_setaffinity(0, size, &one), 0);
            Self { before }
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `here`.
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.before);
        }
    }
}

const ALLOWED_PORT: u16 = 80;
const DENIED_PORT: u16 = 81;

/// An isolated pod allowing its peer on TCP 80: a SYN to 80 is a new
/// allowed flow (recorded at its conntrack entry), to 81 a drop.
fn harness() -> Harness {
    let mut h = Harness::new();
    h.cluster(ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED);
    h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, 16, ALLOWED_PORT));
    h.sync();
    h
}

/// `n` new flows from distinct source ports starting at `first`,
/// alternately allowed and denied: (frame, source port, verdict).
fn flows(first: u16, n: u16) -> Vec<(Vec<u8>, u16, Verdict)> {
    (0..n)
        .map(|i| {
            let sport = first + i;
            let (dport, verdict) = if i % 2 == 0 {
                (ALLOWED_PORT, Verdict::Pass)
            } else {
                (DENIED_PORT, Verdict::Drop)
            };
            let frame =
                Packet::tcp(ip("10.0.1.20"), sport, ip("10.0.0.10"), dport, TCP_SYN).frame();
            (frame, sport, verdict)
        })
        .collect()
}

/// Runs the flows at the pod's ingress and asserts every verdict.
fn run(h: &mut Harness, flows: &[(Vec<u8>, u16, Verdict)]) {
    let frames: Vec<Vec<u8>> = flows.iter().map(|(f, _, _)| f.clone()).collect();
    let got = h.run_many_at(Hook::Egress, &frames, 0);
    for ((_, sport, want), got) in flows.iter().zip(got) {
        assert_eq!(got, *want, "flow from port {sport}");
    }
}

/// A counter summed over CPUs, for the pod's ingress.
fn counter(h: &Harness, reason: Reason) -> u64 {
    h.dp.maps
        .counters()
        .expect("counters")
        .get(&(reason, INGRESS))
        .copied()
        .unwrap_or(0)
}

fn counters(h: &Harness) -> [u64; 4] {
    [AllowPolicy, DropPolicy, RecordLimited, EventLost].map(|r| counter(h, r))
}

#[test]
fn the_record_budget_lets_out_its_burst_and_rate_and_counts_the_rest() {
    const RATE: u64 = 50;
    const BURST: u64 = 20;
    const FLOWS: u16 = 3000;
    let mut h = harness();
    let mut records = Records::open(&h);
    records.drain();
    let written = set_budget(&h, FlowBudget::new(RATE, BURST));
    assert!(
        written.iter().all(|b| *b == FlowBudget::new(RATE, BURST)),
        "{written:?}"
    );
    let before = counters(&h);
    let flood = flows(20000, FLOWS);
    let pinned = Pinned::here();
    let start = Instant::now();
    run(&mut h, &flood);
    let elapsed = start.elapsed();
    // The bucket refills from the flood's last packet on, not from
    // after the reads below (slow in an emulated guest).
    let flood_end = Instant::now();
    let got = records.drain();
    let after = counters(&h);
    let moved: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    let half = u64::from(FLOWS) / 2;
    // Every packet judged and counted as without a limit.
    assert_eq!(
        (moved[0], moved[1]),
        (half, half),
        "AllowPolicy, DropPolicy moved"
    );
    // One bucket: the burst at once, then one record per 1/RATE second
    // (one more for a token that was nearly whole).
    let n = got.len() as u64;
    let most = BURST + (RATE as f64 * elapsed.as_secs_f64()).ceil() as u64 + 1;
    assert!(
        (BURST..=most).contains(&n),
        "{n} records for {FLOWS} flows in {elapsed:?}: want {BURST}..={most}"
    );
    // What the budget held back is counted, to the record.
    assert_eq!(moved[2], u64::from(FLOWS) - n, "RecordLimited");
    assert_eq!(moved[3], 0, "EventLost");
    // The records that went out are of the flood's flows, each once.
    let sports: BTreeSet<u16> = got.iter().map(|r| r.sport).collect();
    assert_eq!(sports.len(), got.len(), "a flow recorded twice");
    assert!(
        got.iter()
            .all(|r| r.ifindex == TEST_IFINDEX && (20000..20000 + FLOWS).contains(&r.sport)),
        "{got:?}"
    );

    // The bucket refills with time: after a pause, about RATE a second.
    let pause = Duration::from_millis(300);
    std::thread::sleep(pause);
    run(&mut h, &flows(30000, 100));
    let refill = flood_end.elapsed();
    drop(pinned);
    let n = records.drain().len() as u64;
    let least = (RATE as f64 * pause.as_secs_f64()).floor() as u64 - 1;
    let most = (RATE as f64 * refill.as_secs_f64()).ceil() as u64 + 1;
    assert!(
        (least..=most).contains(&n),
        "{n} records after a pause of {pause:?} ({refill:?} in all): want {least}..={most}"
    );
    assert_eq!(counter(&h, RecordLimited) - after[2], 100 - n);
}

#[test]
fn without_a_limit_every_flow_gives_one_record() {
    const FLOWS: u16 = 3000;
    let mut h = harness();
    let mut records = Records::open(&h);
    records.drain();
    // A limit first, then none: the agent may lift it at run time.
    set_budget(&h, FlowBudget::new(1, 1));
    assert!(
        set_budget(&h, FlowBudget::new(0, 0))
            .iter()
            .all(|b| b.cost_ns == 0),
        "no limit written"
    );
    let before = counters(&h);
    let mut got = Vec::new();
    // In rounds the ring holds (about 2,500 records), drained between.
    let all = flows(40000, FLOWS);
    for round in all.chunks(1000) {
        run(&mut h, round);
        got.extend(records.drain());
    }
    let after = counters(&h);
    let moved: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    let half = u64::from(FLOWS) / 2;
    assert_eq!(
        moved,
        [half, half, 0, 0],
        "AllowPolicy, DropPolicy, RecordLimited, EventLost"
    );
    assert_eq!(got.len(), all.len());
    for ((_, sport, verdict), r) in all.iter().zip(&got) {
        let want = if *verdict == Verdict::Pass {
            AllowPolicy
        } else {
            DropPolicy
        };
        assert_eq!(
            (r.sport, r.reason, r.direction, r.endpoint_identity),
            (*sport, want as u8, INGRESS, POD),
            "{r:?}"
        );
    }
}
