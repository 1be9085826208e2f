use std::path::PathBuf;

/// Errors of the BPF datapath. Each says what was being done and where.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0} is not a mounted bpf filesystem (mount -t bpf bpf /sys/fs/bpf)")]
    NoBpffs(PathBuf),
    #[error("this agent was built without the eBPF object (AYA_BUILD_SKIP); rebuild without it")]
    NoObject,
    #[error("the BPF datapath cannot run here: {0}")]
    Unsupported(String),
    #[error(
        "the verifier rejected program {program}: {summary} (full log: {}, {lines} lines)",
        log.display()
    )]
    Verifier {
        program: &'static str,
        summary: String,
        log: PathBuf,
        lines: usize,
    },
    #[error("creating pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the eBPF object (maps pinned under {pins}): {source}")]
    Load {
        pins: PathBuf,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("the object has no program {0}")]
    MissingProgram(&'static str),
    #[error("the object has no map {0}")]
    MissingMap(&'static str),
    #[error(
        "pinned map {path} has {found} but this agent expects {expected}: it was written by an \
         incompatible agent; run `policy-agent reset` (or use another --pin-dir)"
    )]
    LayoutMismatch {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error("map {name} is full ({capacity} entries); raise its capacity")]
    MapFull { name: &'static str, capacity: u32 },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: Box<aya::pin::PinError>,
    },
    #[error("attaching to {interface} ({direction}): {source}")]
    Attach {
        interface: String,
        direction: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("adding the clsact qdisc to {interface}: {source}")]
    Clsact {
        interface: String,
        #[source]
        source: Box<aya::programs::tc::TcError>,
    },
    #[error("the classifier programs are not loaded: {0}")]
    NotLoaded(String),
    #[error("interface with ifindex {0} does not exist")]
    NoInterface(u32),
    #[error(
        "ifindex {ifindex} was attached from another network namespace; run this in that namespace to remove its netlink filters"
    )]
    OtherNamespace { ifindex: u32 },
    #[error(transparent)]
    Command(#[from] crate::exec::CommandError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn map(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> Self {
        move |e| Self::Map {
            name,
            source: Box::new(e),
        }
    }

    pub(crate) fn program(name: &'static str) -> impl FnOnce(aya::programs::ProgramError) -> Self {
        move |e| match e {
            aya::programs::ProgramError::LoadError {
                verifier_log,
                io_error,
            } => super::verifier::rejected(name, &verifier_log.to_string(), &io_error),
            e => Self::Program {
                name,
                source: Box::new(e),
            },
        }
    }

    /// The map a write failed on (for metrics), or "other".
    pub fn map_name(&self) -> &'static str {
        match self {
            Self::Map { name, .. } | Self::MapFull { name, .. } => name,
            _ => "other",
        }
    }

    /// A short label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::NoBpffs(_) | Self::NoObject | Self::PinDir { .. } | Self::Unsupported(_) => {
                "setup"
            }
            Self::Verifier { .. } => "verifier",
            Self::Load { .. }
            | Self::MissingProgram(_)
            | Self::MissingMap(_)
            | Self::NotLoaded(_) => "load",
            Self::LayoutMismatch { .. } => "layout",
            Self::Program { .. } => "program",
            Self::Map { .. } => "map",
            Self::MapFull { .. } => "map_full",
            Self::Pin { .. } => "pin",
            Self::Attach { .. }
            | Self::Clsact { .. }
            | Self::NoInterface(_)
            | Self::OtherNamespace { .. } => "attach",
            Self::Io { .. } | Self::Command(_) => "io",
        }
    }
}
