//! A full map fails closed and freezes nothing: with the POLICY map far
//! too small for the allows, the pods stay isolated with what fits (no
//! cell opens that the policies close), new isolation still lands, and
//! `apply` says which map is short. Real traffic on the simulated node.
//! Needs root.

use policy_testbed::Transport;
use policy_testbed::fixtures::conformance::{Backend, Conformance, is_node, mismatches, ns_of};

/// alpha/web takes TCP 80 and 8080, UDP 53 from every namespace (many
/// allow entries); beta is isolated by a deny-all (none).
const POLICIES: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: web, namespace: alpha}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  ingress:\n    - from: [{namespaceSelector: {}}]\n      ports: [{port: 80}, {port: 8080}, {protocol: UDP, port: 53}]\n---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: beta}\nspec: {podSelector: {}, policyTypes: [Ingress]}\n";

fn expected(from: &str, to: &str, port: u16, t: Transport) -> bool {
    if is_node(from) || from == to {
        return true;
    }
    match to {
        "alpha/web" => {
            (t == Transport::Tcp && (port == 80 || port == 8080))
                || (t == Transport::Udp && port == 53)
        }
        _ => ns_of(to) != "beta",
    }
}

#[test]
fn a_full_policy_map_fails_closed_and_later_changes_still_land() {
    let c = Conformance::new("fullmap", Backend::Bpf);
    c.write_policies(POLICIES);
    let run = c.apply_with(&["--map-size", "POLICY=4"]);
    assert!(!run.ok, "apply reports the shortfall");
    assert!(
        run.stderr.contains("map POLICY is full"),
        "names the map: {}",
        run.stderr
    );
    let m = c.matrix();
    let all = mismatches(&m, &expected);
    let opened: Vec<&String> = all
        .iter()
        .filter(|w| w.contains("expected blocked"))
        .collect();
    assert!(opened.is_empty(), "nothing opens: {opened:#?}\n{m}");
    assert!(
        all.iter().any(|w| w.contains("expected open")),
        "some allows did not fit (the test needs a real shortfall)"
    );
    // Isolation needs no room: a new deny-all lands while the map is full.
    c.write_policies(&format!(
        "{POLICIES}---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: deny, namespace: gamma}}\nspec: {{podSelector: {{}}, policyTypes: [Ingress]}}\n"
    ));
    let run = c.apply_with(&["--map-size", "POLICY=4"]);
    assert!(!run.ok);
    let m = c.matrix();
    let still_open: Vec<String> = mismatches(&m, &|f: &str, t: &str, p, tr| {
        expected(f, t, p, tr) && !(ns_of(t) == "gamma" && !is_node(f) && f != t)
    })
    .into_iter()
    .filter(|w| w.contains("expected blocked"))
    .collect();
    assert!(
        still_open.is_empty(),
        "gamma isolated too: {still_open:#?}\n{m}"
    );
}
