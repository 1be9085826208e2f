//! `cargo xtask run`: a local kind cluster with the agent as a DaemonSet,
//! then a smoke check (default deny blocks a probe; an allow lets it in).
//! Needs docker, kind and kubectl; `--dry-run` prints the plan instead.
use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};

pub const CLUSTER: &str = "policy-agent";
pub const IMAGE: &str = "policy-agent:dev";

/// What a step must do for the run to go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    Success,
    /// Retried until it succeeds (waiting for enforcement to land).
    EventuallySuccess,
    EventuallyFailure,
}

#[derive(Clone, Debug)]
pub struct Step {
    pub what: &'static str,
    pub argv: Vec<String>,
    pub stdin: Option<PathBuf>,
    pub expect: Expect,
    /// Store trimmed stdout under this name; `{NAME}` in later argv is replaced.
    pub capture: Option<&'static str>,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.argv.join(" "))?;
        if let Some(p) = &self.stdin {
            write!(f, " < {}", p.display())?;
        }
        match self.expect {
            Expect::Success => Ok(()),
            Expect::EventuallySuccess => write!(f, "   # retried until it succeeds"),
            Expect::EventuallyFailure => write!(f, "   # retried until it fails"),
        }
    }
}

fn step(what: &'static str, argv: &[&str]) -> Step {
    Step {
        what,
        argv: argv.iter().map(|s| (*s).to_owned()).collect(),
        stdin: None,
        expect: Expect::Success,
        capture: None,
    }
}

/// Every command `xtask run` executes, in order.
pub fn plan(root: &Path) -> Vec<Step> {
    let ctx = format!("--context=kind-{CLUSTER}");
    let ctx = ctx.as_str();
    let deploy = root.join("deploy");
    let path = |p: &str| deploy.join(p).display().to_string();
    let kind_config = path("kind/kind-config.yaml");
    let dockerfile = path("Dockerfile");
    let root_s = root.display().to_string();
    let kustomize = deploy.display().to_string();
    let smoke = path("kind/smoke.yaml");
    let deny = path("kind/smoke-deny.yaml");
    let allow = path("kind/smoke-allow.yaml");
    let node = format!("{CLUSTER}-control-plane");
    let connect = [
        "kubectl",
        ctx,
        "-n",
        "policy-smoke",
        "exec",
        "probe",
        "--",
        "/agnhost",
        "connect",
        "{SERVER_IP}:8080",
        "--timeout=2s",
    ];
    let mut cni = step(
        "install kindnet's ptp list without kindnetd (its own policy enforcement would race ours)",
        &[
            "docker",
            "exec",
            "-i",
            &node,
            "sh",
            "-c",
            "cat > /etc/cni/net.d/10-kindnet.conflist",
        ],
    );
    cni.stdin = Some(deploy.join("kind/kindnet.conflist"));
    let mut ip = step(
        "find the server's IP",
        &[
            "kubectl",
            ctx,
            "-n",
            "policy-smoke",
            "get",
            "pod",
            "server",
            "-o",
            "jsonpath={.status.podIP}",
        ],
    );
    ip.capture = Some("SERVER_IP");
    let mut chained = step(
        "the plugin is chained (cni-install wrote our list once the agent answered)",
        &[
            "docker",
            "exec",
            &node,
            "grep",
            "-q",
            "\"type\": \"policy-cni\"",
            "/etc/cni/net.d/00-policy-agent.conflist",
        ],
    );
    chained.expect = Expect::EventuallySuccess;
    let mut open = step("the probe reaches the server (no policy)", &connect);
    open.expect = Expect::EventuallySuccess;
    let mut blocked = step("default deny blocks the probe", &connect);
    blocked.expect = Expect::EventuallyFailure;
    let mut allowed = step("the allow policy lets the probe in", &connect);
    allowed.expect = Expect::EventuallySuccess;
    vec![
        step(
            "check docker",
            &["docker", "version", "--format", "{{.Server.Version}}"],
        ),
        step("check kind", &["kind", "version"]),
        step("check kubectl", &["kubectl", "version", "--client"]),
        step(
            "create the kind cluster",
            &[
                "kind",
                "create",
                "cluster",
                "--name",
                CLUSTER,
                "--config",
                &kind_config,
            ],
        ),
        cni,
        step(
            "wait for the node",
            &[
                "kubectl",
                ctx,
                "wait",
                "--for=condition=Ready",
                "node",
                "--all",
                "--timeout=180s",
            ],
        ),
        step(
            "build the image",
            &["docker", "build", "-f", &dockerfile, "-t", IMAGE, &root_s],
        ),
        step(
            "load it into kind",
            &["kind", "load", "docker-image", IMAGE, "--name", CLUSTER],
        ),
        step(
            "deploy the agent",
            &["kubectl", ctx, "apply", "-k", &kustomize],
        ),
        step(
            "wait for the rollout",
            &[
                "kubectl",
                ctx,
                "-n",
                "kube-system",
                "rollout",
                "status",
                "ds/policy-agent",
                "--timeout=180s",
            ],
        ),
        chained,
        step(
            "create the smoke pods",
            &["kubectl", ctx, "apply", "-f", &smoke],
        ),
        step(
            "wait for them",
            &[
                "kubectl",
                ctx,
                "-n",
                "policy-smoke",
                "wait",
                "--for=condition=Ready",
                "pod/server",
                "pod/probe",
                "--timeout=180s",
            ],
        ),
        ip,
        open,
        step(
            "apply default deny",
            &["kubectl", ctx, "apply", "-f", &deny],
        ),
        blocked,
        step(
            "apply the allow policy",
            &["kubectl", ctx, "apply", "-f", &allow],
        ),
        allowed,
    ]
}

