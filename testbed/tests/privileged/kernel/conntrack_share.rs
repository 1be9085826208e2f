//! One pod opening flows as fast as it can, and another pod's established
//! connections, in a conntrack map shared by both: without a bound the
//! flood evicts them (their replies are judged as new and dropped at the
//! isolated pod); with each pod's share bound, the flooder holds its share
//! and no more, and the other pod keeps every flow.
use policy_agent::datapath::bpf::{
    conntrack_share::{count, now_ns, share_for},
    pins::Hook,
};
use policy_common::{
    direction::{EGRESS, INGRESS},
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    identity::WORLD,
    maps::CONNTRACK,
    policy::PolicyKey,
    proto::TCP,
    verdict::Reason,
};
use policy_testbed::{
    fixtures::{
        harness::{Harness, OTHER, PEER, POD, Verdict, ip},
        testns::TestNs,
    },
    packet::{Packet, TCP_ACK, TCP_RST, TCP_SYN},
};

const VICTIM_IF: u32 = 21;
const FLOODER_IF: u32 = 22;
const VICTIM: &str = "10.0.0.10";
const FLOODER: &str = "10.0.2.30";
const SERVER: &str = "10.0.1.20";
/// Entries in the conntrack map, and the victim's connections.
const CAPACITY: u32 = 1024;
const CONNECTIONS: u16 = 64;
/// The flood: four times the map.
const FLOOD: u32 = 4 * CAPACITY;

/// A node with the victim (isolated both ways, allowed to the server) and
/// the flooder (isolated for egress, allowed to the server), each on an
/// interface of its own. `share`: the bound, counted once (None: off).
fn node(tag: &str, share: Option<u32>) -> (Harness, TestNs) {
    let ns = TestNs::enter(tag);
    ns.device("victim", VICTIM_IF);
    ns.device("flooder", FLOODER_IF);
    let mut h = Harness::with_capacities(&[(CONNTRACK, CAPACITY)]);
    let both = ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED;
    h.endpoint_at(VICTIM_IF, POD, both, 1, &[ip(VICTIM)]);
    h.endpoint_at(
        FLOODER_IF,
        OTHER,
        ENDPOINT_EGRESS_ISOLATED,
        1,
        &[ip(FLOODER)],
    );
    h.ipcache(&format!("{VICTIM}/32"), POD, WORLD);
    h.ipcache(&format!("{FLOODER}/32"), OTHER, WORLD);
    h.ipcache(&format!("{SERVER}/32"), PEER, WORLD);
    h.allow(PolicyKey::new(POD, EGRESS, PEER, TCP, 0, 0));
    h.allow(PolicyKey::new(OTHER, EGRESS, PEER, TCP, 0, 0));
    h.sync();
    if let Some(share) = share {
        count(&mut h.dp.maps, share, now_ns()).unwrap();
    }
    (h, ns)
}

/// The victim's connections to the server, handshake done.
fn connect(h: &mut Harness) {
    let syns: Vec<_> = (0..CONNECTIONS)
        .map(|i| Packet::tcp(ip(VICTIM), 30000 + i, ip(SERVER), 443, TCP_SYN).frame())
        .collect();
    let answers: Vec<_> = (0..CONNECTIONS)
        .map(|i| Packet::tcp(ip(SERVER), 443, ip(VICTIM), 30000 + i, TCP_SYN | TCP_ACK).frame())
        .collect();
    assert!(
        h.run_many_at(Hook::Ingress, &syns, VICTIM_IF)
            .iter()
            .all(|v| *v == Verdict::Pass)
    );
    assert!(
        h.run_many_at(Hook::Egress, &answers, VICTIM_IF)
            .iter()
            .all(|v| *v == Verdict::Pass),
        "the handshakes complete"
    );
}

/// The flooder's new flows, each a SYN and a second segment (a flow its
/// pod uses again, as the kernel's LRU keeps what is used over what is
/// not); `round` keeps rounds apart.
fn flood(h: &mut Harness, round: u32) {
    let syns: Vec<_> = (0..FLOOD)
        .flat_map(|i| {
            let n = round * FLOOD + i;
            let sport = 1024 + (n % 60000) as u16;
            let dport = 1024 + (n / 60000) as u16;
            [TCP_SYN, TCP_ACK]
                .map(|flags| Packet::tcp(ip(FLOODER), sport, ip(SERVER), dport, flags).frame())
        })
        .collect();
    assert!(
        h.run_many_at(Hook::Ingress, &syns, FLOODER_IF)
            .iter()
            .all(|v| *v == Verdict::Pass),
        "the flooder's egress allows every SYN (tracked or not)"
    );
}

