//! The per-CPU record budget (`FLOW_BUDGET`), written when the agent
//! opens the datapath: a flood of new flows or drops costs the ring and
//! the reader at most this much.
use aya::maps::{Map, MapData, PerCpuArray, PerCpuValues};
use policy_common::{event::FlowBudget, maps as names};

use crate::datapath::bpf::{error::Error, map_layout::field, pins::PinLayout};

/// Records each CPU may emit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowRate {
    /// A second, on each CPU (0: no limit).
    pub per_second: u64,
    /// At once, after a quiet time.
    pub burst: u64,
}

impl FlowRate {
    /// The command line's default.
    pub const DEFAULT: Self = Self {
        per_second: 1000,
        burst: 200,
    };
}

/// Writes `rate` into every CPU's slot of the pinned `FLOW_BUDGET` (the
/// load that precedes it creates the map in pins that lack it).
pub fn write(layout: &PinLayout, rate: FlowRate) -> Result<(), Error> {
    let mut source = |name: &'static str| {
        let data = MapData::from_pin(layout.map(name)).map_err(Error::map(name))?;
        Map::from_map_data(data).map_err(Error::map(name))
    };
    let mut map: PerCpuArray<MapData, FlowBudget> =
        field(names::FLOW_BUDGET, Some(layout), &mut source)?;
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| Error::map(names::FLOW_BUDGET)(e.into()))?;
    let budget = FlowBudget::new(rate.per_second, rate.burst);
    let values = PerCpuValues::try_from(vec![budget; cpus])
        .map_err(|e| Error::map(names::FLOW_BUDGET)(e.into()))?;
    map.set(0, values, 0)
        .map_err(Error::map(names::FLOW_BUDGET))
}
