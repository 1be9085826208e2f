//! ClusterNetworkPolicy on the simulated node with real traffic, the
//! whole matrix probed (3 namespaces x 3 pods, TCP 80/8080, UDP 53/5353,
//! ICMP, IPv4 and IPv6), each scenario applied with `policy-agent apply`.
//!
//! The upstream conformance tests (kubernetes-sigs/network-policy-api,
//! conformance/tests) are transcribed onto this node's world: their houses
//! become namespaces and pods here (gryffindor: namespace beta; ravenclaw:
//! alpha/api; hufflepuff: alpha/web; slytherin: namespace gamma), each
//! test keeps its upstream name, and the whole matrix is checked, not only
//! the pairs upstream pokes. Each runs on both datapaths. Needs root.
//! Upstream's two pods per house, in the probes it makes: harry-potter-0
//! and -1 are beta/web and beta/api, draco-malfoy-0 and -1 gamma/web and
//! gamma/api; both luna-lovegood pods are alpha/api, both cedric-diggory
//! pods alpha/web. alpha/db is in no house.
//!
//! The Admin and Baseline tier tests of the standard channel are in
//! `admin_tier` and `baseline_tier`, their policies written as data in
//! `model`, which also works out every cell's verdict from the API text.
//! The experimental NamedPorts tests are in `named_ports`, on the same
//! model; the EgressNodePeers tests in `node_peers`.
use policy_testbed::Transport;
use policy_testbed::fixtures::conformance::{Backend, Conformance, is_node, ns_of};

mod admin_tier;
mod baseline_tier;
mod model;
mod named_ports;
mod node_peers;

/// Self traffic and the node are always allowed.
pub(super) fn always(from: &str, to: &str) -> bool {
    is_node(from) || from == to
}

/// CNPAdminTierIngressTCP's `ingress-tcp`, transcribed: rule `i` of the
/// upstream list is rule `i` here.
fn ingress_tcp(order: [usize; 7]) -> String {
    let rules = [
        "  - name: allow-from-ravenclaw-everything\n    action: Accept\n    from:\n    - pods: {namespaceSelector: {matchLabels: {team: a}}, podSelector: {matchLabels: {app: api}}}\n",
        "  - name: deny-from-ravenclaw-everything\n    action: Deny\n    from:\n    - pods: {namespaceSelector: {matchLabels: {team: a}}, podSelector: {matchLabels: {app: api}}}\n",
        "  - name: pass-from-ravenclaw-everything\n    action: Pass\n    from:\n    - pods: {namespaceSelector: {matchLabels: {team: a}}, podSelector: {matchLabels: {app: api}}}\n",
        "  - name: deny-from-slytherin-at-port-80\n    action: Deny\n    from:\n    - namespaces: {matchLabels: {team: c}}\n    protocols:\n    - tcp: {destinationPort: {number: 80}}\n",
        "  - name: pass-from-slytherin-at-port-80\n    action: Pass\n    from:\n    - namespaces: {matchLabels: {team: c}}\n    protocols:\n    - tcp: {destinationPort: {number: 80}}\n",
        "  - name: allow-from-hufflepuff-at-port-80\n    action: Accept\n    from:\n    - pods: {namespaceSelector: {matchLabels: {team: a}}, podSelector: {matchLabels: {app: web}}}\n    protocols:\n    - tcp: {destinationPort: {number: 80}}\n",
        "  - name: deny-from-hufflepuff-everything-else\n    action: Deny\n    from:\n    - pods: {namespaceSelector: {matchLabels: {team: a}}, podSelector: {matchLabels: {app: web}}}\n",
    ];
    let mut out = String::from(
        "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: ingress-tcp}\nspec:\n  tier: Admin\n  priority: 3\n  subject:\n    namespaces: {matchLabels: {kubernetes.io/metadata.name: beta}}\n  ingress:\n",
    );
    for i in order {
        out.push_str(rules[i]);
    }
    out
}

