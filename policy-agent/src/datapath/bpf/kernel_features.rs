//! What the running kernel must offer the classifier, probed before the
//! object is loaded. A missing requirement is refused with one line naming
//! it and the first Linux version that has it (`--datapath auto` then falls
//! back to iptables); a missing option (TCX) picks the fallback it has.
use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
    util::KernelVersion,
};

/// One kernel feature the datapath uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Feature {
    pub name: &'static str,
    /// The first Linux version that has it.
    pub since: &'static str,
    /// Without it the agent falls back (instead of refusing BPF).
    pub fallback: Option<&'static str>,
    pub present: bool,
}

/// What the running kernel offers, as the agent uses it.
#[derive(Clone, Debug)]
pub struct KernelFeatures {
    pub release: String,
    pub features: Vec<Feature>,
}

enum Check {
    Program(ProgramType),
    Map(MapType),
    Helper(BpfHelper),
    KernelAtLeast(u8, u8),
}

/// Every feature, with how to probe it. The order is the README's table.
const FEATURES: &[(&str, &str, Option<&str>, Check)] = &[
    (
        "tc classifier programs (sched_cls)",
        "4.1",
        None,
        Check::Program(ProgramType::SchedClassifier),
    ),
    ("hash maps", "3.19", None, Check::Map(MapType::Hash)),
    ("array maps", "3.19", None, Check::Map(MapType::Array)),
    (
        "per-CPU array maps",
        "4.6",
        None,
        Check::Map(MapType::PerCpuArray),
    ),
    ("LRU hash maps", "4.10", None, Check::Map(MapType::LruHash)),
    ("LPM trie maps", "4.11", None, Check::Map(MapType::LpmTrie)),
    (
        "BPF ring buffers",
        "5.8",
        None,
        Check::Map(MapType::RingBuf),
    ),
    (
        "bpf_ringbuf_reserve/submit from tc",
        "5.8",
        None,
        Check::Helper(BpfHelper::BPF_FUNC_ringbuf_reserve),
    ),
    (
        "bpf_ktime_get_coarse_ns from tc",
        "5.11",
        None,
        Check::Helper(BpfHelper::BPF_FUNC_ktime_get_coarse_ns),
    ),
    (
        "bpf_jiffies64 from tc",
        "5.5",
        None,
        Check::Helper(BpfHelper::BPF_FUNC_jiffies64),
    ),
    (
        "bpf_skb_pull_data from tc",
        "4.9",
        None,
        Check::Helper(BpfHelper::BPF_FUNC_skb_pull_data),
    ),
    (
        "TCX links (bpf_link attachment to tc)",
        "6.6",
        Some("netlink clsact filters"),
        Check::KernelAtLeast(6, 6),
    ),
];

fn present(check: &Check, version: Option<KernelVersion>) -> bool {
    match check {
        Check::Program(t) => is_program_supported(*t).unwrap_or(false),
        Check::Map(t) => is_map_supported(*t).unwrap_or(false),
        Check::Helper(h) => is_helper_supported(ProgramType::SchedClassifier, *h).unwrap_or(false),
        Check::KernelAtLeast(major, minor) => {
            version.is_some_and(|v| v >= KernelVersion::new(*major, *minor, 0))
        }
    }
}

/// The running kernel's features, probed once per process.
pub fn kernel() -> &'static KernelFeatures {
    static PROBED: std::sync::OnceLock<KernelFeatures> = std::sync::OnceLock::new();
    PROBED.get_or_init(probe)
}

/// Probes the running kernel (a few throwaway maps and programs).
pub fn probe() -> KernelFeatures {
    let version = KernelVersion::current().ok();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let features = FEATURES
        .iter()
        .map(|(name, since, fallback, check)| Feature {
            name,
            since,
            fallback: *fallback,
            present: present(check, version),
        })
        .collect();
    KernelFeatures { release, features }
}

impl KernelFeatures {
    /// The features the agent cannot do without and this kernel lacks.
    pub fn missing(&self) -> Vec<&Feature> {
        self.features
            .iter()
            .filter(|f| !f.present && f.fallback.is_none())
            .collect()
    }

    /// One line naming what is missing and which Linux has it.
    pub fn missing_line(&self) -> Option<String> {
        let missing = self.missing();
        if missing.is_empty() {
            return None;
        }
        let names: Vec<String> = missing
            .iter()
            .map(|f| format!("{} (Linux {})", f.name, f.since))
            .collect();
        Some(format!(
            "kernel {} lacks {}",
            self.release,
            names.join(", ")
        ))
    }

    /// Whether a feature of this name is present.
    pub fn has(&self, name: &str) -> bool {
        self.features.iter().any(|f| f.name == name && f.present)
    }

    /// Whether TCX links can be used.
    pub fn tcx(&self) -> bool {
        self.features
            .iter()
            .any(|f| f.fallback.is_some() && f.name.starts_with("TCX") && f.present)
    }

    /// The optional features absent here, with the fallback used instead.
    pub fn fallbacks(&self) -> Vec<String> {
        self.features
            .iter()
            .filter(|f| !f.present)
            .filter_map(|f| {
                f.fallback
                    .map(|fb| format!("{} (Linux {}) absent: {fb}", f.name, f.since))
            })
            .collect()
    }
}
