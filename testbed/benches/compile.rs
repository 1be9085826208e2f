//! Compiler benchmark: a full compile of a 10,000-pod, 1,000-policy,
//! 100-namespace cluster, and the incremental diff of one pod relabel.
//!
//! `cargo bench -p policy-testbed --bench compile`
//!
//! Before the timings it prints the size of the compiled state (entries,
//! bytes by entry size, and live heap bytes measured by a counting
//! allocator) for 1,000 to 10,000 pods. Everything it prints, and
//! criterion's medians, go to target/bench-results/compile.json, from
//! which `cargo xtask bench` writes the compiler tables of
//! docs/BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    alloc::{GlobalAlloc, Layout, System},
    hint::black_box,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    sync::atomic::{AtomicIsize, Ordering},
    time::{Duration, Instant},
};

use criterion::{BatchSize, Criterion};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use policy_agent::{
    cluster::{Change, ClusterState, ContainerPort, NamespaceInfo, ObjectRef, PodFields, PodInfo},
    identity::IdentityAllocator,
    policy::{CompileOptions, Compiler},
};
use policy_common::proto;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Counts live heap bytes, to report the compiled state's memory.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const TIERS: [&str; 5] = ["frontend", "backend", "db", "cache", "worker"];
const LOCAL: &str = "node-00";
const NODES: usize = 20;

