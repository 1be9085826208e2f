//! The control-plane section of the shared block of docs/BENCHMARKS.md:
//! start, change latency in both modes, churn and memory, each beside
//! its goal.
use std::fmt::Write as _;

use serde_json::Value;

use super::render::{f, section_load};

/// One row: `what`, p50 / p99 / max of `key`, and its goal (rows whose
/// figures the run did not produce are left out).
fn latency_row(out: &mut String, c: &Value, what: &str, key: &str, goal: &str) {
    if c.get(format!("{key}_p99_ms")).is_none() {
        return;
    }
    let parts = match (
        c[format!("{key}_read_p50_ms")].as_f64(),
        c[format!("{key}_reconcile_p50_ms")].as_f64(),
    ) {
        (Some(read), Some(reconcile)) => {
            format!(
                " (medians of its parts: the source's read {read:.1} ms, the reconcile {reconcile:.1} ms)"
            )
        }
        _ => String::new(),
    };
    let _ = writeln!(
        out,
        "| {what}, p50 / p99 / max{parts} | {:.1} / {:.1} / {:.1} ms | {goal} |",
        f(c, &format!("{key}_p50_ms")),
        f(c, &format!("{key}_p99_ms")),
        f(c, &format!("{key}_max_ms"))
    );
}

pub(super) fn control_plane(out: &mut String, c: &Value) {
    let _ = writeln!(out, "### Control plane (`run` mode)\n");
    section_load(out, c);
    let _ = writeln!(
        out,
        "{} pods, {} policies, {} namespaces ({} pods local, the rest fill the ipcache). With manifests, a file rewritten (temporary file and rename); in cluster mode, an object written to the fake API server, which the agent watches. {} samples of each change ({} of a ClusterNetworkPolicy, each a full compile); nearest-rank percentiles. Each change has two ends: its endpoint entry changed (read from the pins; the change's later writes may still be landing), and its last write (the end of the sync that carried it, from the agent's log; with manifests, counted from the first directory read that began after the write, which never flatters). The churn writes {} new policies within one second, one every 10 ms ({} such bursts, removed between them), and times each to the end of the sync that carried it.\n",
        c["pods"],
        c["policies"],
        c["namespaces"],
        c["local_pods"],
        c["samples"],
        c["cluster_policy_samples"].as_u64().unwrap_or(200),
        c["churn"].as_u64().unwrap_or(100),
        c["churn_bursts"].as_u64().unwrap_or(1),
    );
    let _ = writeln!(out, "| figure | value | goal |\n|---|---:|---:|");
    let polled_before = if c.get("initial_ready_spawned_poll_ms").is_some() {
        format!(
            " (polled as this bench did before, by a process spawned every 0.5 ms: {:.0} ms)",
            f(c, "initial_ready_spawned_poll_ms")
        )
    } else {
        String::new()
    };
    let all = |key: &str| {
        c[key].as_array().map_or(String::new(), |v| {
            let runs: Vec<String> = v
                .iter()
                .filter_map(Value::as_f64)
                .map(|ms| format!("{ms:.0}"))
                .collect();
            format!(
                "; the median of {} runs: {} ms",
                runs.len(),
                runs.join(", ")
            )
        })
    };
    let _ = writeln!(
        out,
        "| start → ready, first install with netlink clsact filters, the default (program load + initial full sync; readiness polled from a thread every 2 ms{}){polled_before} | {:.0} ms | < 1 s |",
        all("initial_ready_all_ms"),
        f(c, "initial_ready_ms")
    );
    if let Some(tcx) = c["initial_ready_tcx_ms"].as_f64() {
        let _ = writeln!(
            out,
            "| start → ready, first install with TCX links (`--attach tcx`) | {tcx:.0} ms | reported |"
        );
    }
    let _ = writeln!(
        out,
        "| restart → ready over the pinned state (maps, programs and links adopted, every attachment checked{}) | {:.0} ms | < 0.5 s |",
        all("restart_ready_all_ms"),
        f(c, "restart_ready_ms")
    );
    if let Some(programs) = c["verified_instructions"]
        .as_array()
        .filter(|p| !p.is_empty())
    {
        let list: Vec<String> = programs
            .iter()
            .map(|p| {
                format!(
                    "{} {}",
                    p["program"].as_str().unwrap_or("?"),
                    p["instructions"]
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "| the verifier's instructions processed, per program loaded at a first install (a first start's load is most of its time) | {} | reported |",
            list.join(", ")
        );
    }
    if c.get("cluster_initial_ready_ms").is_some() {
        let _ = writeln!(
            out,
            "| start → ready in cluster mode (the fake API server; pins reset) | {:.0} ms | < 1 s |",
            f(c, "cluster_initial_ready_ms")
        );
    }
    if c.get("cluster_paged_initial_ready_ms").is_some() {
        let _ = writeln!(
            out,
            "| cluster mode, the same start from a server without streamed lists (listed in pages) | {:.0} ms | reported |",
            f(c, "cluster_paged_initial_ready_ms")
        );
        let _ = writeln!(
            out,
            "| cluster mode, the agent's peak RSS at ready: streamed lists / paged lists | {:.1} / {:.1} MiB | reported |",
            f(c, "cluster_peak_at_ready_mib"),
            f(c, "cluster_paged_peak_at_ready_mib")
        );
        let _ = writeln!(
            out,
            "| one pod event on the wire (a simulated pod: its labels, addresses, node) | {:.0} B | reported |",
            f(c, "pod_event_bytes")
        );
    }
    for (what, key, goal) in [
        (
            "one policy added → its endpoint entry",
            "policy_add",
            "reported",
        ),
        (
            "one policy added → its last write",
            "policy_add_last_write",
            "p99 < 25 ms",
        ),
        (
            "one pod relabelled → its endpoint entry",
            "relabel",
            "reported",
        ),
        (
            "one pod relabelled → its last write",
            "relabel_last_write",
            "p99 < 25 ms",
        ),
        (
            "cluster mode: one policy written to the API → its endpoint entry",
            "api_policy_add",
            "reported",
        ),
        (
            "cluster mode: one policy written to the API → its last write",
            "api_policy_add_last_write",
            "p99 < 25 ms",
        ),
        (
            "churn: 100 policies within one second → each one's last write",
            "churn_last_write",
            "p99 < 250 ms",
        ),
        (
            "one ClusterNetworkPolicy added → its endpoint entry (a full compile each)",
            "cluster_policy",
            "reported",
        ),
        (
            "one ClusterNetworkPolicy added → its last write",
            "cluster_policy_last_write",
            "reported",
        ),
    ] {
        latency_row(out, c, what, key, goal);
    }
    let _ = writeln!(
        out,
        "| agent peak RSS (VmHWM) | {:.1} MiB | < 64 MiB |",
        f(c, "peak_rss_mib")
    );
    if let Some(peak) = c["cgroup_peak_mib"].as_f64() {
        let _ = writeln!(
            out,
            "| the agent's memory cgroup, peak charge (its heap and the BPF maps it made) | {peak:.1} MiB | reported |"
        );
    }
    if c.get("per_remote_pod_rss_bytes").is_some() {
        let charged = c["per_remote_pod_cgroup_bytes"]
            .as_f64()
            .map_or("not measurable".into(), |b| format!("{b:.0} B"));
        let _ = writeln!(
            out,
            "| per remote pod: growth from {} to {} pods (one policy per 10 pods), at ready; RSS / cgroup charge | {:.0} B / {charged} | < 2 KiB |",
            c["small_cluster_pods"],
            c["pods"],
            f(c, "per_remote_pod_rss_bytes")
        );
    }
    if c.get("order_checks").is_some() {
        let _ = writeln!(
            out,
            "| order check between full passes (every 5 s, {} local pods' interfaces and the uplink; {} during the changes), mean / max | {:.2} / {:.2} ms | |",
            c["local_pods"],
            c["order_checks"],
            f(c, "order_check_mean_ms"),
            f(c, "order_check_max_ms")
        );
    }
    out.push('\n');
}
