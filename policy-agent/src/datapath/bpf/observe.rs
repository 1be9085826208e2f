//! What observes the BPF datapath while the agent runs: the flow thread
//! (the ring's one reader, see `flows::pipeline`), the classifier's debug
//! log, and the kernel-side figures for `/metrics`.
use std::fmt::Write as _;

use policy_common::verdict::Reason;
use tracing::warn;

use super::{
    events::FlowRing,
    flows::{naming::PinnedNames, pipeline::FlowObserver, stats::FlowStats},
    kernel_log::follow_kernel_log as follow,
    maps::BpfMaps,
    pins::PinLayout,
};

/// Starts the flow thread on the pinned ring unless it runs; false while
/// the ring cannot be opened (tried again after the next sync).
pub(super) fn start_flows(observer: &mut FlowObserver, layout: &PinLayout) -> bool {
    observer.start(layout, || {
        let ring = FlowRing::open(layout).map_err(|e| e.to_string())?;
        Ok((ring, PinnedNames::new(layout)))
    })
}

/// Forwards the classifier's debug log (emitted only while switched on),
/// read through the program `id` (the one the driver holds).
pub(super) fn follow_kernel_log(id: Option<u32>) {
    if let Some(id) = id
        && let Err(e) = follow(id)
    {
        warn!(error = %e, "kernel debug log unavailable");
    }
}

/// Appends the kernel's verdict counters and map fill, read from the pins
/// now (nothing while nothing is pinned), and the flows' figures.
pub(super) fn render_metrics(out: &mut String, layout: &PinLayout, flows: Option<&FlowStats>) {
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
        if let Some(flows) = flows {
            let sum = |wanted: Reason| -> u64 {
                counters
                    .iter()
                    .filter(|((r, _), _)| *r == wanted)
                    .map(|(_, n)| *n)
                    .sum()
            };
            flows.render(out, sum(Reason::RecordLimited), sum(Reason::EventLost));
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
