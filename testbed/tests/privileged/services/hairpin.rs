//! A pod reaching itself through its own Service under ClusterNetworkPolicy.
//! "A Pod connecting to its own Pod IP is not subject to CNP. A Pod
//! connecting to a Service IP that the service proxy load-balances back
//! to the same Pod is subject to ClusterNetworkPolicy." (the
//! network-policy-api overview). `default/solo` has one backend,
//! `solo-a`; solo-a asks it (kube-proxy masquerades the hairpin to the
//! node's address) over TCP and UDP, IPv4 and IPv6, while the client asks
//! it too as the control. Each stage is judged at the receiver: what
//! solo-a's server answered and saw. Both datapaths, kube-proxy in
//! iptables mode. Needs root.

use std::{net::SocketAddr, time::Duration};

use policy_testbed::fixtures::{conformance::Backend, services::*};
use policy_testbed::{
    backend::{L4, Reply},
    kube_proxy::ProxyMode,
};

const SOLO: &str = "default/solo-a";
const TIMEOUT: Duration = Duration::from_millis(800);

fn frontends() -> Vec<(SocketAddr, L4)> {
    let mut out = Vec::new();
    for l4 in [L4::Tcp, L4::Udp] {
        for vip in [SOLO_V4, SOLO_V6] {
            out.push((sock(ip(vip), 80), l4));
        }
    }
    out
}

/// A ClusterNetworkPolicy on solo-a with one rule towards (or from) the
/// pods labelled `pick: a`: solo-a itself.
fn cnp(tier: &str, gress: &str, action: &str) -> String {
    let (dir, peers) = if gress == "egress" {
        ("egress", "to")
    } else {
        ("ingress", "from")
    };
    format!(
        "---\napiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: hairpin}}\nspec:\n  tier: {tier}\n  priority: 1\n  subject: {{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{pick: a}}}}}}}}\n  {dir}:\n  - name: solo-a-itself\n    action: {action}\n    {peers}: [{{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{pick: a}}}}}}}}]\n"
    )
}

/// A NetworkPolicy isolating solo-a in `dir` ("Ingress" admits only the
/// client; "Egress" admits nothing).
fn isolating(dir: &str) -> String {
    let rules = if dir == "Ingress" {
        "  ingress: [{from: [{podSelector: {matchLabels: {app: client}}}]}]\n"
    } else {
        ""
    };
    policy(
        "default",
        "solo-a-isolated",
        &format!("  podSelector: {{matchLabels: {{pick: a}}}}\n  policyTypes: [{dir}]\n{rules}"),
    )
}

/// Waits until solo-a's hairpin through every frontend is answered (or
/// not) as `reached` says, then checks it once more at the receiver: solo-a
/// served exactly the hairpin connections answered, and the client is
/// answered throughout.
fn expect(env: &Env, what: &str, reached: bool) {
    let frontends = frontends();
    eventually(what, Duration::from_secs(10), || {
        let results = env.ask_all(SOLO, &frontends, 1, TIMEOUT);
        for ((to, l4), replies) in frontends.iter().zip(&results) {
            let answered = replies.iter().any(|r| r.pod() == Some(SOLO));
            if answered != reached {
                return Err(format!("{l4:?} {to}: {replies:?}"));
            }
        }
        Ok(())
    });
    env.dump_on_failure(|| {
        env.backends.clear();
        let results = env.ask_all(SOLO, &frontends, 3, TIMEOUT);
        let client = env.ips(CLIENT);
        let served: Vec<_> = env
            .backends
            .served()
            .into_iter()
            .filter(|s| s.pod == SOLO && !client.contains(&s.peer.ip()))
            .collect();
        let answered: usize = results.iter().map(|r| answered(r).len()).sum::<usize>();
        for ((to, l4), replies) in frontends.iter().zip(&results) {
            for r in replies {
                match r {
                    Reply::Answered { pod, .. } => {
                        assert!(reached && pod == SOLO, "{what}: {l4:?} {to}: {r:?}")
                    }
                    Reply::Refused => panic!("{what}: {l4:?} {to}: refused"),
                    Reply::NoAnswer => {
                        assert!(!reached, "{what}: {l4:?} {to}: not answered")
                    }
                }
            }
        }
        if reached {
            assert_eq!(answered, frontends.len(), "{what}: {results:?}");
            assert_eq!(
                served.len(),
                frontends.len() * 3,
                "{what}: solo-a served {served:?}"
            );
        } else {
            assert!(
                served.is_empty(),
                "{what}: solo-a served itself: {served:?}"
            );
        }
        // The control: the client reaches solo-a through the same
        // frontends.
        let results = env.ask_all(CLIENT, &frontends, 1, TIMEOUT);
        for ((to, l4), replies) in frontends.iter().zip(&results) {
            assert!(
                replies.iter().all(|r| r.pod() == Some(SOLO)),
                "{what}: the client to {l4:?} {to}: {replies:?}"
            );
        }
    });
}

fn hairpin(prefix: &'static str, datapath: Backend) {
    let (namespaces, m) = cluster();
    let mut env = Env::new(prefix, datapath, ProxyMode::Iptables, namespaces, m);
    env.write_policies("");
    env.start_agents();
    expect(&env, "no policy: the hairpin is allowed", true);
    // The Admin tier decides the hairpin's egress.
    env.write_policies(&cnp("Admin", "egress", "Deny"));
    expect(&env, "an Admin egress Deny of itself", false);
    // Passed to the NetworkPolicy tier, which allows a pod's traffic to
    // itself though it isolates the pod's egress.
    env.write_policies(&format!(
        "{}{}",
        cnp("Admin", "egress", "Pass"),
        isolating("Egress")
    ));
    expect(
        &env,
        "an Admin egress Pass to an isolating NetworkPolicy",
        true,
    );
    // And its ingress.
    env.write_policies(&cnp("Admin", "ingress", "Deny"));
    expect(&env, "an Admin ingress Deny of itself", false);
    // Isolated by a NetworkPolicy, the Baseline tier is not reached.
    env.write_policies(&format!(
        "{}{}",
        cnp("Baseline", "ingress", "Deny"),
        isolating("Ingress")
    ));
    expect(
        &env,
        "a Baseline ingress Deny under an isolating NetworkPolicy",
        true,
    );
    // Not isolated, the Baseline tier decides.
    env.write_policies(&cnp("Baseline", "ingress", "Deny"));
    expect(&env, "a Baseline ingress Deny of itself", false);
}

#[test]
fn a_pod_through_its_own_service_is_subject_to_cluster_network_policy_bpf() {
    hairpin("svhpb", Backend::Bpf);
}

#[test]
fn a_pod_through_its_own_service_is_subject_to_cluster_network_policy_iptables() {
    hairpin("svhpi", Backend::Iptables);
}