fn substitute(argv: &[String], vars: &BTreeMap<&str, String>) -> Vec<String> {
    argv.iter()
        .map(|a| {
            vars.iter()
                .fold(a.clone(), |acc, (k, v)| acc.replace(&format!("{{{k}}}"), v))
        })
        .collect()
}

fn once(s: &Step, argv: &[String]) -> anyhow::Result<(bool, String)> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(p) = &s.stdin {
        cmd.stdin(std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {} (is it installed?)", argv[0]))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
    ))
}

/// Runs the plan, or prints it with `dry_run`.
pub fn run(root: &Path, dry_run: bool) -> anyhow::Result<()> {
    let steps = plan(root);
    if dry_run {
        for (i, s) in steps.iter().enumerate() {
            println!("# {}. {}\n{s}", i + 1, s.what);
        }
        return Ok(());
    }
    let mut vars = BTreeMap::new();
    for s in &steps {
        eprintln!("==> {}", s.what);
        let argv = substitute(&s.argv, &vars);
        let (want, retries) = match s.expect {
            Expect::Success => (true, 1),
            Expect::EventuallySuccess => (true, 30),
            Expect::EventuallyFailure => (false, 30),
        };
        let mut last = (false, String::new());
        for attempt in 0..retries {
            last = once(s, &argv)?;
            if last.0 == want {
                break;
            }
            if attempt + 1 < retries {
                std::thread::sleep(Duration::from_secs(2));
            }
        }
        if last.0 != want {
            bail!("step failed: {} ({})", s.what, argv.join(" "));
        }
        if let Some(name) = s.capture {
            vars.insert(name, last.1);
        }
    }
    println!("smoke check passed: default deny blocked the probe, the allow policy let it in");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn position(steps: &[Step], needle: &str) -> usize {
        steps
            .iter()
            .position(|s| s.to_string().contains(needle))
            .unwrap_or_else(|| panic!("no step with {needle:?}"))
    }

    #[test]
    fn the_plan_creates_builds_loads_deploys_then_checks_deny_and_allow() {
        let steps = plan(Path::new("/repo"));
        let order = [
            "kind create cluster --name policy-agent --config /repo/deploy/kind/kind-config.yaml",
            "10-kindnet.conflist < /repo/deploy/kind/kindnet.conflist",
            "docker build -f /repo/deploy/Dockerfile -t policy-agent:dev /repo",
            "kind load docker-image policy-agent:dev --name policy-agent",
            "apply -k /repo/deploy",
            "rollout status ds/policy-agent",
            "00-policy-agent.conflist",
            "apply -f /repo/deploy/kind/smoke.yaml",
            "apply -f /repo/deploy/kind/smoke-deny.yaml",
            "apply -f /repo/deploy/kind/smoke-allow.yaml",
        ];
        let positions: Vec<usize> = order.iter().map(|n| position(&steps, n)).collect();
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "steps out of order: {positions:?}"
        );
        let deny = position(&steps, "smoke-deny.yaml");
        let allow = position(&steps, "smoke-allow.yaml");
        assert_eq!(
            steps[deny + 1].expect,
            Expect::EventuallyFailure,
            "the probe must be blocked after default deny"
        );
        assert_eq!(
            steps[allow + 1].expect,
            Expect::EventuallySuccess,
            "and allowed after the allow policy"
        );
        assert!(steps[deny + 1].argv.iter().any(|a| a == "{SERVER_IP}:8080"));
        // Every kubectl call targets the kind cluster, never the user's current context.
        for s in steps
            .iter()
            .filter(|s| s.argv[0] == "kubectl" && s.argv[1] != "version")
        {
            assert_eq!(s.argv[1], "--context=kind-policy-agent", "{s}");
        }
    }

    #[test]
    fn the_files_the_plan_uses_exist() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        for s in plan(root) {
            for a in s
                .argv
                .iter()
                .filter(|a| a.starts_with(root.to_str().unwrap()))
            {
                assert!(Path::new(a).exists(), "{a} is missing");
            }
            if let Some(p) = &s.stdin {
                assert!(p.exists(), "{} is missing", p.display());
            }
        }
    }

    #[test]
    fn captured_values_are_substituted() {
        let mut vars = BTreeMap::new();
        vars.insert("SERVER_IP", "10.244.0.7".to_owned());
        let argv = substitute(&["connect".into(), "{SERVER_IP}:8080".into()], &vars);
        assert_eq!(argv[1], "10.244.0.7:8080");
    }
}
