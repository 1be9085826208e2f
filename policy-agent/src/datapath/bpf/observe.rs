//! What observes the BPF datapath while the agent runs: the drop log
//! (drop events with pod names, rate-limited), the classifier's debug log,
//! and the kernel-side figures for `/metrics`.
use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use tracing::{info, warn};

use super::{
    events::DropEventReader,
    kernel_log::follow_kernel_log as follow,
    loader::Classifiers,
    maps::BpfMaps,
    pins::{Hook, PinLayout},
};

/// Forwards the classifier's debug log (emitted only while switched on).
pub(super) fn follow_kernel_log(layout: &PinLayout) {
    let id = Classifiers::open_pinned(layout)
        .ok()
        .and_then(|p| p.id(Hook::Ingress));
    if let Some(id) = id
        && let Err(e) = follow(id)
    {
        warn!(error = %e, "kernel debug log unavailable");
    }
}

/// Logs drop events with pod names, from a thread of its own, at most
/// `DROP_LOG_PER_SECOND` lines a second (the rest are counted, and the
/// kernel counters have them all). False when the ring cannot be opened.
pub(super) fn spawn_drop_log(layout: &PinLayout) -> bool {
    const DROP_LOG_PER_SECOND: usize = 20;
    let reader = match DropEventReader::open(layout) {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "drop events unavailable");
            return false;
        }
    };
    std::thread::Builder::new()
        .name("drop-events".into())
        .spawn(move || {
            let mut reader = reader;
            let mut window = Instant::now();
            let (mut logged, mut suppressed) = (0usize, 0usize);
            loop {
                for record in reader.next_batch(Duration::from_secs(1)) {
                    if window.elapsed() >= Duration::from_secs(1) {
                        if suppressed > 0 {
                            info!(target: "drops", suppressed, "more drops not logged");
                        }
                        window = Instant::now();
                        logged = 0;
                        suppressed = 0;
                    }
                    if logged < DROP_LOG_PER_SECOND {
                        info!(target: "drops", "{record}");
                        logged += 1;
                    } else {
                        suppressed += 1;
                    }
                }
            }
        })
        .is_ok()
}

/// Appends the kernel's verdict counters and map fill, read from the pins
/// now (nothing while nothing is pinned).
pub(super) fn render_metrics(out: &mut String, layout: &PinLayout) {
    let Ok(maps) = BpfMaps::from_pins(layout) else {
        return;
    };
    if let Ok(counters) = maps.counters() {
        let _ = writeln!(
            out,
            "# HELP policy_agent_packets_total Packets judged by the classifier, by verdict reason and pod direction.\n# TYPE policy_agent_packets_total counter"
        );
        for ((reason, dir), n) in &counters {
            let d = policy_common::direction::name(*dir);
            let _ = writeln!(
                out,
                "policy_agent_packets_total{{reason=\"{}\",direction=\"{d}\"}} {n}",
                reason.name()
            );
        }
        let _ = writeln!(
            out,
            "# HELP policy_agent_drops_total Packets dropped, by reason.\n# TYPE policy_agent_drops_total counter"
        );
        let mut drops: std::collections::BTreeMap<&str, u64> = Default::default();
        for ((reason, _), n) in &counters {
            if reason.is_drop() {
                *drops.entry(reason.name()).or_default() += n;
            }
        }
        for (r, n) in drops {
            let _ = writeln!(out, "policy_agent_drops_total{{reason=\"{r}\"}} {n}");
        }
    }
    if let Ok(share) = maps.ct_share.get(&0, 0) {
        let _ = writeln!(
            out,
            "# HELP policy_agent_conntrack_share The most conntrack entries one pod may hold (0: no bound).\n# TYPE policy_agent_conntrack_share gauge\npolicy_agent_conntrack_share {}",
            share.share
        );
    }
    let _ = writeln!(
        out,
        "# HELP policy_agent_map_entries Entries in each datapath map.\n# TYPE policy_agent_map_entries gauge"
    );
    let fill = maps.fill();
    for (name, n, _) in &fill {
        let _ = writeln!(out, "policy_agent_map_entries{{map=\"{name}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP policy_agent_map_capacity Capacity of each datapath map.\n# TYPE policy_agent_map_capacity gauge"
    );
    for (name, _, cap) in &fill {
        let _ = writeln!(out, "policy_agent_map_capacity{{map=\"{name}\"}} {cap}");
    }
}
