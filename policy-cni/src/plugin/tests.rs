//! The commands end to end in-process, with a stand-in agent where one is
//! needed. ADD's success path needs a real veth: policy-agent's
//! `cni_plugin` test runs it with the real ptp in network namespaces.
use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixListener,
    path::PathBuf,
    sync::mpsc,
};

use serde_json::{Value, json};

use super::*;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k| map.get(k).cloned()
}

fn error_of(out: &Outcome) -> Value {
    assert_eq!(out.status, 1, "{out:?}");
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"))
}

/// A stand-in agent answering `answer` to every request it receives,
/// sending each request down the channel.
struct Agent {
    path: PathBuf,
    requests: mpsc::Receiver<Request>,
}

impl Agent {
    fn start(tag: &str, answer: Response) -> Self {
        let path = std::env::temp_dir().join(format!(
            "policy-cni-plugin-{tag}-{}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap_or_else(|e| panic!("{e}"));
        let (tx, requests) = mpsc::channel();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let mut line = String::new();
                let _ = BufReader::new(&conn).read_line(&mut line);
                let Ok(req) = serde_json::from_str::<Request>(&line) else {
                    return;
                };
                if tx.send(req).is_err() {
                    return;
                }
                let mut text = serde_json::to_string(&answer).unwrap_or_default();
                text.push('\n');
                let _ = conn.write_all(text.as_bytes());
            }
        });
        Self { path, requests }
    }

    fn config(&self, version: &str) -> Vec<u8> {
        json!({"cniVersion": version, "name": "podnet", "type": "policy-cni",
               "socket": self.path, "timeoutSeconds": 1})
        .to_string()
        .into_bytes()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[test]
fn version_lists_the_chaining_versions() {
    let out = run(&vars(&[("CNI_COMMAND", "VERSION")]), b"");
    assert_eq!(out.status, 0);
    let v: Value = serde_json::from_str(&out.stdout).unwrap_or_default();
    assert_eq!(
        v["supportedVersions"],
        json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
    );
    assert_eq!(v["cniVersion"], "1.1.0");
    let out = run(
        &vars(&[("CNI_COMMAND", "VERSION")]),
        br#"{"cniVersion":"0.4.0"}"#,
    );
    let v: Value = serde_json::from_str(&out.stdout).unwrap_or_default();
    assert_eq!(v["cniVersion"], "0.4.0", "the input's version echoed");
}

#[test]
fn a_missing_or_unknown_command_is_code_4() {
    assert_eq!(error_of(&run(&vars(&[]), b""))["code"], 4);
    assert_eq!(
        error_of(&run(&vars(&[("CNI_COMMAND", "ATTACH")]), b""))["code"],
        4
    );
}

fn add_env<'a>(netns: &'a str, args: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c0ffee01"),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
        ("CNI_ARGS", args),
    ]
}

const ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=p1;K8S_POD_UID=u-1";

fn with_prev(version: &str, prev: &Value) -> Vec<u8> {
    json!({"cniVersion": version, "name": "podnet", "type": "policy-cni",
           "socket": "/nonexistent/cni.sock", "timeoutSeconds": 0.2, "prevResult": prev})
    .to_string()
    .into_bytes()
}

fn ptp_prev() -> Value {
    json!({"cniVersion":"1.0.0","interfaces":[{"name":"veth1"},{"name":"eth0","sandbox":"/proc/self/ns/net"}],
           "ips":[{"interface":1,"address":"10.244.1.2/24"}]})
}