/// CNPAdminTierIngressTCP, its six subtests.
fn cnp_admin_tier_ingress_tcp(name: &'static str, backend: Backend) {
    let c = crate::flow_audit::audited(name, backend);
    c.write_policies(&ingress_tcp([0, 1, 2, 3, 4, 5, 6]));
    c.apply_ok();
    let tcp80 = |port: u16, tr: Transport| tr == Transport::Tcp && port == 80;
    // "allow-ingress ... ensure rule ordering is respected" (index 0 before
    // index 1); "allow-ingress ... at the specified port" (index 5, then 6);
    // "deny-ingress ... at the specified port" (index 3; other ports match
    // no rule).
    c.check("ingress-tcp as written", |f, t, port, tr| {
        always(f, t)
            || ns_of(t) != "beta"
            || match f {
                "alpha/web" => tcp80(port, tr),
                _ if ns_of(f) == "gamma" => !tcp80(port, tr),
                _ => true,
            }
    });
    // "deny-ingress ... ensure rule ordering is respected": 0 and 1 swapped.
    c.write_policies(&ingress_tcp([1, 0, 2, 3, 4, 5, 6]));
    c.apply_ok();
    c.check("ingress-tcp, Deny first", |f, t, port, tr| {
        always(f, t)
            || ns_of(t) != "beta"
            || match f {
                "alpha/api" => false,
                "alpha/web" => tcp80(port, tr),
                _ if ns_of(f) == "gamma" => !tcp80(port, tr),
                _ => true,
            }
    });
    // "pass-ingress ... ensure rule ordering is respected" (0 and 2
    // swapped: Pass first, nothing in the later tiers) and "pass-ingress
    // ... at the specified port" (3 and 4 swapped).
    c.write_policies(&ingress_tcp([2, 1, 0, 4, 3, 5, 6]));
    c.apply_ok();
    c.check("ingress-tcp, Pass first", |f, t, port, tr| {
        always(f, t) || ns_of(t) != "beta" || f != "alpha/web" || tcp80(port, tr)
    });
}

const PASS_EXAMPLE: &str = "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: pass-example}\nspec:\n  tier: Admin\n  priority: 10\n  subject:\n    namespaces: {matchLabels: {team: b}}\n  ingress:\n  - name: deny-all-ingress-from-slytherin\n    action: ACTION\n    from: [{namespaces: {matchLabels: {team: c}}}]\n  egress:\n  - name: deny-all-egress-to-slytherin\n    action: ACTION\n    to: [{namespaces: {matchLabels: {team: c}}}]\n";

const NETWORK_POLICY: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: allow-gress-from-to-slytherin-to-gryffindor, namespace: beta}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress, Egress]\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {team: c}}}]\n  egress:\n  - to: [{namespaceSelector: {matchLabels: {team: c}}}]\n";

const BASELINE: &str = "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: default}\nspec:\n  tier: Baseline\n  priority: 10\n  subject:\n    namespaces: {matchLabels: {team: b}}\n  ingress:\n  - name: deny-all-ingress-from-slytherin\n    action: Deny\n    from: [{namespaces: {matchLabels: {team: c}}}]\n  egress:\n  - name: deny-all-egress-to-slytherin\n    action: Deny\n    to: [{namespaces: {matchLabels: {team: c}}}]\n";

