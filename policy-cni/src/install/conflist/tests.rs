use serde_json::json;

use super::*;

/// kindnet's rendered list (single-stack IPv4 node), from its template.
const KINDNET: &str = r#"{"cniVersion":"0.3.1","name":"kindnet","plugins":[
 {"type":"ptp","ipMasq":false,"ipam":{"type":"host-local","dataDir":"/run/cni-ipam-state",
   "routes":[{"dst":"0.0.0.0/0"}],"ranges":[[{"subnet":"10.244.0.0/24"}]]},"mtu":1500},
 {"type":"portmap","capabilities":{"portMappings":true}}]}"#;

fn ours() -> Value {
    entry("/run/policy-agent/cni.sock", 5.0)
}

fn types(list: &Value) -> Vec<&str> {
    list["plugins"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p["type"].as_str()).collect())
        .unwrap_or_default()
}

#[test]
fn a_list_keeps_its_plugins_order_name_and_version_and_gets_ours_last() {
    let list = load(Path::new("10-kindnet.conflist"), KINDNET).unwrap_or_else(|e| panic!("{e}"));
    let out = chained(&list, &ours()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(types(&out), ["ptp", "portmap", "policy-cni"]);
    assert_eq!(out["name"], "kindnet");
    assert_eq!(out["cniVersion"], "0.3.1");
    assert_eq!(
        out["plugins"][0], list["plugins"][0],
        "the main plugin copied verbatim"
    );
    assert_eq!(out["plugins"][2]["socket"], "/run/policy-agent/cni.sock");
}

#[test]
fn ours_is_never_appended_twice() {
    let list = load(Path::new("10-kindnet.conflist"), KINDNET).unwrap_or_else(|e| panic!("{e}"));
    let once = chained(&list, &ours()).unwrap_or_else(|e| panic!("{e}"));
    let twice = chained(&once, &ours()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(once, twice);
    // An old entry of ours in the middle (an in-place install) moves last.
    let mut edited = list.clone();
    if let Some(p) = edited["plugins"].as_array_mut() {
        p.insert(1, json!({"type":"policy-cni","socket":"/old.sock"}));
    }
    let out = chained(&edited, &ours()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(types(&out), ["ptp", "portmap", "policy-cni"]);
    assert_eq!(out["plugins"][2]["socket"], "/run/policy-agent/cni.sock");
}

#[test]
fn a_single_conf_is_wrapped_into_a_list_of_its_name_and_version() {
    let conf = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge","bridge":"cni0",
                   "ipam":{"type":"host-local","subnet":"10.22.0.0/16"}}"#;
    for file in ["10-mynet.conf", "10-mynet.json"] {
        let list = load(Path::new(file), conf).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(list["name"], "mynet");
        assert_eq!(list["cniVersion"], "0.4.0");
        assert_eq!(types(&list), ["bridge"]);
        assert!(list["plugins"][0].get("name").is_none());
        assert_eq!(list["plugins"][0]["bridge"], "cni0");
        let out = chained(&list, &ours()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(types(&out), ["bridge", "policy-cni"]);
    }
}

#[test]
fn invalid_files_are_refused_with_a_reason() {
    let cases = [
        ("a.conflist", "{", "not JSON"),
        ("a.conflist", r#"{"name":"n","plugins":[]}"#, "no plugins"),
        (
            "a.conflist",
            r#"{"cniVersion":"1.0.0","plugins":[{"type":"ptp"}]}"#,
            "no network name",
        ),
        (
            "a.conflist",
            r#"{"name":"n","plugins":[{"ipam":{}}]}"#,
            "without a type",
        ),
        (
            "a.conf",
            r#"{"name":"n","cniVersion":"1.0.0"}"#,
            "without a type",
        ),
        ("a.conf", "[]", "not a JSON object"),
    ];
    for (file, text, why) in cases {
        let e = load(Path::new(file), text).unwrap_err();
        assert!(e.to_string().contains(why), "{file} {text}: {e}");
    }
}

#[test]
fn lists_without_chaining_are_not_chained() {
    let old = json!({"cniVersion":"0.2.0","name":"n","plugins":[{"type":"bridge"}]});
    assert!(chained(&old, &ours()).is_err());
    let none = json!({"name":"n","plugins":[{"type":"bridge"}]});
    assert!(chained(&none, &ours()).is_err());
    let only_ours = json!({"cniVersion":"1.0.0","name":"n","plugins":[{"type":"policy-cni"}]});
    assert!(chained(&only_ours, &ours()).is_err());
}

fn f(name: &str, text: &str) -> (String, String) {
    (name.to_owned(), text.to_owned())
}

#[test]
fn the_primary_is_the_first_valid_file_by_name_never_ours() {
    let dir = Path::new("/etc/cni/net.d");
    let files = [
        f(
            "99-loopback.conf",
            r#"{"cniVersion":"1.0.0","name":"lo","type":"loopback"}"#,
        ),
        f("10-kindnet.conflist", KINDNET),
        f("05-broken.conflist", "{"),
        f("00-policy-agent.conflist", KINDNET),
        f("10-kindnet.conflist.temp", KINDNET),
        f(".00-policy-agent.conflist.tmp.1", KINDNET),
        f("README", "hello"),
    ];
    let p = pick(dir, &files, "00-policy-agent.conflist").unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(p.path, dir.join("10-kindnet.conflist"));
    assert_eq!(p.skipped.len(), 1);
    assert_eq!(p.skipped[0].0, dir.join("05-broken.conflist"));
    let none = pick(
        dir,
        &[f("00-policy-agent.conflist", KINDNET)],
        "00-policy-agent.conflist",
    );
    assert_eq!(none, Err(vec![]));
}

#[test]
fn rendering_is_stable() {
    let list = load(Path::new("x.conflist"), KINDNET).unwrap_or_else(|e| panic!("{e}"));
    let a = render(&chained(&list, &ours()).unwrap_or_else(|e| panic!("{e}")));
    let reread = load(Path::new("x.conflist"), &a).unwrap_or_else(|e| panic!("{e}"));
    let b = render(&chained(&reread, &ours()).unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(a, b);
    assert!(a.ends_with('\n'));
}
