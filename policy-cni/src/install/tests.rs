//! install and uninstall on temporary directories.
use std::{fs, os::unix::fs::PermissionsExt, sync::Arc};

use serde_json::Value;

use super::*;

/// A conf dir, a bin dir and a fake plugin binary, removed on drop.
struct Node {
    root: PathBuf,
    opts: Options,
}

impl Node {
    fn new(tag: &str) -> Self {
        let root =
            std::env::temp_dir().join(format!("policy-cni-install-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let conf_dir = root.join("net.d");
        let bin_dir = root.join("bin");
        for d in [&conf_dir, &bin_dir] {
            fs::create_dir_all(d).unwrap_or_else(|e| panic!("{e}"));
        }
        let source = root.join("policy-cni-build");
        fs::write(&source, b"\x7fELF pretend").unwrap_or_else(|e| panic!("{e}"));
        let opts = Options {
            conf_dir,
            bin_dir,
            source: Some(source),
            interval: Duration::from_millis(20),
            ..Options::default()
        };
        Self { root, opts }
    }

    fn write(&self, name: &str, text: &str) {
        fs::write(self.opts.conf_dir.join(name), text).unwrap_or_else(|e| panic!("{e}"));
    }

    fn ours(&self) -> Option<Value> {
        let text = fs::read_to_string(self.opts.conf_dir.join(DEFAULT_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn listing(&self) -> Vec<String> {
        let mut all = Vec::new();
        for dir in [&self.opts.conf_dir, &self.opts.bin_dir] {
            for e in fs::read_dir(dir).into_iter().flatten().flatten() {
                all.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        all.sort();
        all
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

const KINDNET: &str = r#"{"cniVersion":"0.3.1","name":"kindnet","plugins":[
 {"type":"ptp","ipMasq":false,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.0.0/24"}]]}},
 {"type":"portmap","capabilities":{"portMappings":true}}]}"#;

fn types(list: &Value) -> Vec<String> {
    list["plugins"]
        .as_array()
        .map(|p| {
            p.iter()
                .filter_map(|p| p["type"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn install_is_idempotent_and_uninstall_leaves_only_the_primary() {
    let node = Node::new("idem");
    node.write("10-kindnet.conflist", KINDNET);
    let first = install_pass(&node.opts, true).unwrap_or_else(|e| panic!("{e}"));
    assert!(first.binary_written && first.list_written);
    assert_eq!(
        first.primary,
        Some(node.opts.conf_dir.join("10-kindnet.conflist"))
    );
    assert!(first.warnings.is_empty(), "{:?}", first.warnings);
    let list = node.ours().unwrap_or_else(|| panic!("no list"));
    assert_eq!(types(&list), ["ptp", "portmap", "policy-cni"]);
    let bin = node.opts.bin_dir.join("policy-cni");
    assert_eq!(
        fs::read(&bin).ok().as_deref(),
        Some(&b"\x7fELF pretend"[..])
    );
    assert_eq!(
        fs::metadata(&bin)
            .map(|m| m.permissions().mode() & 0o777)
            .ok(),
        Some(0o755)
    );
    let mtime = fs::metadata(node.opts.conf_dir.join(DEFAULT_FILE))
        .and_then(|m| m.modified())
        .ok();
    let second = install_pass(&node.opts, true).unwrap_or_else(|e| panic!("{e}"));
    assert!(!second.binary_written && !second.list_written, "{second:?}");
    assert_eq!(
        fs::metadata(node.opts.conf_dir.join(DEFAULT_FILE))
            .and_then(|m| m.modified())
            .ok(),
        mtime,
        "an unchanged list is not rewritten (the runtime would reload)"
    );
    assert_eq!(
        node.listing(),
        [
            "00-policy-agent.conflist",
            "10-kindnet.conflist",
            "policy-cni"
        ]
    );
    let removed = uninstall(&node.opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(removed.len(), 2);
    assert_eq!(node.listing(), ["10-kindnet.conflist"]);
    assert_eq!(
        fs::read_to_string(node.opts.conf_dir.join("10-kindnet.conflist"))
            .ok()
            .as_deref(),
        Some(KINDNET)
    );
    assert_eq!(
        uninstall(&node.opts).map(|r| r.len()).ok(),
        Some(0),
        "uninstall twice is fine"
    );
}

#[test]
fn a_single_conf_primary_is_wrapped() {
    let node = Node::new("conf");
    node.write(
        "20-bridge.conf",
        r#"{"cniVersion":"1.0.0","name":"br","type":"bridge","bridge":"cni0"}"#,
    );
    node.write(
        "99-loopback.conf",
        r#"{"cniVersion":"1.0.0","name":"lo","type":"loopback"}"#,
    );
    install_pass(&node.opts, false).unwrap_or_else(|e| panic!("{e}"));
    let list = node.ours().unwrap_or_else(|| panic!("no list"));
    assert_eq!(list["name"], "br");
    assert_eq!(list["cniVersion"], "1.0.0");
    assert_eq!(types(&list), ["bridge", "policy-cni"]);
}

#[test]
fn a_rewritten_primary_is_followed_and_a_vanished_one_removes_ours() {
    let node = Node::new("rewrite");
    node.write("10-kindnet.conflist", KINDNET);
    install_pass(&node.opts, false).unwrap_or_else(|e| panic!("{e}"));
    // kindnetd's way: write a temp file, rename it over the list.
    let changed = KINDNET.replace("10.244.0.0/24", "10.244.7.0/24");
    node.write("10-kindnet.conflist.temp", &changed);
    fs::rename(
        node.opts.conf_dir.join("10-kindnet.conflist.temp"),
        node.opts.conf_dir.join("10-kindnet.conflist"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let pass = install_pass(&node.opts, false).unwrap_or_else(|e| panic!("{e}"));
    assert!(pass.list_written);
    let list = node.ours().unwrap_or_else(|| panic!("no list"));
    assert_eq!(
        list["plugins"][0]["ipam"]["ranges"][0][0]["subnet"],
        "10.244.7.0/24"
    );
    assert_eq!(types(&list), ["ptp", "portmap", "policy-cni"]);
    fs::remove_file(node.opts.conf_dir.join("10-kindnet.conflist"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        install_pass(&node.opts, false),
        Err(InstallError::NoPrimary { .. })
    ));
    assert!(node.ours().is_none(), "no copy of a network that is gone");
}

#[test]
fn a_primary_sorting_before_ours_is_warned_about() {
    let node = Node::new("order");
    node.write("00-aaa.conflist", KINDNET);
    let pass = install_pass(&node.opts, false).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        pass.warnings.iter().any(|w| w.contains("sorts before")),
        "{:?}",
        pass.warnings
    );
}

#[test]
fn an_unchainable_primary_removes_ours() {
    let node = Node::new("old");
    node.write("10-kindnet.conflist", KINDNET);
    install_pass(&node.opts, false).unwrap_or_else(|e| panic!("{e}"));
    node.write("10-kindnet.conflist", &KINDNET.replace("0.3.1", "0.2.0"));
    assert!(matches!(
        install_pass(&node.opts, false),
        Err(InstallError::Unchainable { .. })
    ));
    assert!(node.ours().is_none());
}

#[test]
fn watch_follows_changes_and_uninstalls_on_stop() {
    let node = Node::new("watch");
    node.write("10-kindnet.conflist", KINDNET);
    let opts = Options {
        watch: true,
        uninstall_on_exit: true,
        ..node.opts.clone()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || run(&opts, &stop))
    };
    let wait_for = |what: &str, cond: &dyn Fn() -> bool| {
        let until = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < until, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_for("the first install", &|| node.ours().is_some());
    node.write(
        "10-kindnet.conflist",
        &KINDNET.replace("10.244.0.0/24", "10.244.9.0/24"),
    );
    wait_for("the regenerated list", &|| {
        node.ours()
            .is_some_and(|l| l["plugins"][0]["ipam"]["ranges"][0][0]["subnet"] == "10.244.9.0/24")
    });
    let _ = fs::remove_file(node.opts.bin_dir.join("policy-cni"));
    wait_for("the binary back", &|| {
        node.opts.bin_dir.join("policy-cni").exists()
    });
    stop.store(true, Ordering::Relaxed);
    assert_eq!(runner.join().ok(), Some(0));
    assert_eq!(node.listing(), ["10-kindnet.conflist"]);
}

#[test]
fn arguments_parse_and_bad_ones_are_refused() {
    let args = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let (install, o) = parse_args(&args(
        "install --watch --conf-dir /host/etc/cni/net.d --bin-dir /host/opt/cni/bin --timeout-seconds 7 --uninstall-on-exit --wait-for-agent",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(install && o.watch && o.uninstall_on_exit && o.wait_for_agent);
    assert_eq!(o.conf_dir, PathBuf::from("/host/etc/cni/net.d"));
    assert_eq!(o.timeout_seconds, 7.0);
    let (install, o) = parse_args(&args("uninstall")).unwrap_or_else(|e| panic!("{e}"));
    assert!(!install);
    assert_eq!(o, Options::default());
    for bad in [
        "install --frob",
        "install --timeout-seconds 0",
        "install --file x.conf",
        "install --file ../x.conflist",
        "install --socket rel.sock",
        "install --conf-dir",
        "uninstall --watch",
        "reinstall",
    ] {
        assert!(parse_args(&args(bad)).is_err(), "{bad}");
    }
}
