//! Bad input is never a way to open what a policy closes.
//!
//! Manifests: a document that does not decode, a YAML
//! syntax error, a file or directory that cannot be read are not
//! deletions. The watcher's directory keeps the last good version (or a
//! fail-closed stand-in for a new policy), reports each case on the
//! document, and recovers when the file is fixed; `apply` fails closed for
//! an undecodable policy. A fuzzer edits manifest files with breaking
//! mutations and checks that the enforced state never isolates fewer pods
//! than the last good version of every file would, and that it is exactly
//! that state again once every file reads cleanly.
//!
//! iptables, through a small evaluator of the rendered
//! rules: sets are named by the whole identity key, narrowed name hashes
//! never merge two things into a rule that allows more than the maps, only
//! names of the agent's exact shape are its own, and no pod passes with
//! another pod's source address (nor a pod's own address from elsewhere as
//! self traffic).
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::Duration,
};

use policy_agent::{
    cluster::{ClusterState, ObjectRef, Problem, Subject},
    identity::IdentityAllocator,
    policy::{self, CompileOptions, Compiled},
    source::manifests::{Directory, load_dir},
};
use policy_common::endpoint::{ENDPOINT_EGRESS_ISOLATED, ENDPOINT_INGRESS_ISOLATED};

/// A scratch directory, removed on drop (also when a test fails).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "policy-agent-bad-input-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// Writes `file`; the mtime is moved on so the watcher sees the edit
    /// even within one timestamp tick.
    fn write(&self, file: &str, text: impl AsRef<[u8]>) {
        let path = self.0.join(file);
        std::fs::write(&path, text).unwrap();
        bump_mtime(&path);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Moves `path`'s mtime past every earlier write (the directory re-reads a
/// file only when its size or mtime moved).
fn bump_mtime(path: &Path) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1_000_000);
    let secs = NEXT.fetch_add(1, Ordering::Relaxed);
    let when = std::time::UNIX_EPOCH + Duration::from_secs(secs);
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(when).unwrap();
}

const CLUSTER: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: other, labels: {team: b}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: n1, containers: []}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: api, namespace: shop, labels: {app: api}}
spec: {nodeName: n1, containers: []}
status: {podIP: 10.0.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
spec: {nodeName: n1, containers: []}
status: {podIP: 10.0.0.3}
---
apiVersion: v1
kind: Pod
metadata: {name: x, namespace: other, labels: {app: x}}
spec: {nodeName: n1, containers: []}
status: {podIP: 10.0.1.1}
";

fn policy(name: &str, body: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n{body}"
    )
}

/// web: ingress only from api.
fn web_from_api() -> String {
    policy(
        "web",
        "  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: api}}}]\n",
    )
}

fn compile(state: &ClusterState) -> Compiled {
    let mut state = state.clone();
    state.node_name = "n1".into();
    policy::compile_with(
        &state,
        &mut IdentityAllocator::new(),
        CompileOptions {
            all_pods_local: true,
            ..CompileOptions::default()
        },
    )
}

/// (pod, "ingress" | "egress") for every isolated direction.
fn isolated(c: &Compiled) -> BTreeSet<(String, &'static str)> {
    let mut out = BTreeSet::new();
    for (pod, ep) in &c.maps.endpoints {
        if ep.flags & ENDPOINT_INGRESS_ISOLATED != 0 {
            out.insert((pod.to_string(), "ingress"));
        }
        if ep.flags & ENDPOINT_EGRESS_ISOLATED != 0 {
            out.insert((pod.to_string(), "egress"));
        }
    }
    out
}

fn shop(name: &str) -> ObjectRef {
    ObjectRef::new("shop", name)
}

fn on_document(p: &Problem, file: &str, document: usize) -> bool {
    matches!(&p.subject, Subject::Document { file: f, document: Some(d) }
        if f.file_name().is_some_and(|n| n == file) && *d == document)
}

#[test]
fn an_undecodable_policy_keeps_its_last_good_version_until_fixed() {
    let dir = Scratch::new("lastgood");
    dir.write("cluster.yaml", CLUSTER);
    dir.write("policies.yaml", web_from_api());
    let mut d = Directory::default();
    d.refresh(&dir.0);
    let good = d.state().policies[&shop("web")].clone();
    let good_isolation = isolated(&compile(d.state()));
    assert!(good_isolation.contains(&("shop/web".into(), "ingress")));

    // endPort as a string: the document no longer decodes.
    dir.write(
        "policies.yaml",
        policy(
            "web",
            "  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: db}}}]\n    ports: [{port: 80, endPort: \"90\"}]\n",
        ),
    );
    let (changes, problems) = d.refresh(&dir.0).expect("the problem is news");
    assert!(changes.is_empty(), "nothing changes: {changes:?}");
    assert_eq!(d.state().policies[&shop("web")], good);
    let p = problems
        .iter()
        .find(|p| on_document(p, "policies.yaml", 1))
        .unwrap_or_else(|| panic!("reported on the document: {problems:?}"));
    assert!(
        p.reason.contains("endPort") || p.reason.contains("invalid type"),
        "{p}"
    );
    assert!(p.reason.contains("last version that decoded"), "{p}");

    // Another broken edit: still the last good version, not a stand-in.
    dir.write(
        "policies.yaml",
        policy(
            "web",
            "  podSelector: {matchLabels: {app: web}}\n  ingress: 5\n",
        ),
    );
    d.refresh(&dir.0);
    assert_eq!(d.state().policies[&shop("web")], good);

    // Fixed (with a new meaning): enforced as written, no problem left.
    dir.write(
        "policies.yaml",
        policy(
            "web",
            "  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: db}}}]\n",
        ),
    );
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert!(problems.is_empty(), "{problems:?}");
    assert_ne!(d.state().policies[&shop("web")], good);
}

