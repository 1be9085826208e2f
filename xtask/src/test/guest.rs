//! The kernel suites again, each in its own 6.1 guest (`crate::vm`): no
//! TCX there, so the agent takes its netlink fallback and the tests
//! assert that path.
use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::{Context as _, bail};

use crate::vm::{self, Accel};

/// What the guest's tests read to stretch their deadlines (see
/// `policy-agent/tests/support/deadline.rs`).
const TIME_SCALE_VAR: &str = "POLICY_AGENT_TEST_TIME_SCALE";

/// What a test prints when it skips for want of a kernel feature.
const SKIP_MARK: &str = "SKIPPED";

/// One test target run in the guest.
pub struct Suite {
    /// The test target (`policy-agent/tests/<name>.rs`).
    pub name: &'static str,
    /// libtest arguments after `--test-threads`: filters.
    pub args: &'static [&'static str],
    /// Added to the guest's environment.
    pub env: &'static [(&'static str, &'static str)],
    /// What the guest leaves to the host, if anything: printed with the
    /// summary.
    pub subset: Option<&'static str>,
    /// The VM is killed after this long (boot included), under TCG.
    pub timeout: Duration,
}

/// The suites the guest runs, in order: those that load or attach the
/// classifier (what the older verifier and the missing TCX change), and
/// SCTP and kube-proxy's IPVS mode (modules the host lacks), chosen to keep the guest part of
/// `.ci/run` near 20 minutes under TCG on two cores. On the host only:
/// `iptables_hardening` (~3 min there), `iptables`, `sim_services`,
/// `cluster_mode`, `deploy`, `node_addresses`, the pure suites, and most
/// of `conformance` (see its note). Each test binary runs with `--test-threads=1`: the
/// guest has two vCPUs, and tests that share the machine's CPUs under
/// emulation would only stretch each other's deadlines.
pub const SUITES: &[Suite] = &[
    Suite {
        name: "kernel_test_run",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(900),
    },
    Suite {
        name: "kernel_services",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "kernel_catchall",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "kernel_differential",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "kernel_hardening",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "kernel_netns",
        // Below 6.6 the TCX-named tests ask for TCX and fall back to
        // netlink filters, the default path their netlink twins take.
        args: &[
            "--skip",
            "netlink_attachments_enforce_and_outlive_the_loader",
            "--skip",
            "netlink_filters_run_before_foreign_filters_of_a_later_priority",
        ],
        env: &[],
        subset: Some(
            "all but the netlink twins: without TCX their TCX-named tests \
             take that path already, through the fallback",
        ),
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "cni_agent",
        // The hand-off with Debian's real plugins through netlink filters
        // (no TCX): the standby attachment, and one first-packet run.
        args: &["a_new_veth_is_prepared", "first_packet_manifests"],
        env: &[],
        subset: Some("the standby attachment and the first-packet test in manifests mode"),
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "iptables",
        // Conntrack marks set over ctnetlink, with the bit as its own mask
        // (the kernel must keep the other bits).
        args: &["revocation_marks_every_flow"],
        env: &[],
        subset: Some("the conntrack revocation of a busy pod (ctnetlink marks)"),
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "full_maps",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "attacker",
        args: &[],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "sctp",
        // The skip line is printed by a passing test: shown, and checked.
        args: &["--nocapture"],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "ipvs",
        // kube-proxy's IPVS mode (the host has no ip_vs): its tests print
        // SKIPPED there, and a skip here fails the suite, so the output is
        // shown.
        args: &["--nocapture"],
        env: &[],
        subset: None,
        timeout: Duration::from_secs(900),
    },
    Suite {
        name: "conformance",
        // The daemon attaching late pods and cutting established flows
        // through the netlink filters; the whole suite takes ~23 minutes
        // per datapath under TCG, past the budget.
        args: &[
            "bpf::run_mode_attaches_a_pod_whose_interface_and_route_appear_later",
            "bpf::established_connections_are_cut_when_a_policy_denies_them",
            "iptables::established_connections_are_cut_when_a_policy_denies_them",
        ],
        env: &[],
        subset: Some(
            "only three tests (BPF: the daemon attaching a late pod; both datapaths: \
             established connections cut, on iptables through ctnetlink marks); the \
             rest run on the host only (the whole suite takes ~23 min per datapath in \
             the TCG guest)",
        ),
        timeout: Duration::from_secs(1800),
    },
];

/// One line of the summary.
pub struct Row {
    pub suite: String,
    pub kernel: String,
    pub accel: String,
    pub boot_seconds: Option<f64>,
    pub run_seconds: f64,
    pub result: String,
    pub ok: bool,
}

/// The guest kernel and its initramfs, checked before the host run so a
/// machine without them fails at once (never skips).
pub fn prepare() -> anyhow::Result<vm::Kernel> {
    let kernel = vm::Kernel::cached().context(
        "the 6.1 test VM is part of `cargo xtask test` (use --no-vm to leave it out locally)",
    )?;
    vm::initramfs(&kernel)?;
    Ok(kernel)
}

