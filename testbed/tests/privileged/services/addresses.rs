//! A Service whose ClusterIP an older API server stored with leading
//! zeros (`010.096.000.050`), on real traffic. kube-proxy reads it as
//! 10.96.0.50 and rewrites it; the agent must read it alike, or the
//! ClusterIP is no frontend to it and is judged at the client as an
//! ordinary address: an ipBlock covering it then reaches every backend,
//! the denied ones too. The agents run without `--service-cidr` here (a
//! range would cover the address whatever its spelling). BPF only: the
//! iptables fallback judges after DNAT and needs no frontends. Judged at
//! the backends' servers. Needs root.
use std::time::Duration;

use policy_testbed::fixtures::{conformance::Backend, services::*};
use policy_testbed::{
    backend::{L4, Reply},
    kube_proxy::ProxyMode,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// Connections to the ClusterIP: with two of four backends denied, the
/// chance that no denied one is ever picked is 2^-24.
const N: usize = 24;

#[test]
fn a_cluster_ip_with_leading_zeros_is_judged_after_dnat() {
    let (namespaces, mut m) = cluster();
    for s in m.services.iter_mut().filter(|s| s.name == "web") {
        *s = s.clone().spell(ip(WEB_V4), "010.096.000.050");
    }
    let mut env = Env::new("svzero", Backend::Bpf, ProxyMode::Iptables, namespaces, m);
    env.service_ranges = false;
    // The web pods of tier ok on http, and the Service addresses by block.
    env.write_policies(&client_policy(
        "    - to: [{podSelector: {matchLabels: {tier: ok}}}]\n      ports: [{protocol: TCP, port: http}]\n    - to: [{ipBlock: {cidr: 10.96.0.0/16}}]\n      ports: [{protocol: TCP, port: 80}]\n",
    ));
    env.start_agents();
    env.dump_on_failure(|| {
        env.backends.clear();
        let replies = env.ask(CLIENT, sock(ip(WEB_V4), 80), L4::Tcp, N, TIMEOUT);
        let by = answered(&replies);
        eprintln!(
            "web at 010.096.000.050: answered {by:?}, unanswered {}",
            unanswered(&replies)
        );
        for r in &replies {
            if let Reply::Answered { pod, .. } = r {
                assert!(
                    pod == "default/web-a" || pod == "default/web-c",
                    "{pod} (tier no) answered through the ClusterIP"
                );
            }
        }
        assert!(!by.is_empty(), "no allowed backend answered: {replies:?}");
        for denied in ["default/web-b", "default/web-d"] {
            let seen = env.served(denied, CLIENT);
            assert!(
                seen.is_empty(),
                "{denied} (tier no) received {} connections from the client: {seen:?}",
                seen.len()
            );
        }
    });
}
