//! The test (or bench) binaries cargo built, found by target name.
use std::{collections::BTreeMap, io::BufRead as _, path::PathBuf, process::Stdio};

use anyhow::{Context as _, bail};
use serde_json::Value;

/// Builds every test target of the workspace (`cargo test --workspace
/// --no-run`) and returns each test target's executable by name (the
/// file under `tests/`, e.g. `kernel_netns`).
pub fn build() -> anyhow::Result<BTreeMap<String, PathBuf>> {
    built(&["test", "--workspace", "--no-run"], "test")
}

/// Runs `cargo <args> --message-format=json-render-diagnostics` (a build
/// with `--no-run`) and returns each target of `kind` ("test", "bench")
/// it built, by name.
pub fn built(args: &[&str], kind: &str) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut cmd = crate::cargo();
    cmd.args(args)
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped());
    eprintln!("+ {cmd:?}");
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut found = BTreeMap::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's output")?;
        if let Some((name, exe)) = executable(&line, kind)
            && let Some(other) = found.insert(name.clone(), exe.clone())
            && other != exe
        {
            bail!(
                "two test targets named {name}: {} and {}",
                other.display(),
                exe.display()
            );
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(found)
}

/// The name and executable of a target of `kind` from one line of
/// cargo's JSON messages.
fn executable(line: &str, kind: &str) -> Option<(String, PathBuf)> {
    let v: Value = serde_json::from_str(line).ok()?;
    if v["reason"] != "compiler-artifact" {
        return None;
    }
    let target = &v["target"];
    if !target["kind"]
        .as_array()?
        .iter()
        .any(|k| k.as_str() == Some(kind))
    {
        return None;
    }
    Some((
        target["name"].as_str()?.to_owned(),
        PathBuf::from(v["executable"].as_str()?),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_test_targets_with_an_executable_count() {
        let test = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"kernel_netns"},"executable":"/t/debug/deps/kernel_netns-0f"}"#;
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"policy_agent"},"executable":"/t/x"}"#;
        let unit = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"policy-agent"},"executable":"/t/u"}"#;
        let fresh = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"x"},"executable":null}"#;
        let bench = r#"{"reason":"compiler-artifact","target":{"kind":["bench"],"name":"datapath"},"executable":"/t/release/deps/datapath-1a"}"#;
        assert_eq!(
            executable(bench, "bench"),
            Some((
                "datapath".to_owned(),
                PathBuf::from("/t/release/deps/datapath-1a")
            ))
        );
        assert_eq!(executable(bench, "test"), None);
        assert_eq!(
            executable(test, "test"),
            Some((
                "kernel_netns".to_owned(),
                PathBuf::from("/t/debug/deps/kernel_netns-0f")
            ))
        );
        for other in [
            lib,
            unit,
            fresh,
            "not json",
            r#"{"reason":"build-finished"}"#,
        ] {
            assert_eq!(executable(other, "test"), None, "{other}");
        }
    }
}