/// The deadline multiplier for the guest's tests: 10 under TCG (15–35
/// times slower than the host, but the tests' deadlines hold several times
/// what a round trip takes), 1 under KVM; a value in our environment wins.
pub fn time_scale(accel: Accel) -> String {
    std::env::var(TIME_SCALE_VAR).unwrap_or_else(|_| {
        match accel {
            Accel::Kvm => "1",
            Accel::Tcg => "10",
        }
        .to_owned()
    })
}

/// The suites named (all of them if none is).
pub fn select(names: &[String]) -> anyhow::Result<Vec<&'static Suite>> {
    if let Some(unknown) = names.iter().find(|n| !SUITES.iter().any(|s| s.name == *n)) {
        let known: Vec<&str> = SUITES.iter().map(|s| s.name).collect();
        bail!("no guest suite {unknown} (there are {})", known.join(", "));
    }
    Ok(SUITES
        .iter()
        .filter(|s| names.is_empty() || names.iter().any(|n| n == s.name))
        .collect())
}

/// Runs `suites`, each in its own guest, one after the other; a failing
/// suite does not stop the others. Returns a row per suite.
pub fn run_all(
    root: &Path,
    binaries: &BTreeMap<String, std::path::PathBuf>,
    suites: &[&Suite],
) -> Vec<Row> {
    let accel = vm::accel();
    let scale = time_scale(accel);
    // The choice is a budget (the guest part of `.ci/run` within ~20
    // minutes under TCG): said before the run, not only in the summary.
    eprintln!("\nthe 6.1 guest runs (one guest each, {accel:?}):");
    for s in suites {
        eprintln!("  {}", label(s));
        if let Some(subset) = s.subset {
            eprintln!("    {subset}");
        }
    }
    suites
        .iter()
        .map(|suite| match run_suite(root, binaries, suite, &scale) {
            Ok(row) => row,
            Err(e) => Row {
                suite: label(suite),
                kernel: "?".into(),
                accel: format!("{accel:?}").to_lowercase(),
                boot_seconds: None,
                run_seconds: 0.0,
                result: format!("ERROR: {}", first_line(&format!("{e:#}"))),
                ok: false,
            },
        })
        .collect()
}

