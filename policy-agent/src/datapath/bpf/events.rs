//! The flow-record ring (`DROP_EVENTS`), read raw, and the drop line
//! `policy-agent events` prints.
use std::{fmt, os::fd::AsRawFd as _, time::Duration};

use aya::maps::{Map, MapData, RingBuf};
use policy_common::{event::FlowRecord, maps as names};
use serde::Serialize;

use super::{
    error::Error,
    flows::record::{FlowEvent, Verdict},
    pins::PinLayout,
};

/// One dropped packet, named (what `events` prints).
#[derive(Clone, Debug, Serialize)]
pub struct DropRecord {
    pub pod: String,
    pub direction: String,
    pub reason: String,
    pub protocol: String,
    pub src: String,
    pub dst: String,
    pub peer: String,
    pub peer_class: String,
}

impl DropRecord {
    /// The drop line of a named flow (None: it was allowed).
    pub fn of(event: &FlowEvent) -> Option<Self> {
        let f = &event.flow;
        if f.verdict != Verdict::Drop {
            return None;
        }
        let protocol = match f.protocol.parse::<u8>() {
            Ok(n) => format!("proto {n}"),
            Err(_) => f.protocol.clone(),
        };
        Some(Self {
            pod: f.pod.clone(),
            direction: f.direction.clone(),
            reason: f.reason.clone(),
            protocol,
            src: event.src.clone(),
            dst: event.dst.clone(),
            peer: f.peer_identity.clone().unwrap_or_else(|| "-".into()),
            peer_class: event.peer_class.clone(),
        })
    }
}

impl fmt::Display for DropRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DROP {} {} {} {} -> {} ({}) peer [{}] class [{}]",
            self.pod,
            self.direction,
            self.protocol,
            self.src,
            self.dst,
            self.reason,
            self.peer,
            self.peer_class
        )
    }
}

/// The ring's consumer. A ring has one consumer position: open it in
/// one process only (the daemon, or `flows` when no daemon runs).
pub struct FlowRing {
    ring: RingBuf<MapData>,
    short: u64,
}

impl FlowRing {
    pub fn open(layout: &PinLayout) -> Result<Self, Error> {
        let path = layout.map(names::DROP_EVENTS);
        let data = MapData::from_pin(&path).map_err(Error::map(names::DROP_EVENTS))?;
        let map = Map::from_map_data(data).map_err(Error::map(names::DROP_EVENTS))?;
        let ring = RingBuf::try_from(map).map_err(Error::map(names::DROP_EVENTS))?;
        Ok(Self { ring, short: 0 })
    }

    /// Records too short to be a [`FlowRecord`] skipped so far (a kernel
    /// side of another layout).
    pub fn short_records(&self) -> u64 {
        self.short
    }

    /// Waits up to `timeout` for records and returns those available.
    pub fn next_batch(&mut self, timeout: Duration) -> Vec<FlowRecord> {
        let mut fds = [libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
        let mut out = Vec::new();
        while let Some(item) = self.ring.next() {
            match decode(&item) {
                Some(r) => out.push(r),
                None => self.short += 1,
            }
        }
        out
    }
}

/// A record from ring bytes (None: shorter than a [`FlowRecord`]; a
/// longer one is read up to its size).
pub fn decode(bytes: &[u8]) -> Option<FlowRecord> {
    let size = std::mem::size_of::<FlowRecord>();
    let head = bytes.get(..size)?;
    Some(bytemuck::pod_read_unaligned(head))
}
