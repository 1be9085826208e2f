//! The object loaded without pins, for packet tests and benchmarks: its
//! maps are private to the load and go with it.
use aya::programs::SchedClassifier;

use super::{
    error::Error,
    loader::{classifier, loader},
    maps::BpfMaps,
    object::OBJECT,
    pins::Hook,
    program_load::load_classifier,
};

/// The object loaded without pins, for packet tests and benchmarks.
pub struct Unpinned {
    pub ebpf: aya::Ebpf,
    pub maps: BpfMaps,
    /// The kernel ids of every map the load created (tests empty them to
    /// reuse a loaded classifier); `None` if one is of a kind whose handle
    /// this does not know.
    pub map_ids: Option<Vec<u32>>,
}

/// The kernel id of a map of the kinds the object uses.
fn map_id(map: &aya::maps::Map) -> Option<u32> {
    use aya::maps::Map;
    let data = match map {
        Map::Array(d)
        | Map::PerCpuArray(d)
        | Map::HashMap(d)
        | Map::PerCpuHashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::LpmTrie(d)
        | Map::RingBuf(d)
        | Map::PerfEventArray(d) => d,
        _ => return None,
    };
    data.info().ok().map(|i| i.id())
}

impl Unpinned {
    /// Loads the programs with fresh, private maps.
    pub fn load() -> Result<Self, Error> {
        Self::load_with(&[])
    }

    /// As [`Unpinned::load`], with map capacity overrides.
    pub fn load_with(capacities: &[(&str, u32)]) -> Result<Self, Error> {
        Self::load_object(OBJECT, capacities)
    }

    /// As [`Unpinned::load_with`], from another build of the object (a
    /// benchmark compares two builds in one run).
    pub fn load_object(object: &[u8], capacities: &[(&str, u32)]) -> Result<Self, Error> {
        if object.is_empty() {
            return Err(Error::NoObject);
        }
        let mut ebpf = loader(capacities, &[])
            .load(object)
            .map_err(|e| Error::Load {
                pins: Default::default(),
                source: Box::new(e),
            })?;
        let map_ids = ebpf.maps().map(|(_, m)| map_id(m)).collect();
        let maps = BpfMaps::from_ebpf(&mut ebpf, None)?;
        let mut this = Self {
            ebpf,
            maps,
            map_ids,
        };
        for hook in Hook::ALL {
            let name = hook.program();
            load_classifier(this.program(hook)?, name)?;
        }
        Ok(this)
    }

    /// Another classifier of the object by name (the benchmark floors),
    /// loaded on first use.
    pub fn extra_program(&mut self, name: &'static str) -> Result<&mut SchedClassifier, Error> {
        let prog = classifier(&mut self.ebpf, name)?;
        if prog.fd().is_err() {
            load_classifier(prog, name)?;
        }
        Ok(prog)
    }

    pub fn program(&mut self, hook: Hook) -> Result<&mut SchedClassifier, Error> {
        classifier(&mut self.ebpf, hook.program())
    }
}