/// How many of the victim's connections still get the server's segments.
fn alive(h: &mut Harness) -> usize {
    let acks: Vec<_> = (0..CONNECTIONS)
        .map(|i| Packet::tcp(ip(SERVER), 443, ip(VICTIM), 30000 + i, TCP_ACK).frame())
        .collect();
    h.run_many_at(Hook::Egress, &acks, VICTIM_IF)
        .iter()
        .filter(|v| **v == Verdict::Pass)
        .count()
}

fn held(h: &Harness, ifindex: u32) -> usize {
    h.dp.maps
        .conntrack
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.ifindex == ifindex)
        .count()
}

fn counted(h: &Harness, reason: Reason, dir: u8) -> u64 {
    h.dp.maps
        .counters()
        .unwrap()
        .get(&(reason, dir))
        .copied()
        .unwrap_or(0)
}

/// The harm, measured: without a bound, a flood of four times the map
/// between two segments of the victim's connections leaves the victim
/// few of them (here, with LRU's per-CPU caches, typically none).
#[test]
fn without_a_share_a_flood_evicts_another_pods_connections() {
    let (mut h, _ns) = node("ctflood", None);
    connect(&mut h);
    assert_eq!(alive(&mut h), CONNECTIONS as usize);
    flood(&mut h, 0);
    let kept = alive(&mut h);
    eprintln!(
        "no share: {kept} of {CONNECTIONS} connections kept after a flood of {FLOOD} flows in a map of {CAPACITY}"
    );
    assert!(
        kept < CONNECTIONS as usize / 2,
        "the flood evicted most connections ({kept} kept)"
    );
}

/// With the default share (a quarter of the map), the same flood: the
/// flooder holds its share and no more, its other flows are counted and
/// not tracked, and the victim keeps every connection. Once the flooder's
/// entries expire, a count sweeps them and the flooder may open as many
/// again.
#[test]
fn a_flooding_pod_holds_its_share_and_no_more() {
    let share = share_for(None, CAPACITY);
    assert_eq!(share, CAPACITY / 4);
    let (mut h, _ns) = node("ctshare", Some(share));
    connect(&mut h);
    let refused_before = counted(&h, Reason::CtShareFull, EGRESS);
    flood(&mut h, 0);
    assert_eq!(
        alive(&mut h),
        CONNECTIONS as usize,
        "the victim kept them all"
    );
    assert_eq!(held(&h, FLOODER_IF), share as usize);
    assert_eq!(
        counted(&h, Reason::CtShareFull, EGRESS) - refused_before,
        u64::from(FLOOD - share),
        "every flow past the share was counted, not tracked"
    );
    assert_eq!(counted(&h, Reason::CtShareFull, INGRESS), 0);

    // The flooder resets its tracked connections; a count after their
    // closing entries expired (10 s) sweeps them, and the victim's
    // established ones stay.
    let resets: Vec<_> = (0..share)
        .map(|n| {
            let sport = 1024 + n as u16;
            Packet::tcp(ip(FLOODER), sport, ip(SERVER), 1024, TCP_RST | TCP_ACK).frame()
        })
        .collect();
    h.run_many_at(Hook::Ingress, &resets, FLOODER_IF);
    let later = now_ns() + 11 * 1_000_000_000;
    let c = count(&mut h.dp.maps, share, later).unwrap();
    assert_eq!(c.swept, share as usize);
    assert_eq!(c.held.get(&VICTIM_IF), Some(&u64::from(CONNECTIONS)));
    assert_eq!(c.held.get(&FLOODER_IF), None);
    assert_eq!(held(&h, FLOODER_IF), 0);
    // Stamped on the classifier's clock again, the flooder opens a
    // share's worth once more.
    count(&mut h.dp.maps, share, now_ns()).unwrap();
    flood(&mut h, 1);
    assert_eq!(held(&h, FLOODER_IF), share as usize);
    assert_eq!(alive(&mut h), CONNECTIONS as usize);
}

/// A bound the agent stopped counting for binds no more (a minute after
/// the last count): the map is shared as without one, rather than every
/// busy pod refused for good.
#[test]
fn a_share_not_counted_for_a_minute_binds_no_more() {
    let share = 16;
    let (mut h, _ns) = node("ctstale", None);
    // Wrapping: a guest just booted has a clock under a minute.
    let long_ago = now_ns().wrapping_sub(61 * 1_000_000_000);
    count(&mut h.dp.maps, share, long_ago).unwrap();
    flood(&mut h, 0);
    assert!(held(&h, FLOODER_IF) > share as usize * 4);
}
