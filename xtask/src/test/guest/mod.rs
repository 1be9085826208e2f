//! The kernel suites again, each in its own 6.1 guest (`crate::vm`): no
//! TCX there, so the agent takes its netlink fallback and the tests
//! assert that path.
use std::{
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::vm::{self, Accel};

/// What the guest's tests read to stretch their deadlines (see
/// `testbed/src/fixtures/deadline.rs`).
const TIME_SCALE_VAR: &str = "POLICY_AGENT_TEST_TIME_SCALE";

/// What a test prints when it skips for want of a kernel feature.
const SKIP_MARK: &str = "SKIPPED";

/// The test binary the guest runs (`testbed/tests/privileged`).
pub const PRIVILEGED: &str = "privileged";

/// A part of the privileged suite run in its own guest.
pub struct Suite {
    /// Its name (`--vm-suite`, the summary).
    pub name: &'static str,
    /// The tests: every one whose full name starts with one of these
    /// module paths (or is one of these names).
    pub prefixes: &'static [&'static str],
    /// Of those, only the ones whose name contains one of these (empty:
    /// all).
    pub only: &'static [&'static str],
    /// Of those, not these (names relative to the prefix they matched).
    pub skip: &'static [&'static str],
    /// Show the tests' output (a skip line must be seen to fail the
    /// suite).
    pub nocapture: bool,
    /// What the guest leaves to the host, if anything: printed with the
    /// summary.
    pub subset: Option<&'static str>,
    /// The VM is killed after this long (boot included), under TCG.
    pub timeout: Duration,
}

/// The suites the guest runs, the longest first (see [`run_all`]): those
/// that load or attach the classifier (what the older verifier and the missing TCX change), and
/// SCTP and kube-proxy's IPVS mode (modules the host lacks), chosen to
/// keep the guest part of `.ci/run` within budget under TCG on two cores.
/// On the host only: `iptables_hardening`, most of `iptables`,
/// `services::{basics,changes,simulated}`, `cluster_mode`,
/// `node_addresses`, `pod_range_guard_netns`, `bad_input_daemon`, the CNI
/// plugin tests and most of `conformance` (see its note). The
/// unprivileged suite never needs a kernel of its own. Each guest runs its
/// tests one at a time: the guest has two vCPUs, and tests that share
/// them under emulation would only stretch each other's deadlines.
pub const SUITES: &[Suite] = &[
    // kube-proxy's IPVS mode (the host has no ip_vs): its tests print
    // SKIPPED there, and a skip here fails the suite, so the output is
    // shown.
    Suite::shown("ipvs", &["services::ipvs::"], 900),
    // The encapsulation tests run IPIP where the kernel has it (the host
    // has not: they print SKIPPED there, and a skip here fails the suite,
    // so the output is shown). With them, the pod network over a GRE
    // tunnel (the host has no GRE): the uplink programs for a device
    // without a link-layer header. 781 s under TCG beside another guest.
    //
    // The iptables twins of the raw-socket, cut-connection and neighbour
    // discovery attacks stay on the host: they judge in netfilter, which
    // the guest's iptables suite and encapsulation attacks already cover,
    // and they cost the guest budget minutes.
    Suite {
        skip: &[
            "an_attacker_pod_reaches_nothing_its_victims_policy_forbids_iptables",
            "a_cut_connection_stays_cut_when_the_victim_speaks_first_iptables",
            "neighbour_discovery_look_alikes_reach_nothing_iptables",
        ],
        subset: Some(
            "the iptables twins of the raw-socket, cut-connection and neighbour \
             discovery attacks run on the host only (netfilter's part is covered \
             in the guest by the encapsulation attacks and the iptables suite)",
        ),
        ..Suite::shown(
            "attacker",
            &["attacker::", "services::basics::tunnel::bpf_"],
            1500,
        )
    },
    Suite {
        // The daemon attaching late pods and cutting established flows
        // through the netlink filters; the whole suite takes ~23 minutes
        // per datapath under TCG, past the budget.
        name: "conformance",
        prefixes: &[
            "conformance::bpf::run_mode_attaches_a_pod_whose_interface_and_route_appear_later",
            "conformance::bpf::established_connections_are_cut_when_a_policy_denies_them",
        ],
        only: &[],
        skip: &[],
        nocapture: false,
        subset: Some(
            "only two tests (BPF: the daemon attaching a late pod, established \
             connections cut; on iptables the cut, through ctnetlink marks, is the \
             iptables suite's); the rest run on the host only (the whole suite takes \
             ~23 min per datapath in the TCG guest)",
        ),
        timeout: Duration::from_secs(1800),
    },
    Suite {
        // One process: the classifier loaded once is reused by every
        // test of the same kind (the verifier is what a load costs).
        name: "kernel",
        prefixes: &["kernel::"],
        only: &[],
        skip: &[],
        nocapture: false,
        subset: None,
        timeout: Duration::from_secs(1800),
    },
    Suite {
        // The skip line is printed by a passing test: shown, and checked.
        name: "sctp",
        prefixes: &["sctp::"],
        only: &[],
        skip: &[],
        nocapture: true,
        subset: None,
        timeout: Duration::from_secs(600),
    },
    Suite {
        name: "netns",
        prefixes: &["netns::"],
        only: &[],
        // Below 6.6 the TCX-named tests ask for TCX and fall back to
        // netlink filters, the default path their netlink twins take.
        skip: &[
            "netlink_attachments_enforce_and_outlive_the_loader",
            "netlink_filters_run_before_foreign_filters_of_a_later_priority",
        ],
        nocapture: false,
        subset: Some(
            "all but the netlink twins: without TCX their TCX-named tests \
             take that path already, through the fallback",
        ),
        timeout: Duration::from_secs(600),
    },
    Suite {
        // The hand-off with Debian's real plugins through netlink filters
        // (no TCX): the standby attachment, and one first-packet run.
        name: "cni",
        prefixes: &["cni::agent::"],
        only: &["a_new_veth_is_prepared", "first_packet_manifests"],
        skip: &[],
        nocapture: false,
        subset: Some("the standby attachment and the first-packet test in manifests mode"),
        timeout: Duration::from_secs(600),
    },
    Suite::module("full_maps", &["full_maps::"], 600),
    Suite {
        // Conntrack marks set over ctnetlink, with the bit as its own mask
        // (the kernel must keep the other bits).
        name: "iptables",
        prefixes: &["iptables::"],
        only: &["revocation_marks_every_flow"],
        skip: &[],
        nocapture: false,
        subset: Some("the conntrack revocation of a busy pod (ctnetlink marks)"),
        timeout: Duration::from_secs(600),
    },
];

