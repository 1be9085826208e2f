//! The chained CNI plugin end to end: Debian's real ptp + host-local
//! create each pod's veth and address in namespaces this test makes, the
//! plugin runs after them as a runtime runs it (the `sim::cni` driver, in
//! the node's namespace), and a stand-in agent answers on the socket.
//! Needs root and containernetworking-plugins (scripts/setup.sh).

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use policy_cni::protocol::{Command, HostInterface, PodId, code};
use policy_testbed::cni_runtime::{CniError, CniRuntime, Sandbox};
use policy_testbed::fixtures::cni::{Answer, Fixture, StandIn};
use serde_json::{Value, json};

/// What our plugin's ADD cost (its own invocation, nsenter included).
fn our_add(rt: &CniRuntime) -> Duration {
    rt.take_log()
        .into_iter()
        .find(|i| i.plugin == "policy-cni" && i.command == "ADD")
        .map(|i| i.elapsed)
        .expect("policy-cni ran")
}

/// ADD fails with "try again later", our plugin having waited at least
/// `at_least` (its timeout) and not much longer.
fn assert_add_times_out(rt: &CniRuntime, sb: &mut Sandbox, at_least: Duration, what: &str) {
    let err = rt.add(sb).unwrap_err();
    assert_eq!(
        err.code(),
        Some(u64::from(code::TRY_AGAIN)),
        "{what}: {err}"
    );
    let took = our_add(rt);
    assert!(
        took >= at_least && took < Duration::from_millis(2500),
        "{what}: {took:?}"
    );
}