/// A deterministic cluster: `pods` pods in deployments of 5-15 replicas
/// spread over `pods / 100` namespaces, `pods / 10` policies, pods on 20
/// nodes (the local one holds ~1/20).
fn cluster(pods: usize, seed: u64) -> ClusterState {
    let mut rng = StdRng::seed_from_u64(seed);
    let namespaces = (pods / 100).max(1);
    let mut s = ClusterState {
        node_name: LOCAL.into(),
        node_ips: vec![IpAddr::V4(Ipv4Addr::new(192, 168, 0, 1))],
        ..Default::default()
    };
    for n in 0..namespaces {
        let name = format!("ns-{n:03}");
        let labels = [
            ("kubernetes.io/metadata.name", name.as_str()),
            ("team", &format!("team-{}", n % 10)),
            ("env", ["prod", "staging", "dev"][n % 3]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        s.namespaces.insert(name, NamespaceInfo { labels });
    }
    let mut made = 0usize;
    let mut dep = 0usize;
    while made < pods {
        let ns = format!("ns-{:03}", dep % namespaces);
        // Deployments of a namespace take turns through the tiers.
        let tier = TIERS[(dep / namespaces) % TIERS.len()];
        let app = format!("app-{dep}");
        let replicas = rng.random_range(5..=15).min(pods - made);
        let ports = match tier {
            "frontend" => vec![("http", 8080 + (dep % 3) as u16), ("https", 8443)],
            "backend" => vec![("http", 9000), ("metrics", 9090)],
            "db" => vec![("db", 5432)],
            "cache" => vec![("redis", 6379)],
            _ => vec![("metrics", 9090)],
        };
        for r in 0..replicas {
            let i = made as u32;
            let v4 = IpAddr::V4(Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8));
            let mut ips = vec![v4];
            if dep.is_multiple_of(4) {
                ips.push(IpAddr::V6(Ipv6Addr::new(
                    0xfd00,
                    0,
                    0,
                    0,
                    0,
                    0,
                    (i >> 16) as u16,
                    i as u16,
                )));
            }
            let labels = [
                ("app", app.as_str()),
                ("tier", tier),
                ("team", &format!("team-{}", dep % 10)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
            s.pods.insert(
                ObjectRef::new(ns.clone(), format!("{app}-{r}")),
                PodFields {
                    labels: policy_agent::cluster::pod_labels(labels),
                    node_name: Some(format!("node-{:02}", rng.random_range(0..NODES)).into()),
                    ips: ips.into(),
                    ports: ports
                        .iter()
                        .map(|(n, p)| ContainerPort {
                            name: Some((*n).into()),
                            port: *p,
                            protocol: proto::TCP,
                        })
                        .collect(),
                    created: i64::from(i),
                    ..Default::default()
                }
                .into(),
            );
            made += 1;
        }
        dep += 1;
    }
    for n in 0..namespaces {
        for k in 0..10 {
            let ns = format!("ns-{n:03}");
            let yaml = policy_yaml(n, k, &mut rng, namespaces, dep);
            let np: NetworkPolicy =
                serde_yaml::from_str(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
            s.policies
                .insert(ObjectRef::new(ns, format!("p{k}")), np.into());
        }
    }
    s
}

/// Policy `k` of namespace `n`: realistic shapes.
fn policy_yaml(
    n: usize,
    k: usize,
    rng: &mut StdRng,
    namespaces: usize,
    deployments: usize,
) -> String {
    // A deployment of this namespace (deployment d lives in d % namespaces).
    let app = format!(
        "app-{}",
        (n + rng.random_range(0..10) * namespaces) % deployments.max(1)
    );
    let spec = match k {
        0 => "podSelector: {}\n  policyTypes: [Ingress]".to_owned(),
        1 => "podSelector: {matchLabels: {tier: backend}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {tier: frontend}}}]\n    ports: [{port: http}]".to_owned(),
        2 => "podSelector: {matchLabels: {tier: db}}\n  ingress:\n  - from: [{podSelector: {matchLabels: {tier: backend}}}]\n    ports: [{port: 5432}]".to_owned(),
        3 => format!(
            "podSelector: {{matchLabels: {{app: {app}}}}}\n  ingress:\n  - from:\n    - namespaceSelector: {{matchLabels: {{team: team-{}}}}}\n      podSelector: {{matchLabels: {{tier: frontend}}}}\n    ports: [{{port: 8080}}, {{port: 8443}}]",
            n % 10
        ),
        4 => "podSelector: {matchLabels: {tier: frontend}}\n  policyTypes: [Ingress, Egress]\n  egress:\n  - to: [{podSelector: {matchLabels: {tier: backend}}}]\n    ports: [{port: http}]\n  - to: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: ns-000}}}]\n    ports: [{port: 53, protocol: UDP}, {port: 53}]".to_owned(),
        5 => format!(
            "podSelector: {{matchLabels: {{tier: frontend}}}}\n  ingress:\n  - from: [{{ipBlock: {{cidr: 172.16.{}.0/24, except: [172.16.{}.128/25]}}}}]\n    ports: [{{port: 443}}]",
            n % 256,
            n % 256
        ),
        6 => format!(
            "podSelector: {{matchLabels: {{app: {app}}}}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{{ipBlock: {{cidr: 0.0.0.0/0, except: [10.0.0.0/8, 192.168.0.0/16]}}}}]\n    ports: [{{port: 443}}]"
        ),
        7 => "podSelector: {matchLabels: {tier: cache}}\n  ingress:\n  - from: [{podSelector: {}}]\n    ports: [{port: 6379, endPort: 6389}]".to_owned(),
        8 => format!(
            "podSelector: {{matchLabels: {{app: {app}}}}}\n  ingress:\n  - from: [{{namespaceSelector: {{matchExpressions: [{{key: env, operator: In, values: [prod]}}]}}}}]\n    ports: [{{port: 30000, endPort: 30100}}]"
        ),
        _ => "podSelector: {matchLabels: {tier: worker}}\n  ingress:\n  - from: [{podSelector: {matchExpressions: [{key: tier, operator: NotIn, values: [db]}]}}]\n    ports: [{port: 8000, endPort: 8080}]".to_owned(),
    };
    format!("metadata: {{name: p{k}, namespace: ns-{n:03}}}\nspec:\n  {spec}")
}

struct Size {
    pods: usize,
    local: usize,
    policy: usize,
    ipcache: usize,
    identities: usize,
    entry_bytes: usize,
    heap_bytes: isize,
    compile: Duration,
}

/// `cluster(10_000, 7)` with 100 ClusterNetworkPolicies of both tiers.
fn cluster_with_tiers() -> ClusterState {
    let mut state = cluster(10_000, 7);
    state.cluster_policies.extend(
        policy_testbed::fixtures::tier_load::cluster_policies(
            100,
            |i| format!("team-{i}"),
            |i| format!("app-{i}"),
        )
        .into_iter()
        .map(|(name, cnp)| (name, cnp.into())),
    );
    state
}

fn measure(pods: usize, options: CompileOptions) -> Size {
    measure_state(&cluster(pods, 7), options)
}

fn measure_state(state: &ClusterState, options: CompileOptions) -> Size {
    let pods = state.pods.len();
    let mut ids = IdentityAllocator::new();
    let before = LIVE.load(Ordering::Relaxed);
    let start = Instant::now();
    let c = Compiler::build(state, &mut ids, options);
    let compile = start.elapsed();
    let heap_bytes = LIVE.load(Ordering::Relaxed) - before;
    let m = c.maps();
    let size = Size {
        pods,
        local: m.endpoints.len(),
        policy: m.policy.len(),
        ipcache: m.ipcache.len(),
        identities: m.identities.len(),
        entry_bytes: c.approx_bytes(),
        heap_bytes,
        compile,
    };
    drop(c);
    size
}

fn report() -> Vec<serde_json::Value> {
    println!(
        "| pods | policies | local endpoints | policy entries | ipcache entries | identities | entries × size | live heap (compiler) | one full compile |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for (pods, options) in [
        (1_000, CompileOptions::default()),
        (2_000, CompileOptions::default()),
        (5_000, CompileOptions::default()),
        (10_000, CompileOptions::default()),
        (
            1_000,
            CompileOptions {
                all_pods_local: true,
                ..CompileOptions::default()
            },
        ),
        (
            10_000,
            CompileOptions {
                all_pods_local: true,
                ..CompileOptions::default()
            },
        ),
    ] {
        let s = measure(pods, options);
        rows.push(size_row(&s, options, ""));
    }
    // The tiers' own entries: 10,000 pods with 100 ClusterNetworkPolicies.
    let s = measure_state(&cluster_with_tiers(), CompileOptions::default());
    rows.push(size_row(
        &s,
        CompileOptions::default(),
        " + 100 ClusterNetworkPolicies",
    ));
    rows
}

fn size_row(s: &Size, options: CompileOptions, note: &str) -> serde_json::Value {
    {
        let mib = |b: f64| b / (1 << 20) as f64;
        println!(
            "| {}{}{note} | {} | {} | {} | {} | {} | {:.1} MiB | {:.1} MiB | {:.0} ms |",
            s.pods,
            if options.all_pods_local {
                " (all local)"
            } else {
                ""
            },
            s.pods / 10,
            s.local,
            s.policy,
            s.ipcache,
            s.identities,
            mib(s.entry_bytes as f64),
            mib(s.heap_bytes as f64),
            s.compile.as_secs_f64() * 1e3,
        );
        serde_json::json!({
            "pods": s.pods, "all_local": options.all_pods_local, "policies": s.pods / 10,
            "cluster_policies": if note.is_empty() { 0 } else { 100 },
            "local_endpoints": s.local, "policy_entries": s.policy, "ipcache_entries": s.ipcache,
            "identities": s.identities, "entries_mib": mib(s.entry_bytes as f64),
            "heap_mib": mib(s.heap_bytes as f64), "one_compile_ms": s.compile.as_secs_f64() * 1e3,
        })
    }
}

/// One local relabel at 10k pods: incremental vs recompiling and diffing.
fn report_relabel() -> serde_json::Value {
    let mut state = cluster(10_000, 7);
    let mut ids = IdentityAllocator::new();
    let mut compiler = Compiler::build(&state, &mut ids, CompileOptions::default());
    let (pod, mut info) = some_pod(&state, true);
    std::sync::Arc::make_mut(&mut info.labels).insert("track".into(), "canary".into());
    state.pods.insert(pod.clone(), info.clone());
    let before = compiler.maps().clone();
    let mut full_ids = ids.clone();
    let start = Instant::now();
    let ops = compiler.apply([Change::UpsertPod(pod, info)], &mut ids);
    let incremental = start.elapsed();
    let start = Instant::now();
    let full = policy_agent::policy::compile(&state, &mut full_ids);
    let full_ops = policy_agent::mapstate::diff(&before, &full.maps);
    let recompile = start.elapsed();
    assert_eq!(ops, full_ops);
    println!(
        "\none local pod relabel at 10k pods: {} map ops; incremental {:.3} ms, full compile + diff {:.0} ms\n",
        ops.len(),
        incremental.as_secs_f64() * 1e3,
        recompile.as_secs_f64() * 1e3
    );
    serde_json::json!({
        "ops": ops.len(), "incremental_ms": incremental.as_secs_f64() * 1e3,
        "full_compile_and_diff_ms": recompile.as_secs_f64() * 1e3,
    })
}

/// Criterion's median of one benchmark, in ms (None if it did not run
/// since `since`).
fn criterion_median_ms(group: &str, name: &str, since: std::time::SystemTime) -> Option<f64> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = target
        .join("criterion")
        .join(group)
        .join(name)
        .join("new/estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < since {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(v["median"]["point_estimate"].as_f64()? / 1e6)
}

/// A pod of `state` on the local node (or not), for the relabel benchmark.
fn some_pod(state: &ClusterState, local: bool) -> (ObjectRef, PodInfo) {
    let (k, v) = state
        .pods
        .iter()
        .find(|(_, p)| {
            (p.node_name.as_deref() == Some(LOCAL)) == local && p.labels["tier"] == "backend"
        })
        .unwrap();
    (k.clone(), v.clone())
}

fn bench_full(c: &mut Criterion) {
    let mut g = c.benchmark_group("full_compile");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    for (name, pods, options) in [
        ("1k_pods", 1_000, CompileOptions::default()),
        ("10k_pods_500_local", 10_000, CompileOptions::default()),
        (
            "10k_pods_all_local",
            10_000,
            CompileOptions {
                all_pods_local: true,
                ..CompileOptions::default()
            },
        ),
    ] {
        let state = cluster(pods, 7);
        bench_build(&mut g, name, &state, options);
    }
    let state = cluster_with_tiers();
    bench_build(
        &mut g,
        "10k_pods_100_cnps",
        &state,
        CompileOptions::default(),
    );
    g.finish();
}

fn bench_build(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    state: &ClusterState,
    options: CompileOptions,
) {
    {
        g.bench_function(name, |b| {
            b.iter_batched(
                IdentityAllocator::new,
                |mut ids| black_box(Compiler::build(state, &mut ids, options)),
                BatchSize::LargeInput,
            );
        });
    }
}

fn bench_relabel(c: &mut Criterion) {
    let mut g = c.benchmark_group("relabel_one_pod_diff");
    g.sample_size(50);
    for (name, pods, options, local) in [
        (
            "10k_pods_local_pod",
            10_000,
            CompileOptions::default(),
            true,
        ),
        (
            "10k_pods_remote_pod",
            10_000,
            CompileOptions::default(),
            false,
        ),
        (
            "10k_pods_all_local",
            10_000,
            CompileOptions {
                all_pods_local: true,
                ..CompileOptions::default()
            },
            true,
        ),
    ] {
        let state = cluster(pods, 7);
        let mut ids = IdentityAllocator::new();
        let mut compiler = Compiler::build(&state, &mut ids, options);
        let (pod, info) = some_pod(&state, local);
        let mut canary = info.clone();
        std::sync::Arc::make_mut(&mut canary.labels).insert("track".into(), "canary".into());
        let mut flip = false;
        g.bench_function(name, |b| {
            b.iter(|| {
                flip = !flip;
                let next = if flip { canary.clone() } else { info.clone() };
                let ops = compiler.apply([Change::UpsertPod(pod.clone(), next)], &mut ids);
                black_box(ops)
            });
        });
    }
    g.finish();
}

fn bench_policy_update(c: &mut Criterion) {
    let mut g = c.benchmark_group("policy_update_diff");
    g.sample_size(20);
    let state = cluster(10_000, 7);
    let mut ids = IdentityAllocator::new();
    let mut compiler = Compiler::build(&state, &mut ids, CompileOptions::default());
    let name = ObjectRef::new("ns-001", "p2");
    let original = (*state.policies[&name]).clone();
    let mut changed = original.clone();
    if let Some(rule) = changed
        .spec
        .as_mut()
        .and_then(|s| s.ingress.as_mut())
        .and_then(|r| r.first_mut())
    {
        rule.ports = None;
    }
    let mut flip = false;
    g.bench_function("10k_pods_one_policy_no_new_cidr", |b| {
        b.iter(|| {
            flip = !flip;
            let np = if flip {
                changed.clone()
            } else {
                original.clone()
            };
            black_box(compiler.apply([Change::UpsertPolicy(name.clone(), np.into())], &mut ids))
        });
    });
    g.finish();
}

/// Every benchmark: (criterion group, name).
const BENCHES: [(&str, &str); 8] = [
    ("full_compile", "1k_pods"),
    ("full_compile", "10k_pods_500_local"),
    ("full_compile", "10k_pods_all_local"),
    ("full_compile", "10k_pods_100_cnps"),
    ("relabel_one_pod_diff", "10k_pods_local_pod"),
    ("relabel_one_pod_diff", "10k_pods_remote_pod"),
    ("relabel_one_pod_diff", "10k_pods_all_local"),
    ("policy_update_diff", "10k_pods_one_policy_no_new_cidr"),
];

fn main() {
    let mut c = Criterion::default().configure_from_args();
    // `cargo test --benches` runs this in test mode: skip the long report.
    let full = !std::env::args().any(|a| a == "--test" || a == "--list");
    let mut json = serde_json::json!({});
    let started = std::time::SystemTime::now();
    if full {
        json["sizes"] = serde_json::Value::Array(report());
        json["relabel"] = report_relabel();
    }
    bench_full(&mut c);
    bench_relabel(&mut c);
    bench_policy_update(&mut c);
    c.final_summary();
    if full {
        let mut medians = serde_json::Map::new();
        for (group, name) in BENCHES {
            // A missing median would be rendered as no figure at all:
            // fail the run instead of writing a table of blanks.
            let ms = criterion_median_ms(group, name, started).unwrap_or_else(|| {
                panic!("criterion wrote no median for {group}/{name} (looked under CARGO_TARGET_DIR or target/criterion)")
            });
            medians.insert(format!("{group}/{name}"), serde_json::json!(ms));
        }
        json["median_ms"] = serde_json::Value::Object(medians);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("compile.json"),
            serde_json::to_string_pretty(&json).unwrap(),
        )
        .unwrap();
    }
}
