//! An upgrade across layout versions: the earlier layout's tracked flows
//! are carried into the new one (its pod's side local, judged again at
//! their first packet), and its pins go once the new agent has taken
//! over. The earlier map is made by bpftool, as the earlier agent left
//! it: one flow per direction it was opened, keyed as it travelled.
//! Needs root.
use std::process::Command;

use policy_agent::datapath::bpf::{
    earlier_layout,
    loader::{LoadOptions, PinnedClassifier},
    pins::PinLayout,
};
use policy_common::{
    LAYOUT_VERSION,
    conntrack::{CT_OPENER_EITHER, CtEntry, CtKey},
    direction::{EGRESS, INGRESS},
    family::IPV4,
    maps::CONNTRACK,
    proto::{ICMP, TCP, UDP},
};

const ROOT: &str = "/sys/fs/bpf/policy-agent-test-kupgrade";

/// Removes the test's pins, also when it fails.
struct Cleanup;

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(ROOT);
    }
}

fn v4(a: [u8; 4]) -> [u8; 16] {
    let mut out = [0; 16];
    out[..4].copy_from_slice(&a);
    out
}

/// A layout-3 key: the flow as its first packet travelled.
fn old_key(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, protocol: u8, dir: u8) -> Vec<u8> {
    let mut k = 7u32.to_le_bytes().to_vec();
    k.extend_from_slice(&v4(src));
    k.extend_from_slice(&v4(dst));
    k.extend_from_slice(&sport.to_le_bytes());
    k.extend_from_slice(&dport.to_le_bytes());
    k.extend_from_slice(&[protocol, IPV4, dir, 0]);
    k
}

fn entry_bytes(dir: u8) -> Vec<u8> {
    let mut v = 1_000u64.to_le_bytes().to_vec();
    v.extend_from_slice(&5u32.to_le_bytes());
    v.extend_from_slice(&[dir, 0, 0, 0]);
    v
}

fn hex(bytes: &[u8]) -> Vec<String> {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn bpftool(args: &[String]) {
    let out = Command::new("bpftool").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_upgrade_carries_the_tracked_flows_and_retires_the_earlier_pins() {
    let _cleanup = Cleanup;
    let _ = std::fs::remove_dir_all(ROOT);
    let layout = PinLayout::new(ROOT);
    layout.create_root().unwrap();
    let earlier = format!("{ROOT}/v3/maps");
    std::fs::create_dir_all(&earlier).unwrap();
    let map = format!("{earlier}/{CONNTRACK}");
    bpftool(
        &[
            "map",
            "create",
            &map,
            "type",
            "hash",
            "key",
            "44",
            "value",
            "16",
            "entries",
            "64",
            "name",
            "CONNTRACK",
        ]
        .map(String::from),
    );
    let (pod, peer) = ([10, 0, 0, 5], [10, 0, 1, 9]);
    let flows = [
        // The pod's connection out, the peer's query in, the peer's ping.
        (old_key(pod, 40000, peer, 80, TCP, EGRESS), EGRESS),
        (old_key(peer, 5353, pod, 53, UDP, INGRESS), INGRESS),
        (old_key(peer, 9, pod, 9, ICMP, INGRESS), INGRESS),
    ];
    for (key, dir) in &flows {
        let mut args: Vec<String> = ["map", "update", "pinned", &map, "key", "hex"]
            .map(String::from)
            .to_vec();
        args.extend(hex(key));
        args.extend(["value", "hex"].map(String::from));
        args.extend(hex(&entry_bytes(*dir)));
        bpftool(&args);
    }

    let dp = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
    let key = |local: [u8; 4], lport, remote: [u8; 4], rport, protocol, opener| CtKey {
        ifindex: 7,
        local: v4(local),
        remote: v4(remote),
        local_port: lport,
        remote_port: rport,
        protocol,
        family: IPV4,
        opener,
        _pad: 0,
    };
    let carried = [
        (key(pod, 40000, peer, 80, TCP, CT_OPENER_EITHER), EGRESS),
        (key(pod, 53, peer, 5353, UDP, CT_OPENER_EITHER), INGRESS),
        (key(pod, 9, peer, 9, ICMP, INGRESS), INGRESS),
    ];
    for (k, dir) in carried {
        let got: CtEntry = dp.maps().conntrack.get(&k, 0).unwrap();
        // Opened the same way, judged again at its first packet.
        assert_eq!((got.direction, got.revision), (dir, 0), "{k:?}");
    }
    assert_eq!(dp.maps().conntrack.keys().count(), 3);
    drop(dp);

    // This agent's pins stay; the earlier layout's go.
    assert!(earlier_layout::retire(&layout));
    assert!(!std::path::Path::new(&format!("{ROOT}/v3")).exists());
    assert!(layout.map(CONNTRACK).exists());
    assert!(earlier_layout::earlier(&layout).is_empty());
    assert_eq!(
        LAYOUT_VERSION, 4,
        "a new layout: carry its predecessor's flows"
    );
}
