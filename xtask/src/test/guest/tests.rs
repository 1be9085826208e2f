use super::*;

#[test]
fn the_last_libtest_summary_counts() {
    let out = "running 3 tests\ntest a ... ok\n\ntest result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 17 filtered out; finished in 1.00s\n\n";
    assert_eq!(
        libtest_summary(out),
        Some(Summary {
            passed: 3,
            failed: 0
        })
    );
    let failed = "test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.5s";
    assert_eq!(
        libtest_summary(failed),
        Some(Summary {
            passed: 1,
            failed: 2
        })
    );
    assert_eq!(libtest_summary("thread 'main' panicked"), None);
}

#[test]
fn a_suite_takes_its_modules_minus_skips_and_only_its_filters() {
    let all: Vec<String> = [
        "kernel::test_run::a",
        "pod_range_guard_netns::b",
        "netns::twin",
        "netns::c",
        "cni::agent::first_packet_manifests_x",
        "cni::agent::other",
        "services::ipvs::d",
        "kernel::services::e",
    ]
    .map(str::to_owned)
    .to_vec();
    let by_name = |n: &str| SUITES.iter().find(|s| s.name == n).unwrap();
    assert_eq!(
        by_name("kernel").tests(&all),
        ["kernel::test_run::a", "kernel::services::e"]
    );
    let netns = Suite {
        skip: &["twin"],
        ..*by_name("netns")
    };
    assert_eq!(netns.tests(&all), ["netns::c"]);
    assert_eq!(
        by_name("cni").tests(&all),
        ["cni::agent::first_packet_manifests_x"]
    );
    assert_eq!(by_name("ipvs").tests(&all), ["services::ipvs::d"]);
}

#[test]
fn the_table_names_kernel_accel_times_and_subsets() {
    let rows = [
        Row {
            suite: "host: every test".into(),
            kernel: "6.18.0".into(),
            accel: "host".into(),
            boot_seconds: None,
            run_seconds: 500.0,
            result: "ok".into(),
            ok: true,
        },
        Row {
            suite: "conformance".into(),
            kernel: "6.1.0-56-amd64".into(),
            accel: "tcg".into(),
            boot_seconds: Some(8.04),
            run_seconds: 300.0,
            result: "ok, 17 passed".into(),
            ok: true,
        },
    ];
    let t = render(&rows);
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(
        lines[0],
        "suite            | kernel         | accel | boot s | run s | result"
    );
    assert!(
        lines[3].starts_with(
            "conformance      | 6.1.0-56-amd64 | tcg   |    8.0 | 300.0 | ok, 17 passed"
        ),
        "{t}"
    );
    assert!(t.contains("guest total: 308 s"), "{t}");
    assert!(
        t.contains("in the guest, conformance: only two tests"),
        "{t}"
    );
}
