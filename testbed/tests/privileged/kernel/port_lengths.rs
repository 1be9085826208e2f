//! The port-prefix lengths the probe tests: the seven the agent writes
//! (`PORT_PREFIX_LENGTHS`), each found, and an entry of any other length
//! (an older agent's, still in the pins after an upgrade) still found.
use policy_agent::datapath::bpf::pins::Hook;
use policy_common::{
    direction::INGRESS,
    endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED},
    policy::{PORT_PREFIX_LENGTHS, PolicyKey, port_mask},
    proto::TCP,
};
use policy_testbed::fixtures::harness::{
    Harness, PEER, POD,
    Verdict::{Drop, Pass},
    ip,
};
use policy_testbed::packet::{Packet, TCP_SYN};

const BOTH: u32 = ENDPOINT_INGRESS_ISOLATED | ENDPOINT_EGRESS_ISOLATED;

fn syn_to(port: u16) -> Vec<u8> {
    Packet::tcp(ip("10.0.1.20"), 40000, ip("10.0.0.10"), port, TCP_SYN).frame()
}

/// The first and last port of the block of `len` bits holding `port`.
fn block(len: u8, port: u16) -> (u16, u16) {
    let first = port & port_mask(len);
    (first, first | !port_mask(len))
}

#[test]
fn each_length_the_agent_writes_is_probed_and_covers_its_block_only() {
    // One block per length but 0, apart from each other: 0x1000-aligned
    // regions, each block at the start of its own region.
    for (i, &len) in PORT_PREFIX_LENGTHS.iter().filter(|&&l| l > 0).enumerate() {
        let mut h = Harness::new();
        h.cluster(BOTH);
        let base = 0x1000 * (i as u16 + 1);
        // Every given length present, so the probe takes the path of the
        // agent's lengths; only the block under test is near `base`.
        for &other in PORT_PREFIX_LENGTHS.iter().filter(|&&l| l > 0 && l != len) {
            h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, other, 0xf000));
        }
        h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, len, base));
        h.sync();
        let (first, last) = block(len, base);
        for (port, want) in [
            (first - 1, Drop),
            (first, Pass),
            (last, Pass),
            (last + 1, Drop),
        ] {
            assert_eq!(
                h.run(Hook::Egress, &syn_to(port)),
                want,
                "length {len}, port {port} (block {first}-{last})"
            );
        }
    }
}

#[test]
fn an_entry_of_a_length_the_agent_never_writes_is_still_probed() {
    let mut h = Harness::new();
    h.cluster(BOTH);
    // 8000-8007 (length 13) beside the agent's lengths 16 and 12
    // (7008-7023).
    h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, 13, 8000));
    h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, 16, 9000));
    h.allow(PolicyKey::new(POD, INGRESS, PEER, TCP, 12, 7008));
    h.sync();
    for (port, want) in [
        (7999, Drop),
        (8000, Pass),
        (8007, Pass),
        (8008, Drop),
        (9000, Pass),
        (7007, Drop),
        (7008, Pass),
        (7023, Pass),
        (7024, Drop),
    ] {
        assert_eq!(h.run(Hook::Egress, &syn_to(port)), want, "port {port}");
    }
}