/// The suite and its filters (not libtest's switches, nor what `--skip`
/// leaves out: the summary's note says that).
fn label(suite: &Suite) -> String {
    let mut filters = Vec::new();
    let mut args = suite.args.iter();
    while let Some(a) = args.next() {
        if *a == "--skip" {
            args.next();
        } else if !a.starts_with("--") {
            filters.push(*a);
        }
    }
    match filters.as_slice() {
        [] => suite.name.to_owned(),
        f => format!("{} {}", suite.name, f.join(" ")),
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

fn run_suite(
    root: &Path,
    binaries: &BTreeMap<String, std::path::PathBuf>,
    suite: &Suite,
    scale: &str,
) -> anyhow::Result<Row> {
    let exe = binaries
        .get(suite.name)
        .with_context(|| format!("cargo built no test target named {}", suite.name))?;
    let mut command = vec![
        exe.to_string_lossy().into_owned(),
        "--test-threads=1".into(),
    ];
    command.extend(suite.args.iter().map(|a| (*a).to_owned()));
    let mut spec = vm::VmSpec::new(command);
    spec.cwd = Some(root.join("policy-agent"));
    // The guest mounts fresh tmpfs over /tmp, /run and /var/tmp: a
    // checkout (or a target directory) there is shared on its own.
    let build_dir = exe.parent().and_then(Path::parent).unwrap_or(root);
    for dir in [root, build_dir] {
        if vm::hidden_in_guest(dir) && !spec.writable.iter().any(|w| dir.starts_with(w)) {
            spec.writable.push(dir.to_path_buf());
        }
    }
    spec.timeout = suite.timeout;
    spec.stream = true;
    spec.env = vec![
        (TIME_SCALE_VAR.to_owned(), scale.to_owned()),
        ("RUST_BACKTRACE".to_owned(), "1".to_owned()),
        // Built beside the test binaries by `test::run` (debug profile).
        (
            "POLICY_CNI_BIN".to_owned(),
            build_dir.join("policy-cni").to_string_lossy().into_owned(),
        ),
    ];
    spec.env.extend(
        suite
            .env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    eprintln!(
        "\n=== guest: {} ({TIME_SCALE_VAR}={scale}) ===",
        label(suite)
    );
    let out = vm::run(&spec)?;
    for l in out.kernel_trouble() {
        eprintln!("vm: guest kernel: {l}");
    }
    if out.kernel_release.is_empty() {
        bail!("the guest did not report its kernel");
    }
    let summary = libtest_summary(&out.stdout);
    // The guest has what a test skips for elsewhere (the sctp module, ...):
    // a skip there is a failure.
    let skipped = out.stdout.contains(SKIP_MARK) || out.stderr.contains(SKIP_MARK);
    let (ok, result) = match (&summary, out.status) {
        (Some(_), 0) if skipped => (false, format!("FAILED: a test printed {SKIP_MARK}")),
        (Some(s), 0) if s.passed > 0 && s.failed == 0 => (true, format!("ok, {} passed", s.passed)),
        (Some(s), 0) => (
            false,
            format!("FAILED: {} passed, {} failed", s.passed, s.failed),
        ),
        (Some(s), status) => (
            false,
            format!(
                "FAILED: {} passed, {} failed (exit {status})",
                s.passed, s.failed
            ),
        ),
        (None, status) => (false, format!("FAILED: no test summary (exit {status})")),
    };
    Ok(Row {
        suite: label(suite),
        kernel: out.kernel_release,
        accel: format!("{:?}", out.accel).to_lowercase(),
        boot_seconds: Some(out.boot_seconds),
        run_seconds: out.run_seconds,
        result,
        ok,
    })
}

/// Counts from libtest's last `test result:` line.
#[derive(Debug, PartialEq, Eq)]
struct Summary {
    passed: u32,
    failed: u32,
}

fn libtest_summary(stdout: &str) -> Option<Summary> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("test result:"))?;
    let count = |what: &str| -> Option<u32> {
        line.split(';')
            .find_map(|part| part.trim().strip_suffix(what))
            .and_then(|n| n.trim().rsplit(' ').next())
            .and_then(|n| n.parse().ok())
    };
    Some(Summary {
        passed: count(" passed")?,
        failed: count(" failed")?,
    })
}

/// The summary table, and below it what each suite left out.
pub fn render(rows: &[Row]) -> String {
    let header = ["suite", "kernel", "accel", "boot s", "run s", "result"];
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            [
                r.suite.clone(),
                r.kernel.clone(),
                r.accel.clone(),
                r.boot_seconds.map_or("-".into(), |b| format!("{b:.1}")),
                format!("{:.1}", r.run_seconds),
                r.result.clone(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let line = |row: &[String]| -> String {
        row.iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if (3..5).contains(&i) {
                    format!("{c:>w$}")
                } else {
                    format!("{c:<w$}")
                }
            })
            .collect::<Vec<_>>()
            .join(" | ")
            .trim_end()
            .to_owned()
    };
    let mut out = line(&header.map(str::to_owned));
    out.push('\n');
    out.push_str(
        &widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-|-"),
    );
    out.push('\n');
    for row in &cells {
        out.push_str(&line(row));
        out.push('\n');
    }
    let guest_total: f64 = rows
        .iter()
        .filter_map(|r| r.boot_seconds.map(|b| b + r.run_seconds))
        .sum();
    out.push_str(&format!("guest total: {guest_total:.0} s\n"));
    for s in SUITES {
        if let Some(subset) = s.subset
            && rows
                .iter()
                .any(|r| r.suite.split(' ').next() == Some(s.name))
        {
            out.push_str(&format!("in the guest, {}: {subset}\n", s.name));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_libtest_summary_counts() {
        let out = "running 3 tests\ntest a ... ok\n\ntest result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 17 filtered out; finished in 1.00s\n\n";
        assert_eq!(
            libtest_summary(out),
            Some(Summary {
                passed: 3,
                failed: 0
            })
        );
        let failed = "test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.5s";
        assert_eq!(
            libtest_summary(failed),
            Some(Summary {
                passed: 1,
                failed: 2
            })
        );
        assert_eq!(libtest_summary("thread 'main' panicked"), None);
    }

    #[test]
    fn the_table_names_kernel_accel_times_and_subsets() {
        let rows = [
            Row {
                suite: "host: every test".into(),
                kernel: "6.18.0".into(),
                accel: "host".into(),
                boot_seconds: None,
                run_seconds: 500.0,
                result: "ok".into(),
                ok: true,
            },
            Row {
                suite: "conformance bpf::".into(),
                kernel: "6.1.0-56-amd64".into(),
                accel: "tcg".into(),
                boot_seconds: Some(8.04),
                run_seconds: 300.0,
                result: "ok, 17 passed".into(),
                ok: true,
            },
        ];
        let t = render(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "suite             | kernel         | accel | boot s | run s | result"
        );
        assert!(
            lines[3].starts_with(
                "conformance bpf:: | 6.1.0-56-amd64 | tcg   |    8.0 | 300.0 | ok, 17 passed"
            ),
            "{t}"
        );
        assert!(t.contains("guest total: 308 s"), "{t}");
        assert!(
            t.contains("in the guest, conformance: only three tests"),
            "{t}"
        );
    }
}
