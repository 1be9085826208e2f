//! Bad manifests against the running daemon (`policy-agent run` on a
//! simulated node, real traffic; needs root, run under the kernel-test
//! lock): a file broken mid-edit changes nothing that is enforced, the
//! daemon reports it, and the fixed file is enforced as written.

use std::time::{Duration, Instant};

use policy_testbed::fixtures::conformance::{Backend, Conformance, ns_of};

const PORT: u16 = 19430;

/// alpha isolated for ingress; beta/db only from beta/web.
fn good() -> String {
    [
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: alpha}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]\n",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: beta}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n",
    ]
    .join("---\n")
}

fn expect_good(f: &str, t: &str) -> bool {
    f == t
        || f == "(node)"
        || match t {
            _ if ns_of(t) == "alpha" => false,
            "beta/db" => f == "beta/web",
            _ => true,
        }
}

fn problems(c: &Conformance) -> u64 {
    c.http_get(PORT, "/metrics")
        .lines()
        .find_map(|l| l.strip_prefix("policy_agent_problems "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_broken_manifest_changes_nothing_enforced_until_it_is_fixed() {
    let mut c = Conformance::new("brdaemon", Backend::Bpf);
    c.write_policies(&good());
    c.start_daemon(PORT);
    c.eventually("good", Duration::from_secs(5), |f, t, _, _| {
        expect_good(f, t)
    });

    // One edit: alpha's policy stops decoding (endPort as a string) and a
    // syntax error hides beta's.
    c.write_policies(
        &good()
            .replace(
                "policyTypes: [Ingress]\n",
                "policyTypes: [Ingress]\n  ingress: [{ports: [{port: 80, endPort: \"90\"}]}]\n",
            )
            .replace("ingress: [{from:", "ingress: [{from: ["),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while problems(&c) == 0 {
        assert!(
            Instant::now() < deadline,
            "the broken file is never reported"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    c.check("broken: as before", |f, t, _, _| expect_good(f, t));

    // Fixed, alpha's policy deleted on purpose: enforced as written.
    c.write_policies(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: beta}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n",
    );
    c.eventually("fixed", Duration::from_secs(5), |f, t, _, _| {
        f == t || f == "(node)" || t != "beta/db" || f == "beta/web"
    });
    assert_eq!(problems(&c), 0, "the problem clears with the fix");
}
