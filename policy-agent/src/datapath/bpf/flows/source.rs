//! Where a reader (`policy-agent flows`, `events`) gets named flows: the
//! daemon's socket when a daemon serves these pins, else the ring itself
//! (no daemon: the one-shot `apply` case; reading it beside a daemon
//! would take records from it), or on the iptables fallback the NFLOG
//! group its names file gives.
use std::{
    collections::VecDeque,
    io::{BufRead as _, BufReader},
    os::unix::net::UnixStream,
    time::Duration,
};

use super::{
    Error,
    clock::WallClock,
    naming::{FlowNamer, NameSource, PinnedNames},
    pipeline::RecordSource,
    record::FlowEvent,
    socket,
    staged_report::StagedReport,
};
use crate::datapath::{
    bpf::{events::FlowRing, pins::PinLayout},
    iptables::{
        DEFAULT_GROUP,
        flow_log::{FileNames, IptablesFlowReader, names_path, read_names},
    },
};

pub enum FlowSource {
    Daemon {
        reader: BufReader<UnixStream>,
        layout: PinLayout,
    },
    Ring {
        ring: Box<FlowRing>,
        namer: Box<FlowNamer<PinnedNames>>,
        pending: VecDeque<FlowEvent>,
    },
    Nflog {
        reader: Box<IptablesFlowReader>,
        namer: Box<FlowNamer<FileNames>>,
        pending: VecDeque<FlowEvent>,
    },
}

impl FlowSource {
    pub fn open(layout: &PinLayout) -> Result<Self, Error> {
        if let Some(stream) = socket::connect(layout, socket::SUBSCRIBE)? {
            return Ok(Self::Daemon {
                reader: BufReader::new(stream),
                layout: layout.clone(),
            });
        }
        let ring = match FlowRing::open(layout) {
            Ok(ring) => ring,
            Err(e) => {
                // No pinned ring: the iptables fallback, if it left its
                // names for these pins.
                let path = names_path(layout.root());
                let Ok(names) = read_names(&path) else {
                    return Err(e.into());
                };
                let group = names.group.unwrap_or(DEFAULT_GROUP);
                return Ok(Self::Nflog {
                    reader: Box::new(IptablesFlowReader::open(group)?),
                    namer: Box::new(FlowNamer::new(FileNames::new(&path), WallClock::now())),
                    pending: VecDeque::new(),
                });
            }
        };
        Ok(Self::Ring {
            ring: Box::new(ring),
            namer: Box::new(FlowNamer::new(PinnedNames::new(layout), WallClock::now())),
            pending: VecDeque::new(),
        })
    }

    /// Whether flows come from a daemon.
    pub fn from_daemon(&self) -> bool {
        matches!(self, Self::Daemon { .. })
    }

    /// The next flow (waits for it).
    pub fn next_flow(&mut self) -> Result<FlowEvent, Error> {
        match self {
            Self::Daemon { reader, layout } => {
                let mut line = String::new();
                if reader
                    .read_line(&mut line)
                    .map_err(|source| Error::Socket {
                        name: socket::socket_name(layout),
                        source,
                    })?
                    == 0
                {
                    return Err(Error::Closed(layout.root().to_path_buf()));
                }
                if let Ok(serde_json::Value::Object(o)) = serde_json::from_str(&line)
                    && let Some(e) = o.get("error")
                {
                    return Err(Error::Refused(e.to_string()));
                }
                Ok(serde_json::from_str(&line)?)
            }
            Self::Ring {
                ring,
                namer,
                pending,
            } => Ok(next_named(ring.as_mut(), namer, pending)),
            Self::Nflog {
                reader,
                namer,
                pending,
            } => Ok(next_named(reader.as_mut(), namer, pending)),
        }
    }
}

/// The staged report of the daemon serving `layout`'s pins (None: no
/// daemon serves them; the report is the daemon's: it judges the records).
pub fn staged_report(layout: &PinLayout) -> Result<Option<StagedReport>, Error> {
    let Some(stream) = socket::connect(layout, socket::STAGED_REPORT)? else {
        return Ok(None);
    };
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(|source| Error::Socket {
            name: socket::socket_name(layout),
            source,
        })?;
    if line.is_empty() {
        return Err(Error::Closed(layout.root().to_path_buf()));
    }
    if let Ok(serde_json::Value::Object(o)) = serde_json::from_str(&line)
        && let Some(e) = o.get("error")
    {
        return Err(Error::Refused(e.to_string()));
    }
    Ok(Some(serde_json::from_str(&line)?))
}

/// The next record of `records`, named (waits for it).
fn next_named<S: NameSource>(
    records: &mut impl RecordSource,
    namer: &mut FlowNamer<S>,
    pending: &mut VecDeque<FlowEvent>,
) -> FlowEvent {
    loop {
        if let Some(e) = pending.pop_front() {
            return e;
        }
        namer.tick();
        for r in records.next_batch(Duration::from_millis(500)) {
            pending.push_back(namer.name(&r));
        }
    }
}