#[test]
fn a_new_undecodable_policy_fails_closed_in_the_directions_it_declares() {
    let dir = Scratch::new("standin");
    dir.write("cluster.yaml", CLUSTER);
    // `except` as a string, Egress only.
    let broken = policy(
        "out",
        "  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: 10.0.0.0/24}}]\n",
    );
    dir.write("policies.yaml", &broken);
    let mut d = Directory::default();
    let (_, problems) = d.refresh(&dir.0).unwrap();
    let watched = compile(d.state());
    // The watcher and `apply` agree: every shop pod is isolated for egress
    // (the stand-in selects all it could select), nothing is allowed, and
    // ingress is untouched.
    let mut loaded = load_dir(&dir.0);
    let applied = compile(&loaded.cluster_state("n1", Vec::new()));
    for c in [&watched, &applied] {
        let iso = isolated(c);
        let want: BTreeSet<(String, &str)> = ["shop/web", "shop/api", "shop/db"]
            .into_iter()
            .map(|p| (p.to_owned(), "egress"))
            .collect();
        assert_eq!(iso, want);
        assert!(c.maps.policy.is_empty(), "nothing allowed");
        assert!(c.errors.is_empty(), "{:?}", c.errors);
    }
    let p = problems
        .iter()
        .find(|p| on_document(p, "policies.yaml", 1))
        .unwrap_or_else(|| panic!("{problems:?}"));
    assert!(
        p.reason
            .contains("every pod of namespace shop is isolated for Egress"),
        "{p}"
    );
    assert!(
        loaded
            .errors
            .iter()
            .any(|e| on_document(&e.problem(), "policies.yaml", 1)),
        "{:?}",
        loaded.errors
    );

    // Fixed: the policy as written (web only, egress to the block).
    dir.write(
        "policies.yaml",
        broken.replace("except: 10.0.0.0/24", "except: [10.0.0.0/24]"),
    );
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert_eq!(changes.len(), 1);
    assert!(problems.is_empty(), "{problems:?}");
    let fixed = compile(d.state());
    assert_eq!(
        isolated(&fixed),
        BTreeSet::from([("shop/web".to_owned(), "egress")])
    );
    assert!(!fixed.maps.policy.is_empty());
}

#[test]
fn a_stand_in_reads_the_directions_the_raw_document_declares() {
    // (raw spec, isolated directions of shop/api, which the policy's own
    // podSelector would not even select)
    let cases: [(&str, &[&str]); 6] = [
        // No policyTypes, no egress: Ingress (the API default).
        ("  podSelector: 7\n", &["ingress"]),
        // A non-empty egress list adds Egress.
        (
            "  podSelector: 7\n  egress: [{to: [{podSelector: {}}]}]\n",
            &["egress", "ingress"],
        ),
        // policyTypes: [] counts as absent.
        ("  podSelector: 7\n  policyTypes: []\n", &["ingress"]),
        ("  podSelector: 7\n  policyTypes: [Egress]\n", &["egress"]),
        // Unreadable types: both.
        (
            "  podSelector: 7\n  policyTypes: Egress\n",
            &["egress", "ingress"],
        ),
        (
            "  podSelector: 7\n  policyTypes: [Egress, 3]\n",
            &["egress", "ingress"],
        ),
    ];
    for (spec, want) in cases {
        let dir = Scratch::new("types");
        dir.write("cluster.yaml", CLUSTER);
        dir.write("p.yaml", policy("p", spec));
        let mut loaded = load_dir(&dir.0);
        let c = compile(&loaded.cluster_state("n1", Vec::new()));
        let got: Vec<&str> = isolated(&c)
            .into_iter()
            .filter(|(p, _)| p == "shop/api")
            .map(|(_, d)| d)
            .collect();
        assert_eq!(got, want, "{spec}");
        // The other namespace is never touched.
        assert!(!isolated(&c).iter().any(|(p, _)| p.starts_with("other/")));
    }
}

#[test]
fn a_yaml_syntax_error_keeps_what_it_hides_and_a_deletion_waits_for_the_fix() {
    let dir = Scratch::new("syntax");
    dir.write("cluster.yaml", CLUSTER);
    let p = |name: &str, app: &str| {
        policy(
            name,
            &format!("  podSelector: {{matchLabels: {{app: {app}}}}}\n  policyTypes: [Ingress]\n"),
        )
    };
    dir.write(
        "policies.yaml",
        [p("a", "web"), p("b", "api"), p("c", "db")].join("---\n"),
    );
    let mut d = Directory::default();
    d.refresh(&dir.0);
    let before = isolated(&compile(d.state()));
    assert_eq!(before.len(), 3);

    // One edit: a syntax error in b (c is lost to the reader), and c
    // deleted.
    let broken = [
        p("a", "web"),
        p("b", "api").replace("policyTypes: [Ingress]", "policyTypes: [Ingress"),
    ]
    .join("---\n");
    dir.write("policies.yaml", &broken);
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(isolated(&compile(d.state())), before);
    assert!(
        problems
            .iter()
            .any(|p| on_document(p, "policies.yaml", 2) && p.reason.contains("YAML")),
        "{problems:?}"
    );
    let kept = problems
        .iter()
        .find(|p| p.reason.contains("stay enforced as last read"))
        .unwrap_or_else(|| panic!("{problems:?}"));
    assert!(
        matches!(&kept.subject, Subject::Document { document: None, .. }),
        "{kept:?}"
    );
    assert!(
        kept.reason.contains("NetworkPolicy shop/b")
            && kept.reason.contains("NetworkPolicy shop/c"),
        "{kept}"
    );

    // Fixed: the deletion of c lands now.
    dir.write(
        "policies.yaml",
        [p("a", "web"), p("b", "api")].join("---\n"),
    );
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert!(problems.is_empty(), "{problems:?}");
    assert!(!d.state().policies.contains_key(&shop("c")));
}

