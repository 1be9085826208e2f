//! Reading the maps back: what a restart and every full pass over maps
//! read back rely on.
use policy_common::{
    direction::INGRESS,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    identity::WORLD,
    policy::PolicyKey,
    proto::TCP,
};
use policy_testbed::fixtures::harness::{Harness, PEER, POD};

const BOTH: u32 = ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED;

fn ingress_key(peer: u32, protocol: u8, len: u8, port: u16) -> PolicyKey {
    PolicyKey::new(POD, INGRESS, peer, protocol, len, port)
}

/// The maps read back in batches (several per map: more entries than one
/// batch holds) hold what was written, as reading them entry by entry
/// finds; so does a map with a single entry.
#[test]
fn maps_read_back_in_batches_hold_what_was_written() {
    let mut h = Harness::new();
    h.endpoint(POD, BOTH, 1);
    for peer in 0..3_000u32 {
        h.allow(ingress_key(PEER + peer, TCP, 16, 80));
    }
    for i in 0..2_500u32 {
        h.ipcache(&format!("10.9.{}.{}/32", i / 256, i % 256), PEER, WORLD);
    }
    h.ipcache("fd00::9/128", PEER, WORLD);
    h.sync();
    let read = h.dp.maps.read_state().unwrap();
    assert_eq!(read.policy.len(), 3_000);
    assert_eq!(read.policy, h.state.policy);
    assert_eq!(read.ipcache, h.state.ipcache);
    assert_eq!(read.endpoints, h.state.endpoints);
    let one_by_one: std::collections::BTreeMap<_, _> =
        h.dp.maps
            .policy
            .iter()
            .map(|entry| entry.unwrap())
            .collect();
    assert_eq!(read.policy, one_by_one);
}