/// CNPAdminTierIntegration: an Admin Deny over a NetworkPolicy that
/// admits gamma (slytherin) both ways; then Pass to it; then, with the
/// NetworkPolicy deleted, Pass to the Baseline Deny.
fn cnp_admin_tier_integration(name: &'static str, backend: Backend) {
    let c = crate::flow_audit::audited(name, backend);
    let docs = |action: &str, np: bool| {
        let mut d = vec![PASS_EXAMPLE.replace("ACTION", action), BASELINE.to_owned()];
        if np {
            d.push(NETWORK_POLICY.to_owned());
        }
        d.join("---\n")
    };
    let beta_gamma = |f: &str, t: &str| {
        (ns_of(f) == "beta" && ns_of(t) == "gamma") || (ns_of(f) == "gamma" && ns_of(t) == "beta")
    };
    // The NetworkPolicy isolates beta both ways: only gamma, which the
    // Admin tier denies. "Should Deny traffic from slytherin to gryffindor
    // respecting admin CNP" and the reverse.
    c.write_policies(&docs("Deny", true));
    c.apply_ok();
    c.check("admin deny", |f, t, _, _| {
        always(f, t) || (ns_of(f) != "beta" && ns_of(t) != "beta")
    });
    if backend == Backend::Bpf {
        dump_names_the_rules(&c);
    }
    // "pass-ingress/egress ... respect the match for network policy".
    c.write_policies(&docs("Pass", true));
    c.apply_ok();
    c.check("admin pass to the network policy", |f, t, _, _| {
        always(f, t) || (ns_of(f) != "beta" && ns_of(t) != "beta") || beta_gamma(f, t)
    });
    // "... respect the match for baseline cluster network policy".
    c.write_policies(&docs("Pass", false));
    c.apply_ok();
    c.check("admin pass to the baseline", |f, t, _, _| {
        always(f, t) || !beta_gamma(f, t)
    });
}

/// `dump --json` names each entry's rules from the pins alone: the
/// NetworkPolicy rule of its `rule_ref`, the ClusterNetworkPolicy and rule
/// of each tier slot. Without `RULE_NAMES` (pins of an older agent) it
/// still prints, without names; the next `apply` creates the map again.
fn dump_names_the_rules(c: &Conformance) {
    let named = |c: &Conformance| {
        let dump = c.dump();
        let rows = dump["policy"].as_array().unwrap().clone();
        let np = rows.iter().any(|r| {
            r["direction"] == "ingress"
                && r["rule"]["policy"] == "beta/allow-gress-from-to-slytherin-to-gryffindor"
                && r["rule"]["direction"] == "ingress"
                && r["rule"]["rule"] == 0
        });
        let admin = |dir: &str, rule: &str| {
            rows.iter().any(|r| {
                r["direction"] == dir
                    && r["admin"]["policy"] == "pass-example"
                    && r["admin"]["rule_name"] == rule
                    && r["admin"]["priority"] == 10
            })
        };
        let admin = admin("ingress", "deny-all-ingress-from-slytherin")
            && admin("egress", "deny-all-egress-to-slytherin");
        let baseline = rows.iter().any(|r| {
            r["baseline"]["policy"] == "default"
                && r["baseline"]["rule_name"] == "deny-all-ingress-from-slytherin"
        });
        (np, admin, baseline, rows)
    };
    let (np, admin, baseline, rows) = named(c);
    assert!(
        np && admin && baseline,
        "{np} {admin} {baseline}: {rows:#?}"
    );

    let pin = c.layout.map(policy_common::maps::RULE_NAMES);
    std::fs::remove_file(&pin).unwrap();
    let (np, admin, baseline, rows) = named(c);
    assert!(
        !np && !admin && !baseline,
        "names without the map: {rows:#?}"
    );
    assert!(!rows.is_empty() && rows.iter().all(|r| r["rule"].is_null()));
    c.apply_ok();
    assert!(pin.exists(), "apply creates the map an older agent lacked");
    let (np, admin, baseline, rows) = named(c);
    assert!(
        np && admin && baseline,
        "{np} {admin} {baseline}: {rows:#?}"
    );
}

#[test]
fn cnp_admin_tier_ingress_tcp_bpf() {
    cnp_admin_tier_ingress_tcp("cnptcp", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_ingress_tcp_iptables() {
    cnp_admin_tier_ingress_tcp("cnptcpi", Backend::Iptables);
}

#[test]
fn cnp_admin_tier_integration_bpf() {
    cnp_admin_tier_integration("cnpint", Backend::Bpf);
}

#[test]
fn cnp_admin_tier_integration_iptables() {
    cnp_admin_tier_integration("cnpinti", Backend::Iptables);
}
