//! deploy/ validated offline: every manifest against the Kubernetes JSON
//! schemas (kubernetes-validate, strict: unknown fields rejected), the
//! kustomization's references, and the DaemonSet's contract (host network,
//! pinned bpffs from the host, least capabilities, probes, every node).
use std::{path::Path, process::Command};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Probe, rbac::v1::ClusterRole};
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
    /// The path an HTTP probe asks for.
    fn path(probe: &Option<Probe>) -> Option<&str> {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        get.path.as_deref()
    }
    assert_eq!(path(&c.readiness_probe), Some("/readyz"));
    assert_eq!(path(&c.liveness_probe), Some("/healthz"));
    // The probes reach loopback; no pod does (host network: the node's
    // other addresses are open to every pod).
    let args = c.args.as_deref().unwrap();
    let listen = args
        .iter()
        .position(|a| a == "--listen")
        .and_then(|at| args.get(at + 1))
        .expect("run --listen");
    let listen: std::net::SocketAddr = listen.parse().unwrap();
    assert!(listen.ip().is_loopback(), "--listen {listen}");
    for probe in [&c.readiness_probe, &c.liveness_probe] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.host.as_deref(), Some("127.0.0.1"));
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(listen.port().into())
        );
    }
    assert!(
        !args.iter().any(|a| a == "--metrics-listen"),
        "metrics leave the node only where the operator says so"
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
    let mut got = std::collections::BTreeSet::new();
    for rule in role.rules.unwrap() {
        let resources = rule.resources.unwrap_or_default();
        let verbs = rule.verbs;
        if resources == ["events"] {
            assert_eq!(verbs, ["create", "patch"]);
        } else if resources == ["clusternetworkpolicies/status"] {
            assert_eq!(verbs, ["patch"], "status by server-side apply only");
        } else if verbs == ["get"] {
            for group in rule.api_groups.unwrap_or_default() {
                for r in &resources {
                    got.insert((group.clone(), r.clone()));
                }
            }
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
    let read_once: std::collections::BTreeSet<(String, String)> =
        policy_agent::source::kube::READ_ONCE
            .iter()
            .map(|(g, r)| (g.to_string(), r.to_string()))
            .collect();
    assert_eq!(got, read_once, "get only, of exactly what is read once");
}

#[test]
fn rbac_lets_the_status_writer_hold_one_lease_and_nothing_more() {
    let all = docs("rbac.yaml");
    let role: k8s_openapi::api::rbac::v1::Role = serde_yaml::from_value(all[3].clone()).unwrap();
    let binding: k8s_openapi::api::rbac::v1::RoleBinding =
        serde_yaml::from_value(all[4].clone()).unwrap();
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    assert_eq!(role.metadata.namespace.as_deref(), Some("kube-system"));
    let rules = role.rules.unwrap();
    for rule in &rules {
        assert_eq!(
            rule.api_groups.as_deref(),
            Some(&["coordination.k8s.io".to_string()][..])
        );
        assert_eq!(rule.resources.as_deref(), Some(&["leases".to_string()][..]));
        if rule.verbs != ["create"] {
            assert_eq!(
                rule.resource_names.as_deref(),
                Some(&[policy_agent::source::kube::LEASE_NAME.to_string()][..]),
                "reads and updates only of the agent's own Lease"
            );
        }
    }
    let verbs: std::collections::BTreeSet<&str> = rules
        .iter()
        .flat_map(|r| r.verbs.iter().map(String::as_str))
        .collect();
    assert_eq!(verbs, ["create", "get", "update"].into());
}

fn daemonset_pod() -> k8s_openapi::api::core::v1::PodSpec {
    let ds: DaemonSet = serde_yaml::from_value(docs("daemonset.yaml").remove(0)).unwrap();
    ds.spec.unwrap().template.spec.unwrap()
}

/// Where `container` mounts the hostPath `host`.
fn mount_of(
    pod: &k8s_openapi::api::core::v1::PodSpec,
    container: &str,
    host: &str,
) -> Option<String> {
    let volume = pod
        .volumes
        .as_ref()?
        .iter()
        .find(|v| v.host_path.as_ref().is_some_and(|h| h.path == host))?;
    let c = pod.containers.iter().find(|c| c.name == container)?;
    c.volume_mounts
        .as_ref()?
        .iter()
        .find(|m| m.name == volume.name)
        .map(|m| m.mount_path.clone())
}

#[test]
fn the_cni_installer_chains_the_plugin_and_uninstalls_on_exit() {
    let pod = daemonset_pod();
    let agent = pod.containers.iter().find(|c| c.name == "agent").unwrap();
    let installer = pod
        .containers
        .iter()
        .find(|c| c.name == "cni-install")
        .expect("a cni-install container");
    assert_eq!(
        installer.image, agent.image,
        "the plugin ships in the agent's image"
    );
    assert_eq!(
        installer.command.as_deref(),
        Some(&["/usr/local/bin/policy-cni".to_owned()][..])
    );
    let (install, opts) =
        policy_cni::install::parse_args(installer.args.as_deref().unwrap()).unwrap();
    assert!(
        install && opts.watch,
        "install --watch follows the primary config"
    );
    assert!(
        opts.uninstall_on_exit,
        "a removed DaemonSet leaves no plugin behind"
    );
    assert!(
        opts.wait_for_agent,
        "the list is written once the agent answers"
    );
    assert_eq!(opts.file, policy_cni::install::DEFAULT_FILE);
    // The node's directories, mounted where the installer writes.
    assert_eq!(
        mount_of(&pod, "cni-install", "/etc/cni/net.d").map(Into::into),
        Some(opts.conf_dir.clone())
    );
    assert_eq!(
        mount_of(&pod, "cni-install", "/opt/cni/bin").map(Into::into),
        Some(opts.bin_dir.clone())
    );
    // The plugin runs on the node and connects to the host path; the
    // agent serves it there, the installer asks it there.
    assert_eq!(opts.socket, policy_cni::protocol::DEFAULT_SOCKET);
    let socket_dir = std::path::Path::new(&opts.socket)
        .parent()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    for c in ["agent", "cni-install"] {
        assert_eq!(
            mount_of(&pod, c, &socket_dir),
            Some(socket_dir.clone()),
            "{c} mounts the socket directory at its host path"
        );
    }
    // The agent serves the socket the plugin is told to use.
    let agent_args = agent.args.as_deref().unwrap();
    let at = agent_args
        .iter()
        .position(|a| a == "--cni-socket")
        .expect("the agent takes hand-offs (run --cni-socket)");
    assert_eq!(agent_args.get(at + 1), Some(&opts.socket));
    let sc = installer.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, None);
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert!(
        caps.add.is_none(),
        "writing root's directories needs no capability"
    );
    assert!(installer.resources.as_ref().unwrap().requests.is_some());
}

#[test]
fn the_image_ships_the_plugin_where_the_daemonset_runs_it() {
    let text = std::fs::read_to_string(Path::new(DEPLOY).join("Dockerfile")).unwrap();
    assert!(
        text.contains("-p policy-cni"),
        "the build stage builds the plugin"
    );
    assert!(
        text.contains("COPY --from=build /src/target/release/policy-cni /usr/local/bin/policy-cni"),
        "the final image holds it at the path the DaemonSet runs"
    );
}

#[test]
fn the_kind_cni_is_kindnets_list_and_our_plugin_chains_last() {
    use policy_cni::install::{DEFAULT_FILE, conflist};
    let path = Path::new(DEPLOY).join("kind/kindnet.conflist");
    let text = std::fs::read_to_string(&path).unwrap();
    let list = conflist::load(Path::new("10-kindnet.conflist"), &text).unwrap();
    assert_eq!(
        list["cniVersion"], "0.3.1",
        "kindnet's version (the 0.3.x path)"
    );
    assert_eq!(list["name"], "kindnet");
    let types = |l: &serde_json::Value| -> Vec<String> {
        l["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(types(&list), ["ptp", "portmap"]);
    let chained =
        conflist::chained(&list, &conflist::entry("/run/policy-agent/cni.sock", 10.0)).unwrap();
    assert_eq!(types(&chained), ["ptp", "portmap", "policy-cni"]);
    assert!(
        DEFAULT_FILE < "10-kindnet.conflist",
        "the runtime loads our list first"
    );
}
