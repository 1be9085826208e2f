//! deploy/ validated offline: every manifest against the Kubernetes JSON
//! schemas (kubernetes-validate, strict: unknown fields rejected), the
//! kustomization's references, and the DaemonSet's contract (host network,
//! pinned bpffs from the host, least capabilities, probes, every node).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{path::Path, process::Command};

use k8s_openapi::api::{apps::v1::DaemonSet, rbac::v1::ClusterRole};
use serde::Deserialize as _;

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");

fn docs(file: &str) -> Vec<serde_yaml::Value> {
    let text = std::fs::read_to_string(Path::new(DEPLOY).join(file)).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .collect()
}

#[test]
fn manifests_pass_strict_schema_validation() {
    for file in [
        "rbac.yaml",
        "daemonset.yaml",
        "kind/smoke.yaml",
        "kind/smoke-deny.yaml",
        "kind/smoke-allow.yaml",
    ] {
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "--kubernetes-version", "1.33.0"])
            .arg(Path::new(DEPLOY).join(file))
            .output()
            .expect("kubernetes-validate is installed by scripts/setup.sh");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && !text.contains("ERROR"),
            "{file}:\n{text}"
        );
        assert!(
            text.contains("passed"),
            "{file}: nothing validated:\n{text}"
        );
    }
}

#[test]
fn the_kustomization_names_existing_files_and_the_image() {
    let k = &docs("kustomization.yaml")[0];
    for r in k["resources"].as_sequence().unwrap() {
        assert!(
            Path::new(DEPLOY).join(r.as_str().unwrap()).exists(),
            "{r:?}"
        );
    }
    assert_eq!(k["images"][0]["name"].as_str(), Some("policy-agent"));
}

#[test]
fn the_daemonset_runs_everywhere_with_least_privilege() {
    let ds: DaemonSet = serde_yaml::from_value(docs("daemonset.yaml").remove(0)).unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert!(
        pod.tolerations
            .unwrap()
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none())
    );
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, None, "not privileged");
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    for cap in caps.add.as_ref().unwrap() {
        assert!(
            ["BPF", "PERFMON", "NET_ADMIN", "NET_RAW", "SYS_ADMIN"].contains(&cap.as_str()),
            "unexpected capability {cap}"
        );
    }
    assert!(
        c.readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref()
            == Some("/readyz")
    );
    assert!(
        c.liveness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref()
            == Some("/healthz")
    );
    assert!(c.resources.as_ref().unwrap().requests.is_some());
    let env = c.env.as_ref().unwrap();
    assert!(env.iter().any(|e| {
        e.name == "NODE_NAME"
            && e.value_from
                .as_ref()
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.as_str())
                == Some("spec.nodeName")
    }));
    let bpffs = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "bpffs")
        .unwrap();
    assert_eq!(
        bpffs.host_path.unwrap().path,
        "/sys/fs/bpf",
        "pins outlive the pod"
    );
}

#[test]
fn rbac_grants_reads_of_exactly_what_is_watched_and_events() {
    let role: ClusterRole = serde_yaml::from_value(docs("rbac.yaml").remove(1)).unwrap();
    let mut read = std::collections::BTreeSet::new();
    for rule in role.rules.unwrap() {
        let resources = rule.resources.unwrap_or_default();
        let verbs = rule.verbs;
        if resources == ["events"] {
            assert_eq!(verbs, ["create", "patch"]);
        } else {
            assert_eq!(verbs, ["get", "list", "watch"], "{resources:?}");
            for group in rule.api_groups.unwrap_or_default() {
                for r in &resources {
                    read.insert((group.clone(), r.clone()));
                }
            }
        }
    }
    let watched: std::collections::BTreeSet<(String, String)> = policy_agent::source::kube::WATCHED
        .iter()
        .map(|(g, r)| (g.to_string(), r.to_string()))
        .collect();
    assert_eq!(
        read, watched,
        "a watch without its grant never syncs; a grant without a watch is more than needed"
    );
}