#[test]
fn an_unreadable_file_or_directory_deletes_nothing() {
    let dir = Scratch::new("unreadable");
    dir.write("cluster.yaml", CLUSTER);
    dir.write("policies.yaml", web_from_api());
    let mut d = Directory::default();
    d.refresh(&dir.0);
    let before = d.state().clone();

    // Not UTF-8: the file cannot be read as text.
    dir.write("policies.yaml", b"\xff\xfe not text");
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(d.state().policies, before.policies);
    assert!(
        problems
            .iter()
            .any(|p| p.reason.contains("cannot read") || p.reason.contains("stay enforced")),
        "{problems:?}"
    );

    // The directory itself gone (or unlistable): nothing is deleted.
    dir.write("policies.yaml", web_from_api());
    d.refresh(&dir.0);
    let moved = dir.0.with_extension("away");
    std::fs::rename(&dir.0, &moved).unwrap();
    let result = d.refresh(&dir.0);
    std::fs::rename(&moved, &dir.0).unwrap();
    let (changes, problems) = result.expect("the problem is news");
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(d.state().pods, before.pods);
    assert_eq!(d.state().policies, before.policies);
    assert!(
        problems
            .iter()
            .any(|p| p.reason.contains("cannot list the directory")),
        "{problems:?}"
    );
    // Back: the problem clears, nothing changed.
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert!(
        changes.is_empty() && problems.is_empty(),
        "{changes:?} {problems:?}"
    );
}

#[test]
fn a_document_that_is_no_object_deletes_nothing_but_a_foreign_kind_does() {
    let dir = Scratch::new("scalar");
    dir.write("cluster.yaml", CLUSTER);
    dir.write("policies.yaml", web_from_api());
    let mut d = Directory::default();
    d.refresh(&dir.0);
    // A file cut to a bare word reads as one scalar document.
    dir.write("policies.yaml", "apiVers");
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert!(changes.is_empty(), "{changes:?}");
    assert!(d.state().policies.contains_key(&shop("web")));
    assert!(
        problems
            .iter()
            .any(|p| on_document(p, "policies.yaml", 1)
                && p.reason.contains("not a Kubernetes object")),
        "{problems:?}"
    );
    // A well-formed object of another kind is someone else's: the policy
    // it replaced is deleted.
    dir.write(
        "policies.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: shop}\n",
    );
    let (changes, _) = d.refresh(&dir.0).unwrap();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert!(!d.state().policies.contains_key(&shop("web")));
}

#[test]
fn an_undecodable_pod_keeps_its_last_good_version() {
    let dir = Scratch::new("pod");
    dir.write("cluster.yaml", CLUSTER);
    dir.write("policies.yaml", web_from_api());
    let mut d = Directory::default();
    d.refresh(&dir.0);
    let before = d.state().clone();
    // web's address no longer converts: dropping web would detach its
    // enforcement.
    dir.write(
        "cluster.yaml",
        CLUSTER.replace("podIP: 10.0.0.1", "podIP: ten"),
    );
    let (changes, problems) = d.refresh(&dir.0).unwrap();
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(d.state().pods, before.pods);
    assert!(
        problems
            .iter()
            .any(|p| p.reason.contains("Pod shop/web") && p.reason.contains("last version")),
        "{problems:?}"
    );
}

#[test]
fn apply_reports_and_fails_closed_without_a_previous_state() {
    let dir = Scratch::new("apply");
    dir.write("cluster.yaml", CLUSTER);
    dir.write(
        "policies.yaml",
        [
            web_from_api(),
            policy(
                "broken",
                "  podSelector: {matchLabels: {app: db}}\n  ingress:\n  - ports: [{port: 80, endPort: \"90\"}]\n",
            ),
        ]
        .join("---\n"),
    );
    let mut loaded = load_dir(&dir.0);
    let state = loaded.cluster_state("n1", Vec::new());
    let c = compile(&state);
    let iso = isolated(&c);
    for pod in ["shop/web", "shop/api", "shop/db"] {
        assert!(iso.contains(&(pod.to_owned(), "ingress")), "{pod}: {iso:?}");
    }
    assert!(!iso.iter().any(|(p, _)| p.starts_with("other/")));
    let problems: Vec<Problem> = loaded.errors.iter().map(|e| e.problem()).collect();
    assert!(
        problems.iter().any(|p| on_document(p, "policies.yaml", 2)),
        "{problems:?}"
    );
}

// ------------------------------------------------------------------ fuzzer

mod fuzz {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use policy_agent::{
        cluster::{ClusterState, NamespaceInfo},
        source::manifests::{LoadedManifests, load_file},
    };
    use proptest::prelude::*;
    use serde_yaml::Value;

    use super::*;

    const FILES: usize = 3;

