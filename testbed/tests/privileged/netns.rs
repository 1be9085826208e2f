//! End to end on the real kernel: pods in their own network namespaces
//! behind routed veths of a simulated node, the classifier attached to the
//! host-side veths (TCX where the kernel has it; netlink clsact filters
//! below 6.6, where the tests assert that fallback, or when forced), real
//! TCP, UDP and ping. Enforcement must outlive the loader; removing it
//! restores traffic. Needs root.

use std::{net::IpAddr, time::Duration};

use aya::programs::{LinkOrder, TcAttachType};
use ipnet::IpNet;
use policy_agent::{
    datapath::bpf::{
        attach::AttachMode,
        kernel_features,
        loader::{LoadOptions, PinnedClassifier},
        pins::{Hook, PinLayout},
        reset::reset,
    },
    mapstate::{MapState, diff},
};
use policy_common::{
    direction::INGRESS,
    endpoint::{ATTACH_TCX, ENDPOINT_INGRESS_ISOLATED, EndpointInfo},
    identity::{NODE, WORLD},
    ipcache::IpcacheEntry,
    policy::{PolicyEntry, PolicyKey},
    proto::TCP,
};
use policy_testbed::fixtures::{
    deadline::scaled,
    tcx::{self, kernel_has_tcx},
};
use policy_testbed::{
    NODE_ROW, NODE_V4, NODE_V6, Servers, SimNode, SimPod, Target, Transport, cleanup_prefix,
};

const A: u32 = 300;
const B: u32 = 301;
const C: u32 = 302;
/// How long the probes of one matrix wait, on the host ([`scaled`]).
const TIMEOUT: Duration = Duration::from_millis(400);
/// Cells expected open that failed are probed again with this timeout
/// (twice at most); cells expected blocked are judged once.
const RETRY_TIMEOUT: Duration = Duration::from_millis(1500);

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn pods() -> Vec<SimPod> {
    ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, name)| SimPod {
            namespace: "default".into(),
            name: (*name).into(),
            ips: vec![
                ip(&format!("10.244.0.{}", 10 + i)),
                ip(&format!("fd00:244::{}", 10 + i)),
            ],
            tcp_ports: vec![80, 8080],
            udp_ports: vec![53],
        })
        .collect()
}

/// Removes the namespaces and pins even when an assertion fails.
struct Cleanup {
    prefix: &'static str,
    layout: PinLayout,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = reset(&self.layout);
        let _ = std::fs::remove_dir_all(self.layout.root());
        cleanup_prefix(self.prefix);
    }
}

/// A simulated node of `prefix` with its servers and a pin directory,
/// all removed when the guard drops.
fn fixture(prefix: &'static str) -> (PinLayout, Cleanup, SimNode, Servers) {
    let layout = PinLayout::new(format!("/sys/fs/bpf/policy-agent-test-{prefix}"));
    let cleanup = Cleanup {
        prefix,
        layout: layout.clone(),
    };
    cleanup_prefix(prefix);
    let node = SimNode::create(prefix, &pods()).unwrap();
    let servers = Servers::start(&node).unwrap();
    (layout, cleanup, node, servers)
}

/// "a" isolated for ingress, reachable only from "b" on TCP 80.
fn desired(node: &SimNode) -> (MapState<u32>, Vec<(u32, String)>) {
    let ids = [A, B, C];
    let mut state = MapState::default();
    let mut ifaces = Vec::new();
    let ifindexes: Vec<u32> = node
        .pods
        .iter()
        .map(|p| ifindex_of(node, &p.host_if))
        .collect();
    for (i, p) in node.pods.iter().enumerate() {
        let flags = if p.pod.name == "a" {
            ENDPOINT_INGRESS_ISOLATED
        } else {
            0
        };
        state.endpoints.insert(
            ifindexes[i],
            EndpointInfo {
                identity: ids[i],
                flags,
                revision: 1,
                ..Default::default()
            }
            .with_addresses(&p.pod.ips),
        );
        for addr in &p.pod.ips {
            let len = if addr.is_ipv4() { 32 } else { 128 };
            state.ipcache.insert(
                IpNet::new(*addr, len).unwrap(),
                IpcacheEntry {
                    identity: ids[i],
                    cidr_identity: WORLD,
                },
            );
        }
        ifaces.push((ifindexes[i], p.pod.id()));
    }
    for n in [IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)] {
        let len = if n.is_ipv4() { 32 } else { 128 };
        state.ipcache.insert(
            IpNet::new(n, len).unwrap(),
            IpcacheEntry {
                identity: NODE,
                cidr_identity: WORLD,
            },
        );
    }
    state.policy.insert(
        PolicyKey::new(A, INGRESS, B, TCP, 16, 80),
        PolicyEntry::default(),
    );
    state.finalize();
    (state, ifaces)
}

