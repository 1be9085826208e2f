//! The iptables fallback against an attacker and a hostile node, with
//! real traffic on a simulated node (needs root; run under the kernel-test
//! lock): a failing `conntrack -D` is reported and retried instead of
//! being taken for done; an upgrade removes the objects of the earlier
//! naming but never a foreign `PA…` one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use policy_agent::sim::{Outcome, connect, echo};
use support::conformance::{AGENT, Backend, Conformance, socket};

/// A stand-in `conntrack` that fails (exit 1, not the "0 flow entries"
/// message) while a flag file exists and runs the real one otherwise.
struct FakeConntrack {
    dir: PathBuf,
}

impl FakeConntrack {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("policy-agent-fake-conntrack-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let real = [
            "/usr/sbin/conntrack",
            "/sbin/conntrack",
            "/usr/bin/conntrack",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("conntrack is installed");
        let script = format!(
            "#!/bin/sh\nif [ -e '{flag}' ]; then\n  echo 'conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters' >&2\n  exit 1\nfi\nexec {real} \"$@\"\n",
            flag = dir.join("fail").display()
        );
        let path = dir.join("conntrack");
        std::fs::write(&path, script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir }
    }

    fn fail(&self, on: bool) {
        let flag = self.dir.join("fail");
        if on {
            std::fs::write(flag, "").unwrap();
        } else {
            let _ = std::fs::remove_file(flag);
        }
    }

    /// PATH with the stand-in first.
    fn path(&self) -> String {
        format!(
            "{}:{}",
            self.dir.display(),
            std::env::var("PATH").unwrap_or_default()
        )
    }
}

impl Drop for FakeConntrack {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const DENY_DB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: alpha}\nspec: {podSelector: {matchLabels: {app: db}}, policyTypes: [Ingress]}\n";

#[test]
fn a_failing_conntrack_delete_is_reported_and_retried() {
    let fake = FakeConntrack::new("run");
    let mut c = Conformance::new("ictrack", Backend::Iptables);
    let path = fake.path();
    let dir = c.dir.to_str().unwrap().to_owned();
    c.start_daemon_with(19420, &["--manifests", &dir], &[("PATH", &path)]);
    let client = &c.node().pod("beta/web").unwrap().netns;
    let mut flow = connect(client, socket("10.244.1.12", 80), Duration::from_secs(2)).unwrap();
    assert_eq!(
        echo(&mut flow, b"one", Duration::from_secs(1)),
        Outcome::Open
    );

    // alpha/db is closed while conntrack cannot delete its flows: the
    // established one still passes (its entry survives), and that is
    // reported.
    fake.fail(true);
    c.write_policies(DENY_DB);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = c.http_get(19420, "/metrics");
        let problems = metrics
            .lines()
            .find_map(|l| l.strip_prefix("policy_agent_problems "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if problems > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the failed deletion is never reported:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        echo(&mut flow, b"two", Duration::from_secs(1)),
        Outcome::Open,
        "the entry the failed deletion left lets the flow on"
    );

    // conntrack works again: the daemon's retry (no manifest change) cuts
    // the flow.
    fake.fail(false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while echo(&mut flow, b"xyz", Duration::from_millis(300)) == Outcome::Open {
        assert!(
            Instant::now() < deadline,
            "the established flow is never cut: the failed deletion was not retried"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn apply_fails_when_conntrack_cannot_delete() {
    let fake = FakeConntrack::new("apply");
    let c = Conformance::new("ictapply", Backend::Iptables);
    c.apply_ok();
    fake.fail(true);
    c.write_policies(DENY_DB);
    let out = c
        .node()
        .node
        .command(AGENT)
        .args(["apply", "--manifests", c.dir.to_str().unwrap()])
        .args(["--node", "node-1", "--datapath", "iptables"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .env("PATH", fake.path())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "apply must not claim success:\n{text}"
    );
    assert!(
        text.contains("alpha/db") && text.contains("conntrack"),
        "the pod and the cause are named:\n{text}"
    );
}

#[test]
fn an_upgrade_removes_the_earlier_naming_and_spares_foreign_pa_objects() {
    let c = Conformance::new("itupgrade", Backend::Iptables);
    let node = &c.node().node;
    // What an agent of the earlier naming left: PA-FORWARD hooked into
    // FORWARD, a pod chain dropping everything to alpha/db, its set.
    node.exec("ipset", &["create", "PAI-0123abcd-v4", "hash:ip"])
        .unwrap();
    node.exec(
        "ipset",
        &["create", "PAI-0123abcd-v6", "hash:ip", "family", "inet6"],
    )
    .unwrap();
    node.exec("ipset", &["create", "PAYROLL", "hash:ip"])
        .unwrap();
    for (tool, fam) in [("iptables-restore", "v4"), ("ip6tables-restore", "v6")] {
        let restore = format!(
            "*filter\n:PA-FORWARD - [0:0]\n:PA-I-0123abcd - [0:0]\n:PA-LOCAL - [0:0]\n-A PA-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN\n-A PA-FORWARD -o itupgradeh2 -j PA-I-0123abcd\n-A PA-I-0123abcd -m set --match-set PAI-0123abcd-{fam} src -j RETURN\n-A PA-I-0123abcd -j DROP\n-A PA-LOCAL -s {foreign} -j DROP\n-I FORWARD 1 -j PA-FORWARD\n-A FORWARD -j PA-LOCAL\nCOMMIT\n",
            foreign = if fam == "v4" {
                "192.0.2.1"
            } else {
                "2001:db8::1"
            }
        );
        let mut cmd = node.command(tool);
        cmd.arg("--noflush");
        policy_agent::exec::output(&mut cmd, Some(&restore)).unwrap();
    }
    c.check("the old rules drop alpha/db", |f, t, _, _| {
        f == t || f == "(node)" || t != "alpha/db"
    });

    c.apply_ok();
    for tool in ["iptables-save", "ip6tables-save"] {
        let saved = node.exec(tool, &["-t", "filter"]).unwrap();
        assert!(
            !saved.contains("PA-FORWARD") && !saved.contains("PA-I-0123abcd"),
            "{saved}"
        );
        assert!(
            saved.contains(":PA-LOCAL") && saved.contains("-j PA-LOCAL"),
            "{saved}"
        );
    }
    let sets = node.exec("ipset", &["list", "-n"]).unwrap();
    assert!(!sets.contains("PAI-0123abcd"), "{sets}");
    assert!(sets.lines().any(|l| l == "PAYROLL"), "{sets}");
    c.check("no policy: everything open", |_, _, _, _| true);
}
