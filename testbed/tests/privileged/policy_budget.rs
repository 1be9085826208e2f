//! One policy cannot make the agent run out of memory (`apply` on a
//! simulated node, real traffic, needs root): a namespace admin's policy
//! selecting its own pods with `namespaceSelector: {}` peers and thousands
//! of `ports` compiles to endpoint identities × peer identities × ports
//! keys. Past the compiled-state budget it fails closed and is reported;
//! the agent's peak memory stays far below the DaemonSet's 256 MiB, and
//! the other policies are enforced.

use std::{
    fmt::Write as _,
    os::unix::process::{CommandExt as _, ExitStatusExt as _},
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use policy_testbed::{
    Transport,
    fixtures::{
        self,
        conformance::{Backend, Conformance, NODE, is_node, mismatches, ns_of},
    },
};

/// Pods of other nodes, each its own label identity: peers of the policy.
const REMOTE_PODS: usize = 2000;
/// Distinct ports, each for TCP, UDP and SCTP.
const PORTS: u16 = 10_000;
/// The child's address space: bounds the run without the fix.
const ADDRESS_SPACE: u64 = 1 << 30;
/// The DaemonSet's memory limit.
const DAEMONSET_LIMIT_KIB: i64 = 256 * 1024;

fn remote_pods() -> String {
    let mut out = String::new();
    for i in 0..REMOTE_PODS {
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: r{i}, namespace: gamma, labels: {{replica: \"r{i}\"}}}}\nspec: {{nodeName: node-2, containers: [{{name: main, image: example}}]}}\nstatus: {{phase: Running, podIPs: [{{ip: \"10.250.{}.{}\"}}]}}\n",
            i / 250,
            i % 250 + 1
        );
    }
    out
}

/// beta/db admits beta/web: a policy that must keep working.
const DB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db, namespace: beta}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]\n";

/// alpha's admin: every alpha pod open to every pod of the cluster on
/// 30,000 ports (3 × 2,009 × 30,000 keys).
fn huge() -> String {
    let mut ports = String::new();
    for p in 1..=PORTS {
        for proto in ["TCP", "UDP", "SCTP"] {
            let _ = write!(ports, "{{port: {p}, protocol: {proto}}}, ");
        }
    }
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: huge, namespace: alpha}}\nspec:\n  podSelector: {{}}\n  ingress: [{{from: [{{namespaceSelector: {{}}}}], ports: [{ports}]}}]\n---\n"
    )
}

/// alpha isolated with nothing allowed (the huge policy fails closed),
/// beta/db only from beta/web.
fn expected(from: &str, to: &str, _port: u16, _t: Transport) -> bool {
    if is_node(from) || from == to {
        return true;
    }
    match to {
        _ if ns_of(to) == "alpha" => false,
        "beta/db" => from == "beta/web",
        _ => true,
    }
}

struct Measured {
    status: ExitStatus,
    peak_rss_kib: i64,
    stderr: String,
    took: Duration,
}

/// `policy-agent apply` in the node namespace with its address space
/// bounded, killed after `timeout`; its peak RSS through `peak-rss` (a
/// child forked from this process would report this process's size).
fn apply_measured(c: &Conformance, timeout: Duration) -> Measured {
    let figures = tempfile_path("peak-rss");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_peak-rss"));
    cmd.arg(&figures)
        .arg("nsenter")
        .arg(format!("--net={}", c.node().node.path().display()))
        .arg(fixtures::agent())
        .args(["apply", "--manifests", c.dir.to_str().unwrap()])
        .args(["--node", NODE, "--datapath", "bpf"])
        .args(["--pin-dir", c.layout.root().to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit only, between fork and exec; the command inherits it.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: ADDRESS_SPACE,
                rlim_max: ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let start = Instant::now();
    let mut launcher = cmd.spawn().unwrap();
    let stderr = launcher.stderr.take().unwrap();
    let reader = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let launched = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > timeout {
            // The command dies with the launcher (PR_SET_PDEATHSIG).
            let _ = launcher.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = reader.join().unwrap();
    let took = start.elapsed();
    let written = std::fs::read_to_string(&figures).unwrap_or_default();
    let _ = std::fs::remove_file(&figures);
    let (peak, raw) = written
        .split_once(' ')
        .and_then(|(peak, raw)| Some((peak.parse().ok()?, raw.trim().parse().ok()?)))
        .unwrap_or_else(|| {
            panic!("peak-rss ended {launched:?} after {took:?} with no figures:\n{stderr}")
        });
    Measured {
        status: ExitStatus::from_raw(raw),
        peak_rss_kib: peak,
        stderr,
        took,
    }
}

/// A fresh file name under the temporary directory.
fn tempfile_path(prefix: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()))
}

#[test]
fn a_policy_past_the_budget_fails_closed_and_memory_stays_bounded() {
    let c = Conformance::new("budget", Backend::Bpf);
    std::fs::write(c.dir.join("remote.yaml"), remote_pods()).unwrap();
    c.write_policies(&format!("{}{DB}", huge()));
    let run = apply_measured(&c, Duration::from_secs(300));
    eprintln!(
        "apply: {:?} after {:?}, peak RSS {} MiB",
        run.status,
        run.took,
        run.peak_rss_kib / 1024
    );
    assert!(
        run.status.code().is_some(),
        "apply ended by {:?} after {:?} with a peak RSS of {} MiB:\n{}",
        run.status.signal(),
        run.took,
        run.peak_rss_kib / 1024,
        run.stderr
            .lines()
            .rev()
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        run.stderr.lines().any(|l| {
            l.starts_with("not enforced: networkpolicy alpha/huge: spec: compiles to more than")
        }),
        "the policy is reported:\n{}",
        run.stderr
    );
    let m = c.matrix();
    let wrong = mismatches(&m, &expected);
    assert!(wrong.is_empty(), "{wrong:#?}\n{m}");

    // The same cluster without it, over the programs pinned by then (a
    // lower floor than the first run's): the refused policy costs little.
    c.write_policies(DB);
    let without = apply_measured(&c, Duration::from_secs(300));
    eprintln!("without it: peak RSS {} MiB", without.peak_rss_kib / 1024);
    assert!(without.status.success(), "{}", without.stderr);
    assert!(
        run.peak_rss_kib < without.peak_rss_kib + 16 * 1024
            && run.peak_rss_kib < DAEMONSET_LIMIT_KIB / 2,
        "peak RSS {} MiB with the policy, {} MiB without",
        run.peak_rss_kib / 1024,
        without.peak_rss_kib / 1024
    );
}