    /// Every document the fuzzer writes, each in two versions (a good
    /// edit may switch between them). Document `i` lives in file
    /// `i % FILES`, so no object is defined twice.
    fn pool() -> Vec<[String; 2]> {
        let ns = |name: &str, team: &str| {
            format!(
                "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{team: {team}}}}}\n"
            )
        };
        let pod = |ns: &str, name: &str, app: &str, ip: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}, labels: {{app: {app}}}}}\nspec: {{nodeName: n1, containers: [{{name: c, image: i, ports: [{{name: http, containerPort: 80}}]}}]}}\nstatus: {{podIP: {ip}}}\n"
            )
        };
        let np = |ns: &str, name: &str, spec: &str| {
            format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
            )
        };
        vec![
            [ns("shop", "a"), ns("shop", "c")],
            [ns("other", "b"), ns("other", "a")],
            [
                pod("shop", "web", "web", "10.0.0.1"),
                pod("shop", "web", "front", "10.0.0.1"),
            ],
            [
                pod("shop", "api", "api", "10.0.0.2"),
                pod("shop", "api", "api", "10.0.0.12"),
            ],
            [
                pod("shop", "db", "db", "10.0.0.3"),
                pod("shop", "db", "web", "10.0.0.3"),
            ],
            [
                pod("other", "x", "x", "10.0.1.1"),
                pod("other", "x", "web", "10.0.1.1"),
            ],
            [
                np(
                    "shop",
                    "web-in",
                    "  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {app: api}}}]\n    ports: [{port: http}]\n",
                ),
                np(
                    "shop",
                    "web-in",
                    "  podSelector: {matchLabels: {app: web}}\n  ingress:\n  - from: [{namespaceSelector: {matchLabels: {team: b}}}]\n",
                ),
            ],
            [
                np(
                    "shop",
                    "db-both",
                    "  podSelector: {matchLabels: {app: db}}\n  policyTypes: [Ingress, Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.1.0/24]}}]\n    ports: [{port: 5432, endPort: 5440}]\n",
                ),
                np(
                    "shop",
                    "db-both",
                    "  podSelector: {matchExpressions: [{key: app, operator: In, values: [db, api]}]}\n  policyTypes: [Egress]\n",
                ),
            ],
            [
                np(
                    "other",
                    "deny",
                    "  podSelector: {}\n  policyTypes: [Ingress]\n",
                ),
                np(
                    "other",
                    "deny",
                    "  podSelector: {matchLabels: {app: x}}\n  egress: [{}]\n",
                ),
            ],
            [
                np(
                    "shop",
                    "api-out",
                    "  podSelector: {matchLabels: {app: api}}\n  egress:\n  - to: [{podSelector: {}}]\n",
                ),
                np(
                    "shop",
                    "api-out",
                    "  podSelector: {matchLabels: {app: api}}\n  policyTypes: [Egress]\n  egress: []\n",
                ),
            ],
        ]
    }

    #[derive(Clone, Debug)]
    enum Breaker {
        /// One node of the document replaced by a value of another type.
        WrongType,
        /// A line no YAML reader accepts, inserted between two lines.
        SyntaxLine,
        /// The file cut inside the document, mid-token.
        Truncate,
        /// Characters inserted inside the document (no document markers).
        Junk(String),
        /// Bytes that are not UTF-8: the file cannot be read as text.
        NotUtf8,
    }

    #[derive(Clone, Debug)]
    enum Step {
        /// A good edit: the file holds the documents of `keep`, each in
        /// version `variant`'s bit.
        Rewrite { file: usize, keep: u8, variant: u8 },
        /// The file's last good text with one document broken.
        Break {
            file: usize,
            doc: usize,
            at: usize,
            how: Breaker,
        },
        /// The file's last good text written back.
        Restore { file: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        let breaker = prop_oneof![
            Just(Breaker::WrongType),
            Just(Breaker::SyntaxLine),
            Just(Breaker::Truncate),
            "[a-z :{}\\[\\],'\"#|>!&*@\\t\\n]{1,4}".prop_map(Breaker::Junk),
            Just(Breaker::NotUtf8),
        ];
        prop_oneof![
            2 => (0..FILES, any::<u8>(), any::<u8>())
                .prop_map(|(file, keep, variant)| Step::Rewrite { file, keep, variant }),
            5 => (0..FILES, 0usize..8, any::<usize>(), breaker)
                .prop_map(|(file, doc, at, how)| Step::Break { file, doc, at, how }),
            1 => (0..FILES).prop_map(|file| Step::Restore { file }),
        ]
    }

    /// The documents of `file` in the pool: (pool index, its versions).
    fn file_docs(pool: &[[String; 2]], file: usize) -> Vec<&[String; 2]> {
        pool.iter().skip(file).step_by(FILES).collect()
    }

    fn rewrite(pool: &[[String; 2]], file: usize, keep: u8, variant: u8) -> String {
        file_docs(pool, file)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| keep & (1 << i) != 0)
            .map(|(i, v)| v[usize::from(variant >> i & 1)].clone())
            .collect::<Vec<_>>()
            .join("---\n")
    }

    /// Every node of a YAML tree below the root, as a path of steps.
    fn paths(v: &Value, prefix: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
        match v {
            Value::Mapping(m) => {
                for (k, child) in m {
                    prefix.push(k.clone());
                    out.push(prefix.clone());
                    paths(child, prefix, out);
                    prefix.pop();
                }
            }
            Value::Sequence(s) => {
                for (i, child) in s.iter().enumerate() {
                    prefix.push(Value::from(i as u64));
                    out.push(prefix.clone());
                    paths(child, prefix, out);
                    prefix.pop();
                }
            }
            _ => {}
        }
    }

    fn node_mut<'a>(v: &'a mut Value, path: &[Value]) -> Option<&'a mut Value> {
        let Some((first, rest)) = path.split_first() else {
            return Some(v);
        };
        let child = match v {
            Value::Mapping(m) => m.get_mut(first)?,
            Value::Sequence(s) => s.get_mut(usize::try_from(first.as_u64()?).ok()?)?,
            _ => return None,
        };
        node_mut(child, rest)
    }

    /// A value of another type than `v`.
    fn other_type(v: &Value) -> Value {
        match v {
            Value::Mapping(_) | Value::Sequence(_) | Value::Null => Value::from("x"),
            Value::String(_) => serde_yaml::from_str("{a: 1}").unwrap(),
            _ => Value::Sequence(vec![Value::from(1)]),
        }
    }

    /// The file's text with document `doc` broken by `how` (bytes: the
    /// text may stop being UTF-8).
    fn broken(text: &str, doc: usize, at: usize, how: &Breaker) -> Vec<u8> {
        let docs: Vec<&str> = text.split("---\n").collect();
        if text.is_empty() {
            return b"@\n".to_vec();
        }
        let d = doc % docs.len();
        let target = docs[d];
        let prefix: usize = docs[..d].iter().map(|s| s.len() + 4).sum();
        // A byte offset inside the target document, on a char boundary.
        let mut cut = at % (target.len() + 1);
        while !target.is_char_boundary(cut) {
            cut -= 1;
        }
        let line_starts: Vec<usize> = std::iter::once(0)
            .chain(target.match_indices('\n').map(|(i, _)| i + 1))
            .filter(|i| *i < target.len())
            .collect();
        let line = line_starts[at % line_starts.len()];
        let replaced = |new_doc: String| {
            let mut all: Vec<String> = docs.iter().map(|s| (*s).to_owned()).collect();
            all[d] = new_doc;
            all.join("---\n").into_bytes()
        };
        match how {
            Breaker::WrongType => {
                let mut v: Value = serde_yaml::from_str(target).unwrap();
                let mut all = Vec::new();
                paths(&v, &mut Vec::new(), &mut all);
                let path = &all[at % all.len()];
                let node = node_mut(&mut v, path).unwrap();
                *node = other_type(node);
                replaced(serde_yaml::to_string(&v).unwrap())
            }
            Breaker::SyntaxLine => {
                replaced(format!("{}@oops\n{}", &target[..line], &target[line..]))
            }
            Breaker::Truncate => {
                let mut out = text.as_bytes()[..prefix + cut].to_vec();
                out.extend_from_slice(b"\n@");
                out
            }
            Breaker::Junk(junk) => replaced(format!("{}{junk}{}", &target[..cut], &target[cut..])),
            Breaker::NotUtf8 => {
                let mut out = text.as_bytes().to_vec();
                out.insert(prefix + cut, 0xff);
                out
            }
        }
    }

    /// Whether the file as written reads cleanly (the loader's own
    /// verdict: a clean file is the user's intent, even if an edit meant
    /// as breakage happened to produce valid YAML).
    fn clean(path: &Path) -> bool {
        let mut loaded = LoadedManifests::default();
        load_file(path, &mut loaded);
        let _ = loaded.cluster_state("", Vec::new());
        !loaded.errors.iter().any(|e| e.unsettles_file())
    }

    /// The objects, namespaces that are only referenced made explicit (as
    /// the loader and the compiler imply them).
    fn objects(s: &ClusterState) -> String {
        let mut namespaces = s.namespaces.clone();
        for ns in s.pods.keys().chain(s.policies.keys()).map(|k| &k.namespace) {
            namespaces
                .entry(ns.to_string())
                .or_insert_with(|| NamespaceInfo {
                    labels: [("kubernetes.io/metadata.name".to_owned(), ns.to_string())].into(),
                });
        }
        format!("{namespaces:?}\n{:?}\n{:?}", s.pods, s.policies)
    }

    fn run(steps: &[Step]) -> Result<(), TestCaseError> {
        static CASE: AtomicUsize = AtomicUsize::new(0);
        let case = CASE.fetch_add(1, Ordering::Relaxed);
        let dir = Scratch::new(&format!("fuzz{case}"));
        let reference_dir = Scratch::new(&format!("fuzzref{case}"));
        let pool = pool();
        let names: Vec<String> = (0..FILES).map(|f| format!("f{f}.yaml")).collect();
        // Start: every document, version 0, every file clean.
        let mut good: Vec<String> = (0..FILES).map(|f| rewrite(&pool, f, 0xff, 0)).collect();
        let mut is_clean = [true; FILES];
        for f in 0..FILES {
            dir.write(&names[f], &good[f]);
        }
        let mut d = Directory::default();
        // The consumer's copy, built only from the published changes.
        let mut replica = ClusterState::default();
        let publish = |d: &mut Directory, replica: &mut ClusterState| {
            if let Some((changes, _)) = d.refresh(&dir.0) {
                for c in &changes {
                    replica.apply(c);
                }
            }
        };
        publish(&mut d, &mut replica);
        for (n, step) in steps.iter().enumerate() {
            let file = match step {
                Step::Rewrite { file, .. } | Step::Break { file, .. } | Step::Restore { file } => {
                    *file
                }
            };
            let bytes = match step {
                Step::Rewrite { keep, variant, .. } => {
                    rewrite(&pool, file, *keep, *variant).into_bytes()
                }
                Step::Break { doc, at, how, .. } => broken(&good[file], *doc, *at, how),
                Step::Restore { .. } => good[file].clone().into_bytes(),
            };
            dir.write(&names[file], &bytes);
            is_clean[file] = clean(&dir.0.join(&names[file]));
            if is_clean[file] {
                good[file] = String::from_utf8(bytes).unwrap();
            }
            publish(&mut d, &mut replica);
            prop_assert_eq!(
                objects(&replica),
                objects(d.state()),
                "step {}: the published changes rebuild the directory's state",
                n
            );
            // The last good version of every file, read afresh.
            for f in 0..FILES {
                reference_dir.write(&names[f], &good[f]);
            }
            let reference = load_dir(&reference_dir.0).cluster_state("", Vec::new());
            let want = isolated(&compile(&reference));
            let got = isolated(&compile(&replica));
            let lost: Vec<_> = want.difference(&got).collect();
            prop_assert!(
                lost.is_empty(),
                "step {} ({:?}): isolation lost {:?}\nfile now:\n{}",
                n,
                step,
                lost,
                String::from_utf8_lossy(&std::fs::read(dir.0.join(&names[file])).unwrap())
            );
            if is_clean.iter().all(|c| *c) {
                prop_assert_eq!(
                    objects(&replica),
                    objects(&reference),
                    "step {}: every file reads cleanly, so the state is exactly theirs",
                    n
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// Never fewer isolated pods than the last good version of every
        /// file; exactly that state once every file reads cleanly.
        #[test]
        fn broken_manifests_never_isolate_fewer_pods_than_the_last_good_state(
            steps in proptest::collection::vec(step(), 1..14)
        ) {
            run(&steps)?;
        }
    }
}

// ------------------------------------- iptables: names, forged sources

mod iptables_render {
    use std::{collections::BTreeMap, net::IpAddr};

    use ipnet::IpNet;
    use policy_agent::{
        cluster::{ObjectKind, PodRef},
        datapath::iptables::{
            ChainKind, DEFAULT_MARK, FORWARD_CHAIN, Family, NAME_BITS, RenderInput, Ruleset,
            is_own_chain, is_own_set, render,
        },
        source::manifests::{LoadedManifests, load_text},
    };
    use policy_common::{direction, proto};

    use super::*;
    use crate::support::netfilter::words;

    /// A namespace with the Pod Security labels: its identity names are
    /// longer than the 240 bytes an IdentityName stores, and the namespace
    /// labels come first, so the pod labels that tell identities apart are
    /// cut off the stored name.
    const PSA_CLUSTER: &str = "\
apiVersion: v1
kind: Namespace
metadata:
  name: shop
  labels:
    pod-security.kubernetes.io/enforce: restricted
    pod-security.kubernetes.io/enforce-version: latest
    pod-security.kubernetes.io/audit: restricted
    pod-security.kubernetes.io/audit-version: latest
    pod-security.kubernetes.io/warn: restricted
    pod-security.kubernetes.io/warn-version: latest
---
apiVersion: v1
kind: Pod
metadata: {name: frontend, namespace: shop, labels: {app: frontend}}
spec: {nodeName: n1, containers: []}
status: {podIPs: [{ip: 10.0.0.1}, {ip: 'fd00::1'}]}
---
apiVersion: v1
kind: Pod
metadata: {name: backend, namespace: shop, labels: {app: backend}}
spec: {nodeName: n1, containers: []}
status: {podIPs: [{ip: 10.0.0.2}, {ip: 'fd00::2'}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db1, namespace: shop, labels: {app: db1}}
spec: {nodeName: n1, containers: []}
status: {podIPs: [{ip: 10.0.0.3}, {ip: 'fd00::3'}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db2, namespace: shop, labels: {app: db2}}
spec: {nodeName: n1, containers: []}
status: {podIPs: [{ip: 10.0.0.4}, {ip: 'fd00::4'}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db1, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db1}}
  ingress: [{from: [{podSelector: {matchLabels: {app: frontend}}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db2, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db2}}
  ingress: [{from: [{podSelector: {matchLabels: {app: backend}}}], ports: [{port: 80}]}]
  egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/30]}}]}]
  policyTypes: [Ingress, Egress]
";

    pub(super) fn compiled(yaml: &str) -> Compiled {
        let mut loaded = LoadedManifests::default();
        load_text(Path::new("cluster.yaml"), yaml, &mut loaded);
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
        let state = loaded.cluster_state("n1", Vec::new());
        let c = policy::compile(&state, &mut IdentityAllocator::new());
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        c
    }

    pub(super) fn interfaces(c: &Compiled) -> BTreeMap<PodRef, String> {
        c.local_pods
            .keys()
            .map(|p| (p.clone(), format!("veth-{}", p.name)))
            .collect()
    }

    pub(super) fn rendered(c: &Compiled, name_bits: u32) -> Ruleset {
        render(&RenderInput {
            maps: &c.maps,
            local_pods: &c.local_pods,
            interfaces: &interfaces(c),
            rules: &c.rules,
            mark: DEFAULT_MARK,
            name_bits,
        })
    }

    /// A packet crossing FORWARD.
    pub(super) struct Packet<'a> {
        pub in_if: Option<&'a str>,
        pub out_if: Option<&'a str>,
        pub src: IpAddr,
        pub dst: IpAddr,
        pub proto: u8,
        pub dport: u16,
        /// ICMPv6 type (for neighbour discovery rules).
        pub icmp_type: u8,
    }

    impl<'a> Packet<'a> {
        /// A DNS query from `src` to `dst`, entering at `in_if` and
        /// leaving at `out_if`.
        pub fn dns(in_if: &'a str, out_if: &'a str, src: IpAddr, dst: IpAddr) -> Self {
            Packet {
                in_if: Some(in_if),
                out_if: Some(out_if),
                src,
                dst,
                proto: proto::UDP,
                dport: 53,
                icmp_type: 0,
            }
        }
    }

    fn in_set(rs: &Ruleset, name: &str, addr: IpAddr) -> bool {
        let Some(set) = rs.sets.get(name) else {
            panic!("a rule names set {name}, which is not rendered");
        };
        // hash:net with nomatch: the most specific entry decides.
        set.entries
            .iter()
            .filter(|(net, _)| net.contains(&addr))
            .max_by_key(|(net, _)| net.prefix_len())
            .is_some_and(|(_, nomatch)| !nomatch)
    }

    fn proto_name(p: u8) -> &'static str {
        match p {
            proto::TCP => "tcp",
            proto::UDP => "udp",
            proto::SCTP => "sctp",
            58 => "ipv6-icmp",
            _ => "other",
        }
    }

    enum Flow {
        Next,
        Drop,
    }

    /// Runs `chain` as netfilter would for a new (untracked) packet.
    fn run_chain(rs: &Ruleset, fam: Family, chain: &str, p: &Packet<'_>, mark: &mut bool) -> Flow {
        let Some(c) = rs.chains[&fam].iter().find(|c| c.name == chain) else {
            panic!("a rule jumps to chain {chain}, which is not rendered");
        };
        let fam_net = |s: &str| -> IpNet {
            s.parse::<IpNet>()
                .unwrap_or_else(|_| IpNet::from(s.parse::<IpAddr>().unwrap()))
        };
        'rules: for rule in &c.rules {
            let w = words(rule);
            let mut i = 0;
            while i < w.len() {
                let arg = |k: usize| w[i + k].as_str();
                let ok = match arg(0) {
                    "-m" => match arg(1) {
                        "conntrack" => {
                            i += 4;
                            false
                        }
                        // A new packet's flow has no connmark yet.
                        "connmark" if arg(2) == "!" => {
                            i += 5;
                            true
                        }
                        "connmark" => {
                            i += 4;
                            false
                        }
                        "comment" => {
                            i += 4;
                            true
                        }
                        "mark" => {
                            i += 4;
                            *mark
                        }
                        "set" => {
                            let addr = if arg(4) == "src" { p.src } else { p.dst };
                            let hit = in_set(rs, arg(3), addr);
                            i += 5;
                            hit
                        }
                        "icmp6" => {
                            let hit = arg(3).parse::<u8>().unwrap() == p.icmp_type;
                            i += 4;
                            hit
                        }
                        other => panic!("unknown match {other} in {rule}"),
                    },
                    "-i" => {
                        let hit = p.in_if == Some(arg(1));
                        i += 2;
                        hit
                    }
                    "-o" => {
                        let hit = p.out_if == Some(arg(1));
                        i += 2;
                        hit
                    }
                    "!" => {
                        let hit = match arg(1) {
                            "-s" => !fam_net(arg(2)).contains(&p.src),
                            "-d" => !fam_net(arg(2)).contains(&p.dst),
                            "-i" => p.in_if != Some(arg(2)),
                            "-o" => p.out_if != Some(arg(2)),
                            other => panic!("unknown negation {other} in {rule}"),
                        };
                        i += 3;
                        hit
                    }
                    "-s" => {
                        let hit = fam_net(arg(1)).contains(&p.src);
                        i += 2;
                        hit
                    }
                    "-d" => {
                        let hit = fam_net(arg(1)).contains(&p.dst);
                        i += 2;
                        hit
                    }
                    "-p" => {
                        let hit = proto_name(p.proto) == arg(1);
                        i += 2;
                        hit
                    }
                    "--dport" => {
                        let (a, b) = arg(1).split_once(':').unwrap_or((arg(1), arg(1)));
                        let hit = (a.parse::<u16>().unwrap()..=b.parse::<u16>().unwrap())
                            .contains(&p.dport);
                        i += 2;
                        hit
                    }
                    "-j" => {
                        match arg(1) {
                            "RETURN" => return Flow::Next,
                            "DROP" => return Flow::Drop,
                            "MARK" => {
                                let (v, _) = arg(3).split_once('/').unwrap();
                                *mark = v != "0x0";
                            }
                            "CONNMARK" => {}
                            target => {
                                if let Flow::Drop = run_chain(rs, fam, target, p, mark) {
                                    return Flow::Drop;
                                }
                            }
                        }
                        continue 'rules;
                    }
                    other => panic!("unknown word {other} in {rule}"),
                };
                if !ok {
                    continue 'rules;
                }
            }
        }
        Flow::Next
    }

    /// Whether the rendered rules let `p` through FORWARD.
    pub(super) fn passes(rs: &Ruleset, p: &Packet<'_>) -> bool {
        let fam = if p.src.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        };
        matches!(run_chain(rs, fam, FORWARD_CHAIN, p, &mut false), Flow::Next)
    }

    /// Every flow between the pods (and a few outside addresses), through
    /// the rendered rules and through the maps.
    pub(super) fn flows(c: &Compiled, rs: &Ruleset) -> Vec<(String, bool, bool)> {
        let model = c.maps.to_model(|_| 0);
        let ifs = interfaces(c);
        let owner: BTreeMap<IpAddr, &PodRef> = c
            .local_pods
            .iter()
            .flat_map(|(p, ips)| ips.iter().map(move |ip| (*ip, p)))
            .collect();
        let mut addrs: Vec<IpAddr> = owner.keys().copied().collect();
        addrs
            .extend(["10.0.0.200", "8.8.8.8", "2001:db8::1"].map(|a| a.parse::<IpAddr>().unwrap()));
        let mut out = Vec::new();
        for s in &addrs {
            for d in addrs
                .iter()
                .filter(|d| d.is_ipv4() == s.is_ipv4() && *d != s)
            {
                for (p, port) in [(proto::TCP, 80), (proto::TCP, 81), (proto::UDP, 53)] {
                    let mut maps = true;
                    if let Some(ep) = owner.get(s).and_then(|o| c.maps.endpoints.get(*o)) {
                        maps &= !model
                            .judge(ep, direction::EGRESS, *d, p, port)
                            .reason
                            .is_drop();
                    }
                    if let Some(ep) = owner.get(d).and_then(|o| c.maps.endpoints.get(*o)) {
                        maps &= !model
                            .judge(ep, direction::INGRESS, *s, p, port)
                            .reason
                            .is_drop();
                    }
                    let packet = Packet {
                        in_if: owner.get(s).map(|o| ifs[*o].as_str()),
                        out_if: owner.get(d).map(|o| ifs[*o].as_str()),
                        src: *s,
                        dst: *d,
                        proto: p,
                        dport: port,
                        icmp_type: 0,
                    };
                    out.push((format!("{s} -> {d} {p}/{port}"), passes(rs, &packet), maps));
                }
            }
        }
        out
    }

    #[test]
    fn sets_are_named_by_the_whole_identity_key() {
        let c = compiled(PSA_CLUSTER);
        // The stored names of frontend's and backend's identities are cut
        // before their app label: only the full key tells them apart.
        let cut: Vec<String> = c
            .maps
            .identities
            .values()
            .filter(|n| n.name_len as usize > n.name.len())
            .map(|n| policy_agent::mapstate::identity_name_str(n))
            .collect();
        assert!(
            cut.len() >= 2 && cut.windows(2).any(|w| w[0] == w[1]),
            "{cut:?}"
        );
        let rs = rendered(&c, NAME_BITS);
        assert!(rs.problems.is_empty(), "{:?}", rs.problems);
        // The set db1's rule names holds frontend and nothing else; db2's
        // holds backend.
        for (pod, peer) in [("db1", "10.0.0.1"), ("db2", "10.0.0.2")] {
            let chain = rs
                .pod_chains
                .iter()
                .find(|(_, (p, d, _))| *p.name == *pod && *d == direction::INGRESS)
                .map(|(c, _)| c)
                .unwrap();
            let sets: Vec<&String> = rs.chain_refs[chain]
                .iter()
                .flat_map(|p| &rs.chain_sets[p])
                .filter(|s| s.ends_with("-4"))
                .collect();
            assert_eq!(sets.len(), 1, "{sets:?}");
            let entries: Vec<String> = rs.sets[sets[0]]
                .entries
                .iter()
                .map(|(n, _)| n.addr().to_string())
                .collect();
            assert_eq!(entries, vec![peer.to_owned()], "{pod}");
        }
        for (what, got, want) in flows(&c, &rs) {
            assert_eq!(got, want, "{what}");
        }
    }

    #[test]
    fn names_that_collide_fail_closed_and_are_reported() {
        let c = compiled(PSA_CLUSTER);
        // Narrowed hashes make names collide: whatever collides must be
        // left out or dropped, never merged into something that allows
        // more than the maps do.
        for bits in [0, 1, 2, 3] {
            let rs = rendered(&c, bits);
            let mut opened = Vec::new();
            for (what, got, want) in flows(&c, &rs) {
                if got && !want {
                    opened.push(what);
                }
            }
            assert!(opened.is_empty(), "{bits} bits open {opened:?}");
        }
        let rs = rendered(&c, 0);
        // Every pod collides with every other: each isolated direction is
        // a plain DROP; every identity set collides; both kinds reported.
        let forward = &rs.chains[&Family::V4][0];
        assert!(
            forward.rules.iter().any(|r| r == "-o veth-db1 -j DROP"),
            "{:?}",
            forward.rules
        );
        assert!(rs.problems.iter().any(|p| {
            p.subject
                .object()
                .is_some_and(|(k, _)| k == ObjectKind::Pod)
        }));
        assert!(
            rs.problems
                .iter()
                .any(|p| p.reason.contains("set name of identity"))
        );
        // A collision of only some names: here two identity sets (the
        // kind letter keeps classes and world apart) but not the pods.
        let rs = rendered(&c, 1);
        assert!(!rs.problems.is_empty());
    }

    #[test]
    fn forged_sources_never_pass_the_rendered_rules() {
        let c = compiled(PSA_CLUSTER);
        let rs = rendered(&c, NAME_BITS);
        let ifs = interfaces(&c);
        // Every pod, isolated or not (frontend and backend are not),
        // sending as every other pod, to every pod: dropped.
        for sender in c.local_pods.keys() {
            for (claimed, claimed_ips) in c.local_pods.iter().filter(|(p, _)| *p != sender) {
                for (dst, dst_ips) in &c.local_pods {
                    for (src, dst_ip) in claimed_ips.iter().flat_map(|s| {
                        dst_ips
                            .iter()
                            .filter(move |d| d.is_ipv4() == s.is_ipv4() && *d != s)
                            .map(move |d| (*s, *d))
                    }) {
                        let p = Packet::dns(&ifs[sender], &ifs[dst], src, dst_ip);
                        assert!(
                            !passes(&rs, &p),
                            "{sender} sending as {claimed} ({src}) to {dst} passed"
                        );
                    }
                }
            }
        }
        // A local pod's address entering the node anywhere but at its own
        // interface (a tunnel device's decapsulated inner packet, a spoof
        // from the uplink) reaches no pod, isolated or not.
        for (claimed, claimed_ips) in &c.local_pods {
            for (dst, dst_ips) in c.local_pods.iter().filter(|(p, _)| *p != claimed) {
                for (src, dst_ip) in claimed_ips.iter().flat_map(|s| {
                    dst_ips
                        .iter()
                        .filter(move |d| d.is_ipv4() == s.is_ipv4())
                        .map(move |d| (*s, *d))
                }) {
                    for in_if in ["uplink0", "tunnel0"] {
                        let p = Packet::dns(in_if, &ifs[dst], src, dst_ip);
                        assert!(
                            !passes(&rs, &p),
                            "{claimed}'s {src} from {in_if} to {dst} passed"
                        );
                    }
                }
            }
        }
        // A pod's own address arriving from elsewhere is not self traffic:
        // db1 takes only frontend.
        for ip in ["10.0.0.3", "fd00::3"] {
            let ip: IpAddr = ip.parse().unwrap();
            let p = Packet {
                in_if: Some("uplink0"),
                out_if: Some("veth-db1"),
                src: ip,
                dst: ip,
                proto: proto::TCP,
                dport: 80,
                icmp_type: 0,
            };
            assert!(!passes(&rs, &p), "{ip} from the uplink passed as db1's own");
            let hairpin = Packet {
                in_if: Some("veth-db1"),
                ..p
            };
            assert!(
                passes(&rs, &hairpin),
                "{ip}: db1 to itself through the node"
            );
        }
    }

    #[test]
    fn only_names_of_the_agents_exact_shape_are_its_own() {
        for own in [
            "pa-agent:FORWARD",
            "pa-agent:I-0123456789abcdef",
            "pa-agent:P-0123456789abcdef",
            "pa-agent:N-0123456789abcdef",
        ] {
            assert!(is_own_chain(own), "{own}");
        }
        // Every kind of chain the agent writes is one it removes: a kind
        // left out here was once never removed, and the tier chain it
        // jumps to could then not be deleted either (EBUSY).
        for kind in ChainKind::ALL {
            let name = kind.name(0x0123_4567_89ab_cdef);
            assert!(is_own_chain(&name), "{name}");
        }
        for foreign in [
            "PA-FORWARD",
            "PA-I-0123abcd",
            "PAYROLL",
            "PA-LOCAL",
            "pa-agent:X-0123456789abcdef",
            "pa-agent:IN-0123456789abcdef",
            "pa-agent:I-0123456789abcde",
            "pa-agent:I-0123456789ABCDEF",
            "pa-agent:FORWARDER",
        ] {
            assert!(!is_own_chain(foreign), "{foreign}");
        }
        for own in [
            "pa-agent:I-0123456789abcdef-4",
            "pa-agent:C-0123456789abcdef-6",
            "pa-agent:W-0123456789abcdef-4-t",
        ] {
            assert!(is_own_set(own), "{own}");
        }
        for foreign in [
            "PAI-0123abcd-v4",
            "PAYROLL",
            "PA",
            "pa-agent:I-0123456789abcdef-5",
            "pa-agent:I-0123456789abcdef-4-x",
            "pa-agent:I-0123456789abcdef",
        ] {
            assert!(!is_own_set(foreign), "{foreign}");
        }
        // Every name the renderer makes is its own, and fits the limits.
        let rs = rendered(&compiled(PSA_CLUSTER), NAME_BITS);
        for name in rs.sets.keys() {
            assert!(is_own_set(name) && name.len() + 2 <= 31, "{name}");
        }
        for chain in rs.chains.values().flatten() {
            assert!(
                is_own_chain(&chain.name) && chain.name.len() <= 28,
                "{}",
                chain.name
            );
        }
    }
}
