//! Following the drop-event ring buffer (`policy-agent events`, and the
//! daemon's drop log), with pods and identities named.
use std::{fmt, os::fd::AsRawFd as _, time::Duration};

use aya::maps::{Map, MapData, RingBuf};
use policy_common::{event::DropEvent, maps as names, verdict::Reason};
use serde::Serialize;

use super::{
    error::Error,
    maps::BpfMaps,
    name_tables::{NameTables, address, endpoint_text, protocol_name},
    pins::PinLayout,
};

/// One dropped packet, named.
#[derive(Clone, Debug, Serialize)]
pub struct DropRecord {
    pub pod: String,
    pub direction: &'static str,
    pub reason: &'static str,
    pub protocol: String,
    pub src: String,
    pub dst: String,
    pub peer: String,
    pub peer_class: String,
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

pub struct DropEventReader {
    ring: RingBuf<MapData>,
    layout: PinLayout,
    names: NameTables,
}

impl DropEventReader {
    pub fn open(layout: &PinLayout) -> Result<Self, Error> {
        let path = layout.map(names::DROP_EVENTS);
        let data = MapData::from_pin(&path).map_err(Error::map(names::DROP_EVENTS))?;
        let map = Map::from_map_data(data).map_err(Error::map(names::DROP_EVENTS))?;
        let ring = RingBuf::try_from(map).map_err(Error::map(names::DROP_EVENTS))?;
        let mut this = Self {
            ring,
            layout: layout.clone(),
            names: NameTables::default(),
        };
        this.refresh_names()?;
        Ok(this)
    }

    /// Re-reads pod and identity names (they change as the agent syncs).
    pub fn refresh_names(&mut self) -> Result<(), Error> {
        let maps = BpfMaps::from_pins(&self.layout)?;
        self.names = NameTables {
            identities: maps.read_identities()?,
            endpoints: maps.read_meta()?,
            ..NameTables::default()
        };
        Ok(())
    }

    /// Waits up to `timeout` for events and returns those available.
    pub fn next_batch(&mut self, timeout: Duration) -> Vec<DropRecord> {
        let mut fds = [libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
        let mut raw = Vec::new();
        while let Some(item) = self.ring.next() {
            if item.len() >= std::mem::size_of::<DropEvent>() {
                raw.push(*bytemuck::from_bytes::<DropEvent>(
                    &item[..std::mem::size_of::<DropEvent>()],
                ));
            }
        }
        if raw
            .iter()
            .any(|e| !self.names.endpoints.contains_key(&e.ifindex))
        {
            let _ = self.refresh_names();
        }
        raw.iter().map(|e| self.record(e)).collect()
    }

    fn record(&self, e: &DropEvent) -> DropRecord {
        DropRecord {
            pod: self.names.endpoint(e.ifindex),
            direction: policy_common::direction::name(e.direction),
            reason: Reason::from_u8(e.reason)
                .map(Reason::name)
                .unwrap_or("unknown"),
            protocol: protocol_name(e.protocol),
            src: endpoint_text(address(e.family, &e.src), e.sport, e.protocol),
            dst: endpoint_text(address(e.family, &e.dst), e.dport, e.protocol),
            peer: if e.peer_identity == 0 {
                "-".into()
            } else {
                self.names.identity(e.peer_identity)
            },
            peer_class: self.names.identity(e.peer_cidr_identity),
        }
    }
}