/// The pod's addresses in its namespace (global scope).
fn pod_addresses(sb: &Sandbox) -> Vec<IpAddr> {
    let out = sb.netns.ip(&["-j", "addr", "show", "dev", "eth0"]).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    let mut ips: Vec<IpAddr> = v[0]["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["scope"] == "global")
        .map(|a| a["local"].as_str().unwrap().parse().unwrap())
        .collect();
    ips.sort();
    ips
}

/// ADD is held until the agent confirms, then returns ptp's result in the
/// list's version, unchanged; the agent was told the pod, the real host
/// veth (name and ifindex in the node's namespace) and the pod's
/// addresses. DEL tells it to forget and releases everything, in reverse.
#[test]
fn add_is_held_until_the_agent_confirms_and_returns_prev_result_in_every_version() {
    for (i, (version, dual)) in [("0.3.1", false), ("0.4.0", false), ("1.0.0", true)]
        .into_iter()
        .enumerate()
    {
        let prefix: &'static str = ["cniv31", "cniv40", "cniv100"][i];
        let fx = Fixture::new(prefix);
        let confirm_after = Duration::from_millis(300);
        let agent = StandIn::start(fx.socket(), move |_| Answer::Confirm(confirm_after));
        let rt = fx.runtime(version, 5.0, dual);
        let mut sb = fx.sandbox(&rt, "web-0");

        let result = rt.add(&mut sb).unwrap_or_else(|e| panic!("{version}: {e}"));
        let log = rt.take_log();
        let ours = log.iter().find(|i| i.plugin == "policy-cni").unwrap();
        let before = log
            .iter()
            .rev()
            .find(|i| i.plugin != "policy-cni" && i.command == "ADD")
            .unwrap();
        let prev = &ours.stdin["prevResult"];
        assert_eq!(
            &result, prev,
            "{version}: the plugin returns prevResult unchanged"
        );
        assert_eq!(result["cniVersion"], version);
        assert_eq!(
            prev,
            &serde_json::from_str::<Value>(&before.stdout).unwrap(),
            "{version}: prevResult is the previous plugin's output"
        );
        assert_eq!(ours.stdin["cniVersion"], version);
        assert_eq!(ours.stdin["name"], "podnet");
        if version != "1.0.0" {
            assert!(
                result["ips"][0]["version"].is_string(),
                "{version}: {result}"
            );
        }
        assert!(
            ours.elapsed >= confirm_after,
            "{version}: ADD returned after {:?}, before the agent confirmed",
            ours.elapsed
        );

        let seen = agent.seen();
        assert_eq!(seen.len(), 1, "{version}: {seen:?}");
        assert_eq!(seen[0].request.container_id, sb.container_id);
        let Command::Add {
            pod,
            interface,
            ips,
        } = &seen[0].request.command
        else {
            panic!("{version}: not an ADD: {:?}", seen[0].request);
        };
        assert_eq!(
            pod,
            &PodId {
                namespace: "default".into(),
                name: "web-0".into(),
                uid: Some("uid-web-0".into())
            }
        );
        let host = result["interfaces"][0]["name"].as_str().unwrap();
        let (name, ifindex, kind) = fx
            .node_link(host)
            .expect("the host veth exists in the node namespace");
        assert_eq!(interface, &HostInterface { name, ifindex }, "{version}");
        assert_eq!(kind, "veth");
        let mut told = ips.clone();
        told.sort();
        assert_eq!(told, pod_addresses(&sb), "{version}: the pod's addresses");
        assert_eq!(told.len(), if dual { 2 } else { 1 });

        rt.del(&mut sb)
            .unwrap_or_else(|e| panic!("{version}: DEL: {e}"));
        let dels: Vec<String> = rt
            .take_log()
            .iter()
            .filter(|i| i.command == "DEL")
            .map(|i| i.plugin.clone())
            .collect();
        let expected: Vec<&str> = if version == "0.3.1" {
            vec!["loopback", "policy-cni", "portmap", "ptp"]
        } else {
            vec!["loopback", "policy-cni", "ptp"]
        };
        assert_eq!(dels, expected, "{version}: DEL in reverse order");
        let seen = agent.seen();
        assert_eq!(seen.len(), 2);
        assert_eq!(
            seen[1].request.command,
            Command::Del {
                pod: Some(pod.clone())
            }
        );
        assert!(
            fx.reserved().is_empty(),
            "{version}: host-local released {:?}",
            fx.reserved()
        );
        assert!(fx.node_link(host).is_none(), "{version}: the veth is gone");
    }
}

#[test]
fn a_refusal_fails_add_with_the_agents_code_and_del_still_cleans_up() {
    let fx = Fixture::new("cnirefuse");
    let _agent = StandIn::start(fx.socket(), |_| {
        Answer::Refuse(code::NOT_ENFORCED, "attach failed: map full")
    });
    let rt = fx.runtime("1.0.0", 5.0, false);
    let mut sb = fx.sandbox(&rt, "db-0");
    let err = rt.add(&mut sb).unwrap_err();
    match &err {
        CniError::Plugin(e) => {
            assert_eq!(e.plugin, "policy-cni");
            assert_eq!(e.code, u64::from(code::NOT_ENFORCED));
            assert!(e.details.contains("map full"), "{err}");
        }
        other => panic!("{other}"),
    }
    assert!(sb.result.is_none(), "nothing cached after a failed ADD");
    assert_eq!(fx.reserved().len(), 1);
    // The runtime must DEL after a failed ADD: without a cached result.
    rt.del(&mut sb).unwrap();
    assert!(fx.reserved().is_empty());
}

#[test]
fn an_absent_agent_fails_add_with_try_again_within_the_timeout() {
    let fx = Fixture::new("cniabsent");
    let rt = fx.runtime("0.4.0", 1.0, false);
    let mut sb = fx.sandbox(&rt, "a");
    assert_add_times_out(&rt, &mut sb, Duration::from_millis(800), "no agent");
    rt.del(&mut sb).unwrap();
    assert!(fx.reserved().is_empty());
}

#[test]
fn an_agent_slower_than_the_timeout_fails_add() {
    let fx = Fixture::new("cnislow");
    for (answer, tag) in [
        (Answer::Silent, "silent"),
        (Answer::Confirm(Duration::from_secs(3)), "late"),
    ] {
        let agent = StandIn::start(fx.socket(), move |_| answer.clone());
        let rt = fx.runtime("1.0.0", 1.0, false);
        let mut sb = fx.sandbox(&rt, tag);
        assert_add_times_out(&rt, &mut sb, Duration::from_millis(900), tag);
        assert_eq!(agent.seen().len(), 1, "{tag}: the agent was asked");
        rt.del(&mut sb).unwrap();
        drop(agent);
    }
    assert!(fx.reserved().is_empty());
}

#[test]
fn del_succeeds_with_the_agent_absent_and_for_a_pod_it_does_not_know() {
    let fx = Fixture::new("cnidel");
    let rt = fx.runtime("1.0.0", 5.0, false);
    // A sandbox whose ADD never ran (the runtime tears down after a
    // failure before the chain): no cached result, nothing to release.
    let mut never = fx.sandbox(&rt, "never");
    let start = Instant::now();
    rt.del(&mut never).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "DEL does not wait for an absent agent"
    );
    // Known to the chain, unknown to the agent.
    let agent = StandIn::start(fx.socket(), |r| match r.command {
        Command::Add { .. } => Answer::Confirm(Duration::ZERO),
        _ => Answer::Refuse(code::BAD_REQUEST, "unknown pod"),
    });
    let mut sb = fx.sandbox(&rt, "known");
    rt.add(&mut sb).unwrap();
    rt.del(&mut sb).unwrap();
    assert_eq!(agent.seen().len(), 2);
    // And DEL again (runtimes repeat it): still fine, agent gone too.
    drop(agent);
    rt.del(&mut sb).unwrap();
    assert!(fx.reserved().is_empty());
}

