//! A pod reaching a backend that does not admit it, through kube-proxy's
//! masquerade: the client connects to a NodePort on its own node's address
//! (`externalTrafficPolicy: Cluster`), kube-proxy translates the
//! connection to one of web's backends and masquerades it to the node's
//! address on the way. What reaches a backend on the client's node then
//! carries a node address, yet it is the client's, and the backend's
//! policy judges it as the client's (the iptables datapath does so in
//! FORWARD, before the source is rewritten; the BPF classifier by the pod
//! interface the packet entered the node at). Judged where it lands: every
//! connection a denied backend's server saw, from any source. Both
//! datapaths, kube-proxy in iptables and nftables mode. Needs root.

use std::{net::SocketAddr, time::Duration};

use policy_testbed::fixtures::{conformance::Backend, services::*};
use policy_testbed::{
    backend::{L4, Reply},
    kube_proxy::ProxyMode,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// Connections per node address: each lands on one of four backends
/// (on iptables a dropped SYN's retransmission is translated afresh, so
/// a connection goes unanswered with odds of a quarter: none of 40 with
/// odds of 1e-5).
const N: usize = 40;
/// web's backends on node-1, the client's node: they do not admit it.
const DENIED: [&str; 2] = ["default/web-a", "default/web-b"];
/// web's backends on node-2: no policy selects them.
const OPEN: [&str; 2] = ["default/web-c", "default/web-d"];

/// web-a and web-b take connections from `from` only.
fn node_1_backends_admit(from: &str) -> String {
    policy(
        "default",
        "web-node-1",
        &format!(
            "  podSelector: {{matchExpressions: [{{key: pod, operator: In, values: [web-a, web-b]}}]}}\n  ingress: [{{from: [{from}]}}]\n"
        ),
    )
}

fn masqueraded_node_port(prefix: &'static str, datapath: Backend, mode: ProxyMode) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, mode, namespaces, m);
    env.write_policies(&node_1_backends_admit(
        "{podSelector: {matchLabels: {app: web}}}",
    ));
    env.start_agents();
    let what = format!("{} {mode}", datapath.flag());
    let frontends: Vec<(SocketAddr, L4)> = env.cluster().nodes[0]
        .ips()
        .into_iter()
        .map(|ip| (sock(ip, WEB_NODE_PORT), L4::Tcp))
        .collect();

    env.dump_on_failure(|| {
        env.backends.clear();
        let results = env.ask_all(CLIENT, &frontends, N, TIMEOUT);
        for ((to, _), replies) in frontends.iter().zip(&results) {
            let by = answered(replies);
            let lost = unanswered(replies);
            let context =
                format!("{what}: NodePort {to}: answered {by:?}, unanswered {lost} of {N}");
            eprintln!("{context}");
            for r in replies {
                match r {
                    Reply::Answered { pod, seen_from } => {
                        assert!(OPEN.contains(&pod.as_str()), "{context}: {pod} answered");
                        // The path under test: the node's address is what
                        // a backend sees.
                        assert_eq!(
                            seen_from.ip(),
                            to.ip(),
                            "{context}: {pod} saw {seen_from}, not masqueraded"
                        );
                    }
                    Reply::Refused => panic!("{context}: refused"),
                    Reply::NoAnswer => {}
                }
            }
            // The control: the open backends answer through the same path.
            for open in OPEN {
                assert!(by.contains_key(open), "{context}: {open} never answered");
            }
            // Some connections landed on the node-1 backends (each does
            // with even odds).
            assert!(lost > 0, "{context}: none went to web-a or web-b");
        }
        // Every connection a denied backend accepted, whatever source it
        // saw: masqueraded, it came from the node's address.
        let seen: Vec<_> = env
            .backends
            .served()
            .into_iter()
            .filter(|s| DENIED.contains(&s.pod.as_str()))
            .collect();
        assert!(
            seen.is_empty(),
            "{what}: backends that do not admit the client served it through the NodePort: {seen:?}"
        );
    });

    // The control: admitting the client, the same backends answer it
    // through the same NodePort, masqueraded.
    env.write_policies(&node_1_backends_admit(
        "{podSelector: {matchLabels: {app: web}}}, {podSelector: {matchLabels: {app: client}}}",
    ));
    for (to, _) in &frontends {
        eventually(
            &format!("{what}: web-a or web-b through {to}, admitting the client"),
            Duration::from_secs(10),
            || {
                let replies = env.ask(CLIENT, *to, L4::Tcp, 8, Duration::from_millis(1500));
                match replies.iter().find_map(|r| match r {
                    Reply::Answered { pod, seen_from } if DENIED.contains(&pod.as_str()) => {
                        Some((pod.clone(), *seen_from))
                    }
                    _ => None,
                }) {
                    Some((_, seen_from)) if seen_from.ip() == to.ip() => Ok(()),
                    Some((pod, seen_from)) => Err(format!("{pod} saw {seen_from}")),
                    None => Err(format!("{replies:?}")),
                }
            },
        );
    }
}

#[test]
fn a_pod_a_backend_does_not_admit_is_not_let_in_as_the_node_bpf_iptables_mode() {
    masqueraded_node_port("svmbi", Backend::Bpf, ProxyMode::Iptables);
}

#[test]
fn a_pod_a_backend_does_not_admit_is_not_let_in_as_the_node_bpf_nftables_mode() {
    masqueraded_node_port("svmbn", Backend::Bpf, ProxyMode::Nftables);
}

#[test]
fn a_pod_a_backend_does_not_admit_is_not_let_in_as_the_node_iptables_iptables_mode() {
    masqueraded_node_port("svmii", Backend::Iptables, ProxyMode::Iptables);
}

#[test]
fn a_pod_a_backend_does_not_admit_is_not_let_in_as_the_node_iptables_nftables_mode() {
    masqueraded_node_port("svmin", Backend::Iptables, ProxyMode::Nftables);
}