/// Whether the running kernel has TCX (Linux 6.6), read independently of
/// the agent's own probe.
/// Loads, fills and attaches from a thread inside the node namespace, then
/// drops every handle: what is left is what the pins hold. Returns how it
/// attached.
fn enforce(node: &SimNode, layout: &PinLayout, tcx: bool) -> AttachMode {
    let (state, ifaces) = desired(node);
    let layout = layout.clone();
    node.node
        .spawn(move || {
            let mut dp = PinnedClassifier::open(
                &layout,
                &LoadOptions {
                    tcx,
                    ..Default::default()
                },
            )
            .unwrap();
            let old = dp.maps().read_state().unwrap();
            dp.maps_mut().apply(&diff(&old, &state)).unwrap();
            for (ifindex, name) in ifaces {
                dp.attach(ifindex, &name).unwrap();
            }
            dp.mode()
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

/// "a" isolated for ingress, reachable only from "b" on TCP 80; the node
/// reaches every pod; everything else open. `to` is a pod id, `from` a pod
/// id or the node row.
fn enforced(from: &str, to: &str, port: u16, t: Transport) -> bool {
    from == NODE_ROW
        || from == to
        || to != "default/a"
        || (from == "default/b" && port == 80 && t == Transport::Tcp)
}

/// Probes every pod's ports and ping from every pod and the node, judged
/// where the traffic arrives: open is the request reaching the pod and the
/// reply coming back, blocked is nothing reaching it (a datapath that let
/// a forbidden SYN, datagram or echo request in and dropped only the
/// reply would fail here).
fn assert_matrix(
    node: &SimNode,
    servers: &Servers,
    what: &str,
    expect: impl Fn(&str, &str, u16, Transport) -> bool,
) {
    let by_target = |f: &str, t: &Target, _v6: bool| expect(f, &t.pod, t.port, t.transport);
    let (m, wrong) = node
        .judge_matrix(
            servers,
            true,
            scaled(TIMEOUT),
            scaled(RETRY_TIMEOUT),
            2,
            &by_target,
        )
        .unwrap();
    assert!(
        wrong.is_empty(),
        "{what}: {} cell(s) wrong:\n{}\nmatrix:\n{m}",
        wrong.len(),
        wrong.join("\n")
    );
    // The cells the policy is about were all probed, both families.
    for (from, port, t) in [
        ("default/b", 80, Transport::Tcp),
        ("default/b", 8080, Transport::Tcp),
        ("default/b", 53, Transport::Udp),
        ("default/b", 0, Transport::Ping),
        ("default/c", 80, Transport::Tcp),
        (NODE_ROW, 8080, Transport::Tcp),
    ] {
        let target = Target {
            pod: "default/a".into(),
            port,
            transport: t,
        };
        for v6 in [false, true] {
            assert!(
                m.get(from, &target, v6).is_some(),
                "{from} -> {target} probed"
            );
        }
    }
}

fn scenario(prefix: &'static str, tcx: bool) {
    let (layout, _cleanup, node, servers) = fixture(prefix);

    let open = |_: &str, _: &str, _: u16, _: Transport| true;
    assert_matrix(&node, &servers, "before", open);
    let mode = enforce(&node, &layout, tcx);
    // TCX when asked for and the kernel has it (6.6); netlink filters
    // otherwise.
    let expected = if kernel_has_tcx() && tcx {
        AttachMode::Tcx
    } else {
        AttachMode::Netlink
    };
    assert_eq!(mode, expected, "attach path on this kernel");
    eprintln!("attached with {mode:?}");
    if mode == AttachMode::Netlink {
        assert_our_filters(&node);
    } else {
        // TCX links are no tc filters.
        for p in &node.pods {
            for hook in Hook::BOTH {
                let listing = tc_filters(&node, &p.host_if, hook.name());
                assert!(filter_prefs(&listing).is_empty(), "{listing}");
            }
        }
    }
    // The loader is gone (every fd dropped): the pins keep enforcing.
    assert_matrix(&node, &servers, "enforced", enforced);

    // Opening again adopts the pinned state and changes nothing.
    enforce(&node, &layout, tcx);
    assert_matrix(&node, &servers, "enforced again", enforced);

    // Reset removes everything: traffic is open again, no pins remain.
    let layout2 = layout.clone();
    node.node
        .spawn(move || reset(&layout2).unwrap())
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    assert!(!layout.exists(), "pins removed");
    assert_matrix(&node, &servers, "after reset", open);
    if mode == AttachMode::Netlink {
        for p in &node.pods {
            for hook in ["ingress", "egress"] {
                let out = tc_filters(&node, &p.host_if, hook);
                assert!(
                    out.trim().is_empty(),
                    "no filters left on {} {hook}: {out}",
                    p.host_if
                );
            }
        }
    }
}

/// Our filter, and only ours, on every pod's host-side interface in both
/// directions: priority 20, handle 0x4e50, direct-action, our program.
fn assert_our_filters(node: &SimNode) {
    for p in &node.pods {
        for hook in Hook::BOTH {
            let listing = tc_filters(node, &p.host_if, hook.name());
            let prefs = filter_prefs(&listing);
            assert_eq!(
                prefs.len(),
                1,
                "one filter on {} {hook:?}:\n{listing}",
                p.host_if
            );
            assert_our_filter(prefs[0], hook, &p.host_if);
        }
    }
}

fn assert_our_filter((pref, line): (u32, &str), hook: Hook, interface: &str) {
    assert_eq!(pref, 20, "{interface} {hook:?}: {line}");
    for want in ["handle 0x4e50", hook.program(), "direct-action"] {
        assert!(
            line.contains(want),
            "our filter on {interface} {hook:?} shows {want:?}: {line}"
        );
    }
}

#[test]
fn the_kernel_offers_what_the_classifier_needs() {
    let kernel = kernel_features::probe();
    assert_eq!(kernel.missing_line(), None, "{kernel:#?}");
    assert_eq!(kernel.tcx(), kernel_has_tcx(), "{kernel:#?}");
    assert!(kernel.has("LPM trie maps") && kernel.has("BPF ring buffers"));
    // Below 6.6 the one fallback is named, with what replaces TCX.
    let fallbacks = kernel.fallbacks();
    if kernel_has_tcx() {
        assert!(fallbacks.is_empty(), "{fallbacks:?}");
    } else {
        assert_eq!(
            fallbacks,
            ["TCX links (bpf_link attachment to tc) (Linux 6.6) absent: netlink clsact filters"],
        );
    }
    eprintln!(
        "kernel {}: fallbacks {:?}",
        kernel.release,
        kernel.fallbacks()
    );
}

fn ifindex_of(node: &SimNode, interface: &str) -> u32 {
    let out = node.node.ip(&["-o", "link", "show", interface]).unwrap();
    out.split(':').next().unwrap().trim().parse().unwrap()
}

/// Runs the agent's order check ([`PinnedClassifier::check_order`]) on every
/// pod interface, from inside the node: how many moved to TCX, and how
/// many hooks still have something foreign ahead of the classifier.
fn order_check(node: &SimNode, layout: &PinLayout) -> (usize, usize) {
    let layout = layout.clone();
    let ifindexes: Vec<u32> = node
        .pods
        .iter()
        .map(|p| ifindex_of(node, &p.host_if))
        .collect();
    node.node
        .spawn(move || {
            let mut dp = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
            let mut counts = (0, 0);
            for i in ifindexes {
                let check = dp.check_order(i);
                if let Some(moved) = check.moved {
                    assert!(moved.unwrap().is_empty(), "no filter left behind");
                    counts.0 += 1;
                }
                counts.1 += check.ahead.len();
            }
            counts
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

/// Under TCX a program earlier in the chain that returns `TC_ACT_OK` ends
/// it: ours attaches first, so a foreign program that accepts everything
/// cannot pass a packet unjudged; one that jumps ahead later is reported.
///
/// Without TCX (below 6.6) the agent attaches netlink filters on its own,
/// and the order is by priority: see [`foreign_filters_after_ours`].
#[test]
fn the_classifier_runs_before_foreign_tcx_programs() {
    if !kernel_has_tcx() {
        eprintln!("no TCX on this kernel: checking the netlink fallback's order");
        foreign_filters_after_ours("e2efrn", true);
        return;
    }
    let prefix = "e2efrn";
    let (layout, _cleanup, node, servers) = fixture(prefix);
    let ifaces: Vec<String> = node.pods.iter().map(|p| p.host_if.clone()).collect();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (step_tx, step_rx) = std::sync::mpsc::channel::<bool>();
    // The foreign program lives (attached) as long as this thread waits.
    let foreign = node
        .node
        .spawn(move || {
            let mut dp = policy_agent::datapath::bpf::unpinned::Unpinned::load().unwrap();
            tcx::attach_foreign(
                &mut dp,
                "foreign_pass",
                &ifaces,
                &tcx::BOTH,
                LinkOrder::default,
            );
            ready_tx.send(()).unwrap();
            // Told to jump ahead of ours: another program, attached first.
            if step_rx.recv() == Ok(true) {
                let ingress = [TcAttachType::Ingress];
                tcx::attach_foreign(&mut dp, "floor_empty", &ifaces, &ingress, LinkOrder::first);
                ready_tx.send(()).unwrap();
                let _ = step_rx.recv();
            }
        })
        .unwrap();
    ready_rx.recv().unwrap();
    assert_eq!(enforce(&node, &layout, true), AttachMode::Tcx);
    assert_matrix(&node, &servers, "enforced", enforced);
    let reported = |node: &SimNode| order_check(node, &layout).1;
    assert_eq!(reported(&node), 0, "ours runs first");
    step_tx.send(true).unwrap();
    ready_rx.recv().unwrap();
    assert_eq!(
        reported(&node),
        node.pods.len(),
        "a program that jumped ahead is reported on every interface"
    );
    step_tx.send(false).unwrap();
    foreign.join().unwrap().unwrap();
}

/// The default netlink filters on a kernel with TCX: a foreign TCX
/// program runs before every clsact filter, so one that accepts
/// everything passes what the policy denies. The agent's order check
/// moves such an interface to TCX links, first in the chain, and the
/// policy holds again with the foreign program still attached.
#[test]
fn foreign_tcx_programs_make_netlink_filters_move_to_tcx() {
    if !kernel_has_tcx() {
        eprintln!("no TCX on this kernel: no TCX program can run ahead");
        return;
    }
    let prefix = "e2efmv";
    let (layout, _cleanup, node, servers) = fixture(prefix);
    let ifaces: Vec<String> = node.pods.iter().map(|p| p.host_if.clone()).collect();
    let foreign = tcx::Foreign::attach(&node.node, "foreign_pass", ifaces, LinkOrder::default);
    assert_eq!(enforce(&node, &layout, false), AttachMode::Netlink);
    assert_our_filters(&node);
    let open = |_: &str, _: &str, _: u16, _: Transport| true;
    assert_matrix(&node, &servers, "foreign TCX ahead of our filters", open);
    assert_eq!(
        order_check(&node, &layout),
        (node.pods.len(), 0),
        "every interface moves, and then nothing runs ahead"
    );
    for p in &node.pods {
        for hook in Hook::BOTH {
            let listing = tc_filters(&node, &p.host_if, hook.name());
            assert!(
                filter_prefs(&listing).is_empty(),
                "our filters are gone: {listing}"
            );
        }
    }
    assert_matrix(&node, &servers, "moved to TCX, first", enforced);
    // A later check finds nothing to do.
    assert_eq!(order_check(&node, &layout), (0, 0));
    drop(foreign);
}

/// The uplink classifier under the default netlink filters: our own pod
/// filter ahead of it on a veth that carries both is not foreign, and a
/// foreign TCX program on an uplink makes the order check move it to TCX
/// links, first in the chain (a pod's packet to a Service whose backend is
/// reached through there would otherwise pass unjudged).
#[test]
fn the_uplink_classifier_is_order_checked_too() {
    let prefix = "e2eupo";
    let (layout, _cleanup, node, _servers) = fixture(prefix);
    let both = ifindex_of(&node, &node.pods[0].host_if);
    let uplink_if = node.pods[1].host_if.clone();
    let uplink = ifindex_of(&node, &uplink_if);
    let tcx = kernel_has_tcx();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    // The foreign program stays attached as long as this thread waits.
    let foreign = node
        .node
        .spawn(move || {
            let mut dp = policy_agent::datapath::bpf::unpinned::Unpinned::load().unwrap();
            if tcx {
                let egress = [TcAttachType::Egress];
                tcx::attach_foreign(
                    &mut dp,
                    "foreign_pass",
                    &[uplink_if],
                    &egress,
                    LinkOrder::default,
                );
            }
            ready_tx.send(()).unwrap();
            let _ = done_rx.recv();
        })
        .unwrap();
    ready_rx.recv().unwrap();
    let checked = node
        .node
        .spawn(move || {
            let mut dp = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
            dp.attach(both, "x/a").unwrap();
            dp.attach_uplink(both, "uplink a", &[Hook::Uplink, Hook::UplinkIngress])
                .unwrap();
            let own = dp.foreign_ahead(both);
            dp.attach_uplink(uplink, "uplink b", &[Hook::Uplink])
                .unwrap();
            let before = dp.foreign_ahead(uplink).len();
            let check = dp.check_order(uplink);
            let bits = dp.maps().meta(uplink).unwrap().attach;
            (own, before, check, bits)
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    let (own, before, check, bits) = checked;
    assert!(own.is_empty(), "our own filters are not foreign: {own:?}");
    if tcx {
        assert_eq!(
            before, 1,
            "the foreign TCX program is ahead of the uplink filter"
        );
        assert!(
            matches!(&check.moved, Some(Ok(left)) if left.is_empty()),
            "{check:?}"
        );
        assert!(check.ahead.is_empty(), "{check:?}");
        assert_ne!(bits & ATTACH_TCX, 0, "moved to TCX ({bits:#x})");
        let listing = tc_filters(&node, &node.pods[1].host_if, "egress");
        assert!(
            filter_prefs(&listing).is_empty(),
            "our filter is gone: {listing}"
        );
    } else {
        assert_eq!(before, 0);
        assert!(check.moved.is_none() && check.ahead.is_empty(), "{check:?}");
    }
    drop(done_tx);
    foreign.join().unwrap().unwrap();
}

/// Netlink clsact filters (the default; below 6.6 also with `--attach tcx`): ours on
/// every host-side interface in both directions at priority 20, handle
/// 0x4e50, direct-action, ahead of a foreign filter at priority 30 that
/// accepts everything. Ours drops what the policy denies before the
/// foreign one could pass it; what ours passes (`TC_ACT_UNSPEC`) goes on
/// to it. A foreign filter added later at a lower priority number runs
/// first: the agent cannot undo it, and reports it.
#[test]
fn netlink_filters_run_before_foreign_filters_of_a_later_priority() {
    foreign_filters_after_ours("e2efnl", false);
}

/// `tc filter show dev <interface> <hook>` in the node namespace.
fn tc_filters(node: &SimNode, interface: &str, hook: &str) -> String {
    policy_testbed::run(
        "nsenter",
        &[
            &format!("--net={}", node.node.path().display()),
            "tc",
            "filter",
            "show",
            "dev",
            interface,
            hook,
        ],
    )
    .unwrap()
}

/// The priority (`pref`) of each filter line, in the order `tc` lists
/// them (the order the kernel runs them), with the line.
fn filter_prefs(listing: &str) -> Vec<(u32, &str)> {
    listing
        .lines()
        .filter(|l| l.starts_with("filter") && l.contains(" handle "))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "pref")?;
            Some((words.next()?.parse().ok()?, l))
        })
        .collect()
}

fn foreign_filters_after_ours(prefix: &'static str, tcx: bool) {
    use aya::programs::{
        TcAttachType,
        tc::{self, NlOptions, TcAttachOptions, TcHandle},
    };
    let (layout, _cleanup, node, servers) = fixture(prefix);
    let ifaces: Vec<String> = node.pods.iter().map(|p| p.host_if.clone()).collect();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (step_tx, step_rx) = std::sync::mpsc::channel::<bool>();
    // The foreign filters live as long as this thread waits (they go
    // when its handles drop, or with the namespace on a failure).
    let foreign = node
        .node
        .spawn(move || {
            let mut dp = policy_agent::datapath::bpf::unpinned::Unpinned::load().unwrap();
            let prog = dp.extra_program("foreign_pass").unwrap();
            for i in &ifaces {
                tc::qdisc_add_clsact(i).unwrap();
                for t in [TcAttachType::Ingress, TcAttachType::Egress] {
                    let options = NlOptions {
                        priority: 30,
                        handle: TcHandle::new(0, 0x77),
                        classid: None,
                    };
                    prog.attach_with_options(i, t, TcAttachOptions::Netlink(options))
                        .unwrap();
                }
            }
            ready_tx.send(()).unwrap();
            // Told to go ahead of ours: a filter at a lower priority
            // number, on ingress.
            if step_rx.recv() == Ok(true) {
                for i in &ifaces {
                    let options = NlOptions {
                        priority: 10,
                        handle: TcHandle::new(0, 0x78),
                        classid: None,
                    };
                    prog.attach_with_options(
                        i,
                        TcAttachType::Ingress,
                        TcAttachOptions::Netlink(options),
                    )
                    .unwrap();
                }
                ready_tx.send(()).unwrap();
                let _ = step_rx.recv();
            }
        })
        .unwrap();
    ready_rx.recv().unwrap();
    assert_eq!(
        enforce(&node, &layout, tcx),
        AttachMode::Netlink,
        "attach path on this kernel"
    );
    for p in &node.pods {
        for hook in Hook::BOTH {
            let listing = tc_filters(&node, &p.host_if, hook.name());
            let prefs = filter_prefs(&listing);
            assert_eq!(
                prefs.iter().map(|(pref, _)| *pref).collect::<Vec<_>>(),
                [20, 30],
                "ours at 20, the foreign one at 30, in that order on {} {hook:?}:\n{listing}",
                p.host_if
            );
            assert_our_filter(prefs[0], hook, &p.host_if);
            assert!(prefs[1].1.contains("foreign_pass"), "{listing}");
        }
    }
    assert_matrix(
        &node,
        &servers,
        "enforced, foreign filters after ours",
        enforced,
    );
    assert_eq!(order_check(&node, &layout), (0, 0), "nothing ahead");
    step_tx.send(true).unwrap();
    ready_rx.recv().unwrap();
    assert_eq!(
        order_check(&node, &layout),
        (0, node.pods.len()),
        "a filter at a lower priority number is reported on every interface, and nothing moves"
    );
    step_tx.send(false).unwrap();
    foreign.join().unwrap().unwrap();
}

/// TCX links where the kernel has them; below 6.6 the same scenario takes
/// the fallback on its own (`AttachMode::detect`) and asserts it did:
/// netlink filters, enforcing and outliving the loader.
#[test]
fn tcx_attachments_enforce_and_outlive_the_loader() {
    scenario("e2etcx", true);
}

/// The default.
#[test]
fn netlink_attachments_enforce_and_outlive_the_loader() {
    scenario("e2enl", false);
}

/// Pins written with a one-slot endpoint array keep ifindex 7 in the
/// overflow hash. Opened with a full-size array (its pin removed, as after
/// a layout change), the array shadows that hash entry: the writer drops
/// it on open, so the entry lives in one place and reads show what the
/// classifier sees.
#[test]
fn a_hash_endpoint_shadowed_by_the_array_is_dropped_when_a_writer_opens() {
    let layout = PinLayout::new("/sys/fs/bpf/policy-agent-test-kshadow");
    let _cleanup = Cleanup {
        prefix: "kshadow",
        layout: layout.clone(),
    };
    let _ = std::fs::remove_dir_all(layout.root());
    let ep = EndpointInfo {
        identity: A,
        flags: ENDPOINT_INGRESS_ISOLATED,
        revision: 1,
        ..Default::default()
    }
    .with_addresses(&[ip("10.244.0.10")]);
    let small = LoadOptions {
        capacities: vec![(policy_common::maps::ENDPOINT_SLOTS, 1)],
        ..LoadOptions::default()
    };
    {
        let mut dp = PinnedClassifier::open(&layout, &small).unwrap();
        let mut state = MapState::default();
        state.endpoints.insert(7, ep);
        let old = dp.maps().read_state().unwrap();
        dp.maps_mut().apply(&diff(&old, &state)).unwrap();
        let fill = dp.maps().fill();
        assert!(
            fill.contains(&(policy_common::maps::ENDPOINTS, 1, 4096)),
            "{fill:?}"
        );
    }
    std::fs::remove_file(layout.map(policy_common::maps::ENDPOINT_SLOTS)).unwrap();
    let dp = PinnedClassifier::open(&layout, &LoadOptions::default()).unwrap();
    let fill = dp.maps().fill();
    assert!(
        fill.contains(&(policy_common::maps::ENDPOINTS, 0, 4096)),
        "{fill:?}"
    );
    assert!(
        fill.contains(&(policy_common::maps::ENDPOINT_SLOTS, 0, 16384)),
        "{fill:?}"
    );
    assert_eq!(dp.maps().endpoint(7).unwrap(), None);
    assert!(dp.maps().read_state().unwrap().endpoints.is_empty());
}