#[test]
fn check_asks_the_agent_about_the_same_interface() {
    let fx = Fixture::new("cnicheck");
    let healthy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let agent = {
        let healthy = std::sync::Arc::clone(&healthy);
        StandIn::start(fx.socket(), move |r| match r.command {
            Command::Check { .. } if !healthy.load(std::sync::atomic::Ordering::Relaxed) => {
                Answer::Refuse(code::NOT_ENFORCED, "not attached")
            }
            _ => Answer::Confirm(Duration::ZERO),
        })
    };
    let rt = fx.runtime("1.0.0", 5.0, false);
    let mut sb = fx.sandbox(&rt, "c");
    rt.add(&mut sb).unwrap();
    rt.check(&sb).unwrap();
    let seen = agent.seen();
    let (
        Command::Add {
            interface: added, ..
        },
        Command::Check {
            interface: checked, ..
        },
    ) = (&seen[0].request.command, &seen[1].request.command)
    else {
        panic!("{seen:?}");
    };
    assert_eq!(added, checked);
    healthy.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        rt.check(&sb).unwrap_err().code(),
        Some(u64::from(code::NOT_ENFORCED))
    );
    rt.del(&mut sb).unwrap();
}

/// The kernel is asked first: a prevResult naming another host interface,
/// or none at all (an IPAM-only result), still yields the real veth.
#[test]
fn the_host_veth_comes_from_the_kernel_whatever_prev_result_says() {
    let fx = Fixture::new("cnihost");
    let agent = StandIn::start(fx.socket(), |_| Answer::Confirm(Duration::ZERO));
    let rt = fx.runtime("1.0.0", 5.0, false);
    let mut sb = fx.sandbox(&rt, "h");
    let result = rt.add(&mut sb).unwrap();
    let host = result["interfaces"][0]["name"].as_str().unwrap().to_owned();
    let (_, ifindex, _) = fx.node_link(&host).unwrap();
    let ours = rt.list()["plugins"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let mut lying = result.clone();
    lying["interfaces"][0]["name"] = json!("uplink1");
    let ipam_only =
        json!({"cniVersion": "1.0.0", "ips": [{"address": result["ips"][0]["address"]}]});
    for prev in [lying, ipam_only] {
        let conf = rt.derive(rt.list(), &ours, Some(&prev));
        let inv = rt.invoke("ADD", &sb, &conf).unwrap();
        assert_eq!(inv.status, Some(0), "{}", inv.stdout);
        assert_eq!(serde_json::from_str::<Value>(&inv.stdout).unwrap(), prev);
    }
    for s in &agent.seen() {
        let Command::Add { interface, .. } = &s.request.command else {
            panic!()
        };
        assert_eq!(
            interface,
            &HostInterface {
                name: host.clone(),
                ifindex
            }
        );
    }
    assert_eq!(agent.seen().len(), 3);
    rt.del(&mut sb).unwrap();
}

#[test]
fn version_lists_the_chaining_versions() {
    let fx = Fixture::new("cniver");
    let rt = fx.runtime("0.4.0", 5.0, false);
    let v = rt.version("policy-cni").unwrap();
    assert_eq!(v["cniVersion"], "0.4.0");
    assert_eq!(
        v["supportedVersions"],
        json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
    );
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

/// The plugin's cost per ADD against a stand-in that confirms at once:
/// 200 runs of the plugin alone (on the real veth of one ptp ADD), next to
/// the cost of `nsenter --net` running /bin/true, the runtime's own
/// fork+exec. Run by hand (for the release binary, with
/// `POLICY_CNI_BIN=target/release/policy-cni`):
/// `cargo test -p policy-testbed --test privileged -- cni::plugin --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn add_overhead() {
    const RUNS: usize = 200;
    let fx = Fixture::new("cniperf");
    let agent = StandIn::start(fx.socket(), |_| Answer::Confirm(Duration::ZERO));
    let rt = fx.runtime("1.0.0", 5.0, false);
    let mut sb = fx.sandbox(&rt, "perf");
    let result = rt.add(&mut sb).unwrap();
    let chain: Vec<(String, Duration)> = rt
        .take_log()
        .into_iter()
        .map(|i| (i.plugin, i.elapsed))
        .collect();
    let ours = rt.list()["plugins"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let conf = rt.derive(rt.list(), &ours, Some(&result));
    let mut plugin = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let inv = rt.invoke("ADD", &sb, &conf).unwrap();
        assert_eq!(inv.status, Some(0), "{}", inv.stderr);
        plugin.push(inv.elapsed);
    }
    let mut baseline = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = Instant::now();
        let ok = std::process::Command::new("nsenter")
            .arg(format!("--net={}", fx.node.node.path().display()))
            .arg("/bin/true")
            .status()
            .unwrap()
            .success();
        assert!(ok);
        baseline.push(start.elapsed());
    }
    plugin.sort();
    baseline.sort();
    assert_eq!(agent.seen().len(), RUNS + 1);
    println!("one chain ADD (per plugin): {chain:?}");
    for (what, d) in [
        ("policy-cni ADD", &plugin),
        ("nsenter /bin/true", &baseline),
    ] {
        println!(
            "{what:>18}: p50 {:?}  p99 {:?}  max {:?}  ({RUNS} runs)",
            percentile(d, 0.50),
            percentile(d, 0.99),
            d[d.len() - 1]
        );
    }
    rt.del(&mut sb).unwrap();
}