impl Suite {
    /// A whole module of the privileged suite, no output shown.
    const fn module(
        name: &'static str,
        prefixes: &'static [&'static str],
        timeout_secs: u64,
    ) -> Suite {
        Suite {
            name,
            prefixes,
            only: &[],
            skip: &[],
            nocapture: false,
            subset: None,
            timeout: Duration::from_secs(timeout_secs),
        }
    }

    /// [`Self::module`] with the output shown (a test printing SKIPPED
    /// fails it).
    const fn shown(
        name: &'static str,
        prefixes: &'static [&'static str],
        timeout_secs: u64,
    ) -> Suite {
        Suite {
            nocapture: true,
            ..Suite::module(name, prefixes, timeout_secs)
        }
    }

    /// The tests of `all` (full names) this suite runs, in order.
    pub fn tests<'a>(&self, all: &'a [String]) -> Vec<&'a str> {
        all.iter()
            .map(String::as_str)
            .filter(|t| {
                self.prefixes.iter().any(|p| {
                    t.strip_prefix(p).is_some_and(|rest| {
                        (self.only.is_empty() || self.only.iter().any(|o| rest.contains(o)))
                            && !self.skip.contains(&rest)
                    })
                })
            })
            .collect()
    }
}

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

/// Runs `suites`, each in its own guest, `jobs` guests at a time (in the
/// order given: the longest first keeps the last guest from running
/// alone); a failing suite does not stop the others. Returns a row per
/// suite, in the order given.
///
/// Guests side by side pay off because a guest spends much of its time
/// waiting (for a reply that must not come, a deadline scaled for TCG);
/// their lines are labelled with the suite.
pub fn run_all(
    root: &Path,
    privileged: &Path,
    suites: &[&Suite],
    jobs: usize,
) -> anyhow::Result<Vec<Row>> {
    let all = list(privileged)?;
    let accel = vm::accel();
    let scale = time_scale(accel);
    let jobs = jobs.clamp(1, suites.len().max(1));
    // The choice is a budget (the guest part of `.ci/run`): said before
    // the run, not only in the summary.
    eprintln!("\nthe 6.1 guest runs (one guest each, {jobs} at a time, {accel:?}):");
    for s in suites {
        eprintln!("  {} ({} tests)", s.name, s.tests(&all).len());
        if let Some(subset) = s.subset {
            eprintln!("    {subset}");
        }
    }
    let next = AtomicUsize::new(0);
    let rows: Mutex<Vec<Option<Row>>> = Mutex::new(suites.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                while let Some(suite) = suites.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let label = (jobs > 1).then_some(suite.name);
                    let row = run_suite(root, privileged, &all, suite, &scale, label)
                        .unwrap_or_else(|e| Row {
                            suite: suite.name.to_owned(),
                            kernel: "?".into(),
                            accel: format!("{accel:?}").to_lowercase(),
                            boot_seconds: None,
                            run_seconds: 0.0,
                            result: format!("ERROR: {}", first_line(&format!("{e:#}"))),
                            ok: false,
                        });
                    let i = suites.iter().position(|s| s.name == suite.name);
                    if let (Ok(mut rows), Some(i)) = (rows.lock(), i) {
                        rows[i] = Some(row);
                    }
                }
            });
        }
    });
    let rows = rows
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a guest runner panicked"))?;
    rows.into_iter()
        .zip(suites)
        .map(|(r, s)| r.with_context(|| format!("suite {} did not run", s.name)))
        .collect()
}