#[test]
fn add_refuses_what_it_cannot_hand_over() {
    let netns = "/proc/self/ns/net";
    let cases: Vec<(&str, Vec<u8>, &str, u64)> = vec![
        (
            "no prevResult",
            br#"{"cniVersion":"1.0.0","name":"n","type":"policy-cni"}"#.to_vec(),
            ARGS,
            7,
        ),
        ("garbage stdin", b"{".to_vec(), ARGS, 6),
        (
            "no pod in CNI_ARGS",
            with_prev("1.0.0", &ptp_prev()),
            "IgnoreUnknown=1",
            4,
        ),
        (
            "unknown CNI_ARGS key",
            with_prev("1.0.0", &ptp_prev()),
            "K8S_POD_NAME=p;X=1",
            4,
        ),
        (
            "no address for the pod",
            with_prev(
                "1.0.0",
                &json!({"interfaces":[{"name":"eth0","sandbox":netns}],"ips":[]}),
            ),
            ARGS,
            u64::from(code::NO_ADDRESS),
        ),
        // Our own namespace as the pod's: the runtime ran us inside it.
        (
            "plugin inside the pod netns",
            with_prev("1.0.0", &ptp_prev()),
            ARGS,
            8,
        ),
        (
            "unsupported version",
            with_prev("0.2.0", &ptp_prev()),
            ARGS,
            1,
        ),
    ];
    for (what, stdin, args, code) in cases {
        let out = run(&vars(&add_env(netns, args)), &stdin);
        let e = error_of(&out);
        assert_eq!(e["code"], code, "{what}: {e}");
        assert!(e["msg"].as_str().is_some_and(|m| !m.is_empty()), "{what}");
    }
    let missing = run(&vars(&add_env("", ARGS)), &with_prev("1.0.0", &ptp_prev()));
    assert_eq!(error_of(&missing)["code"], 4, "no CNI_NETNS");
}

#[test]
fn an_error_carries_the_configs_version() {
    let out = run(
        &vars(&add_env("/proc/self/ns/net", "")),
        &with_prev("0.3.1", &ptp_prev()),
    );
    assert_eq!(error_of(&out)["cniVersion"], "0.3.1");
}

#[test]
fn del_succeeds_without_an_agent_and_without_a_usable_request() {
    let del = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "c0ffee01"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", ARGS),
    ];
    let stdin = with_prev("1.0.0", &ptp_prev());
    assert_eq!(run(&vars(&del), &stdin), Outcome::success(String::new()));
    assert_eq!(run(&vars(&del), b"not json").status, 0);
    assert_eq!(run(&vars(&[("CNI_COMMAND", "DEL")]), b"").status, 0);
}

#[test]
fn del_tells_the_agent_and_ignores_its_refusal() {
    let agent = Agent::start("del", Response::error(code::BAD_REQUEST, "who?"));
    let del = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "c0ffee02"),
        ("CNI_IFNAME", "eth0"),
        (
            "CNI_ARGS",
            "K8S_POD_NAMESPACE=default;K8S_POD_NAME=p2;IgnoreUnknown=1",
        ),
    ];
    assert_eq!(run(&vars(&del), &agent.config("0.3.1")).status, 0);
    let req = agent
        .requests
        .recv_timeout(std::time::Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(req.container_id, "c0ffee02");
    assert_eq!(
        req.command,
        protocol::Command::Del {
            pod: Some(protocol::PodId {
                namespace: "default".into(),
                name: "p2".into(),
                uid: None
            })
        }
    );
}

#[test]
fn status_and_gc_exist_only_for_1_1_0() {
    let agent = Agent::start("status", Response::ok());
    let status = vars(&[("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/usr/lib/cni")]);
    assert_eq!(run(&status, &agent.config("1.1.0")).status, 0);
    assert_eq!(
        agent
            .requests
            .recv_timeout(std::time::Duration::from_secs(2))
            .map(|r| r.command),
        Ok(protocol::Command::Status)
    );
    assert_eq!(error_of(&run(&status, &agent.config("1.0.0")))["code"], 1);
    let gc = vars(&[("CNI_COMMAND", "GC"), ("CNI_PATH", "/usr/lib/cni")]);
    assert_eq!(run(&gc, &agent.config("1.1.0")).status, 0);
    assert_eq!(error_of(&run(&gc, &agent.config("0.4.0")))["code"], 1);
}

#[test]
fn status_without_an_agent_is_not_available() {
    let status = vars(&[("CNI_COMMAND", "STATUS")]);
    let stdin =
        br#"{"cniVersion":"1.1.0","name":"n","type":"policy-cni","socket":"/nonexistent/x.sock"}"#;
    assert_eq!(error_of(&run(&status, stdin))["code"], 50);
}

#[test]
fn check_needs_0_4_0() {
    let check: Vec<_> = add_env("/proc/self/ns/net", ARGS)
        .into_iter()
        .map(|(k, v)| {
            if k == "CNI_COMMAND" {
                (k, "CHECK")
            } else {
                (k, v)
            }
        })
        .collect();
    assert_eq!(
        error_of(&run(&vars(&check), &with_prev("0.3.1", &ptp_prev())))["code"],
        1
    );
}
