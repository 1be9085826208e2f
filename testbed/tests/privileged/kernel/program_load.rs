//! A first start's programs go through the verifier in the background
//! while the maps are already in use; what waits for them, and what a
//! later start finds.
use aya::programs::SchedClassifier;
use policy_agent::{
    datapath::bpf::{
        loader::{LoadOptions, PinnedClassifier},
        object::object_hash,
        pins::{Hook, PinLayout},
        reset::reset,
    },
    mapstate::MapOp,
};
use policy_common::endpoint::{ENDPOINT_INGRESS_ISOLATED, EndpointInfo};

const PIN_DIR: &str = "/sys/fs/bpf/policy-agent-test-kbgload";

/// Removes the pins however the test ends.
struct Pins(PinLayout);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = reset(&self.0);
        let _ = std::fs::remove_dir_all(self.0.root());
    }
}

/// The kernel's id of each core program, as pinned.
fn pinned_ids(layout: &PinLayout) -> Vec<u32> {
    Hook::CORE
        .iter()
        .map(|h| {
            let prog = SchedClassifier::from_pin(layout.program(h.program())).unwrap();
            prog.info().unwrap().id()
        })
        .collect()
}

/// On fresh pins the maps take writes before the programs are through the
/// verifier; once waited for, the programs are pinned and recorded as this
/// object's, and the next start reuses them instead of loading again.
#[test]
fn programs_loaded_in_the_background_are_pinned_recorded_and_reused() {
    let layout = PinLayout::new(PIN_DIR);
    let _ = std::fs::remove_dir_all(layout.root());
    let _pins = Pins(layout.clone());
    let ep = EndpointInfo {
        identity: 7,
        flags: ENDPOINT_INGRESS_ISOLATED,
        revision: 1,
        ..Default::default()
    };
    let first = {
        let mut dp = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
        dp.maps_mut()
            .apply(&[MapOp::UpsertEndpoint(41, ep)])
            .unwrap();
        assert_eq!(dp.maps().endpoint(41).unwrap(), Some(ep));
        dp.wait_for_programs().unwrap();
        assert_eq!(dp.maps().config().unwrap().object_hash, object_hash());
        pinned_ids(&layout)
    };
    let mut again = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
    assert_eq!(again.maps().endpoint(41).unwrap(), Some(ep));
    again.wait_for_programs().unwrap();
    assert_eq!(pinned_ids(&layout), first, "the second start loaded again");
}

/// The verifier walks each pod program in a fraction of its budget: the
/// flow judgement and the policy probe are global functions, checked once
/// per program. Inlined at each place a flow is judged, the judgement took
/// `to_pod` to 616,439 of the 1,000,000 instructions the verifier
/// processes at most and `from_pod` to 380,916, and the first start's
/// load was most of its time. The bound holds on 6.18 and 6.1 alike.
#[test]
fn each_pod_program_verifies_its_flow_judgement_once() {
    const BOUND: u32 = 250_000;
    let layout = PinLayout::new("/sys/fs/bpf/policy-agent-test-kverified");
    let _ = std::fs::remove_dir_all(layout.root());
    let _pins = Pins(layout.clone());
    let mut dp = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
    dp.wait_for_programs().unwrap();
    for hook in Hook::BOTH {
        let prog = SchedClassifier::from_pin(layout.program(hook.program())).unwrap();
        let processed = prog.info().unwrap().verified_instruction_count();
        let processed = processed.expect("the kernel reports the instructions it processed");
        eprintln!("{}: {processed} instructions processed", hook.program());
        assert!(
            processed < BOUND,
            "{}: {processed} instructions processed (bound {BOUND})",
            hook.program()
        );
    }
}