/// Every test of the privileged binary that runs by default, by full
/// name (`--list`, without the `#[ignore]`d ones: they run on request
/// only, on the host too).
fn list(privileged: &Path) -> anyhow::Result<Vec<String>> {
    let ignored = list_with(privileged, &["--ignored"])?;
    Ok(list_with(privileged, &[])?
        .into_iter()
        .filter(|t| !ignored.contains(t))
        .collect())
}

fn list_with(privileged: &Path, extra: &[&str]) -> anyhow::Result<Vec<String>> {
    let out = std::process::Command::new(privileged)
        .args(["--list", "--format", "terse"])
        .args(extra)
        .output()
        .with_context(|| format!("listing the tests of {}", privileged.display()))?;
    if !out.status.success() {
        bail!(
            "{} --list failed: {}",
            privileged.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_owned)
        .collect())
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

fn run_suite(
    root: &Path,
    privileged: &Path,
    all: &[String],
    suite: &Suite,
    scale: &str,
    label: Option<&str>,
) -> anyhow::Result<Row> {
    let tests = suite.tests(all);
    if tests.is_empty() {
        bail!("no test of {PRIVILEGED} matches suite {}", suite.name);
    }
    let mut command = vec![
        privileged.to_string_lossy().into_owned(),
        "--test-threads=1".into(),
        "--exact".into(),
    ];
    if suite.nocapture {
        command.push("--nocapture".into());
    }
    command.extend(tests.iter().map(|t| (*t).to_owned()));
    let mut spec = vm::VmSpec::new(command);
    spec.cwd = Some(root.join("testbed"));
    // The guest mounts fresh tmpfs over /tmp, /run and /var/tmp: a
    // checkout (or a target directory) there is shared on its own.
    let build_dir = privileged.parent().and_then(Path::parent).unwrap_or(root);
    for dir in [root, build_dir] {
        if vm::hidden_in_guest(dir) && !spec.writable.iter().any(|w| dir.starts_with(w)) {
            spec.writable.push(dir.to_path_buf());
        }
    }
    spec.timeout = suite.timeout;
    spec.stream = true;
    spec.label = label.map(str::to_owned);
    spec.env = vec![
        (TIME_SCALE_VAR.to_owned(), scale.to_owned()),
        ("RUST_BACKTRACE".to_owned(), "1".to_owned()),
        // Built beside the test binary by `test::run` (debug profile):
        // the guest has no toolchain to build them.
        (
            "POLICY_AGENT_BIN".to_owned(),
            build_dir
                .join("policy-agent")
                .to_string_lossy()
                .into_owned(),
        ),
        (
            "POLICY_CNI_BIN".to_owned(),
            build_dir.join("policy-cni").to_string_lossy().into_owned(),
        ),
    ];
    eprintln!(
        "\n=== guest: {} ({} tests, {TIME_SCALE_VAR}={scale}) ===",
        suite.name,
        tests.len()
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
        (Some(s), 0) if s.passed as usize == tests.len() && s.failed == 0 => {
            (true, format!("ok, {} passed", s.passed))
        }
        (Some(s), 0) => (
            false,
            format!(
                "FAILED: {} passed, {} failed, of {}",
                s.passed,
                s.failed,
                tests.len()
            ),
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
        suite: suite.name.to_owned(),
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
            && rows.iter().any(|r| r.suite == s.name)
        {
            out.push_str(&format!("in the guest, {}: {subset}\n", s.name));
        }
    }
    out
}

#[cfg(test)]
mod tests;
