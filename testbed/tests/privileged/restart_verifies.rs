//! A restart checks every attachment the pins record: a pod whose
//! classifiers were removed while no agent ran is judged again by the
//! time the agent says it is ready, not at the next periodic resync.
//! Judged at the receiver. Needs root.
use policy_testbed::fixtures::conformance::{Backend, Conformance, is_node};

/// beta/db isolated for ingress, nothing admitted.
const DENY_DB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny-db, namespace: beta}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  policyTypes: [Ingress]\n";

#[test]
fn a_restart_puts_back_classifiers_removed_while_no_agent_ran() {
    let mut c = Conformance::new("krverify", Backend::Bpf);
    c.write_policies(DENY_DB);
    let expect = |f: &str, t: &str| f == t || is_node(f) || t != "beta/db";
    c.start_daemon(19471);
    c.check("deny db, first start", |f, t, _, _| expect(f, t));
    c.stop_daemon();

    // While no agent runs, the pod's interface loses its classifiers (a
    // clsact qdisc removed and made again, as another tool might).
    let host_if = c.node().pod("beta/db").unwrap().host_if.clone();
    for args in [
        vec!["qdisc", "del", "dev", &host_if, "clsact"],
        vec!["qdisc", "add", "dev", &host_if, "clsact"],
    ] {
        c.node().node.exec("tc", &args).unwrap();
    }
    // Nothing judges beta/db now: every flow to it goes through.
    c.check("the classifiers removed, no agent", |_, _, _, _| true);

    c.start_daemon(19471);
    c.check("deny db, right after the restart is ready", |f, t, _, _| {
        expect(f, t)
    });
}
