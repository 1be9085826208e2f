//! Every map of a loaded classifier put back as it was right after the
//! load, so the next test of the process can reuse the classifier: the
//! verifier, not the test, is what a load costs (seconds per program on an
//! emulated machine). Keyed maps (hash, LRU, LPM) are emptied and refilled
//! with what they held; arrays are rewritten where they differ; ring
//! buffers are drained.
use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
};

use aya::maps::{Map, MapData, MapType, RingBuf};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

/// One map-element bpf(2) call: `{ u32 map_fd; u64 key; u64 value or
/// next_key; u64 flags }`.
fn elem(cmd: libc::c_long, fd: BorrowedFd<'_>, key: *const u8, value: *mut u8) -> io::Result<()> {
    let mut attr = [0u64; 8];
    attr[0] = u64::from(fd.as_raw_fd() as u32);
    attr[1] = key as u64;
    attr[2] = value as u64;
    // SAFETY: attr is a zeroed union bpf_attr; key and value point to
    // buffers of the map's key and value sizes (or are null where allowed).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr) as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn not_found(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOENT)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Keyed,
    Indexed,
    Ring,
}

struct Saved {
    map: MapData,
    kind: Kind,
    key_size: usize,
    value_size: usize,
    /// Keyed: what it held; indexed: every slot.
    entries: Vec<(Vec<u8>, Vec<u8>)>,
}

/// The maps of one load as they were when taken.
pub struct Snapshot {
    maps: Vec<Saved>,
}

impl Snapshot {
    /// Reads every map in `ids`; `None` if one is of a kind this cannot
    /// put back (the classifier is then not reused).
    pub fn take(ids: &[u32]) -> io::Result<Option<Self>> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        let mut maps = Vec::new();
        for id in ids {
            let map = MapData::from_id(*id).map_err(io::Error::other)?;
            let info = map.info().map_err(io::Error::other)?;
            let map_type = info.map_type().map_err(io::Error::other)?;
            let per_cpu = |size: u32| (size as usize).next_multiple_of(8) * cpus;
            let (kind, value_size) = match map_type {
                MapType::Hash | MapType::LruHash | MapType::LpmTrie => {
                    (Kind::Keyed, info.value_size() as usize)
                }
                MapType::PerCpuHash | MapType::LruPerCpuHash => {
                    (Kind::Keyed, per_cpu(info.value_size()))
                }
                MapType::Array => (Kind::Indexed, info.value_size() as usize),
                MapType::PerCpuArray => (Kind::Indexed, per_cpu(info.value_size())),
                MapType::RingBuf => (Kind::Ring, 0),
                _ => return Ok(None),
            };
            let mut saved = Saved {
                map,
                kind,
                key_size: info.key_size() as usize,
                value_size,
                entries: Vec::new(),
            };
            saved.entries = match kind {
                Kind::Keyed => saved.keyed()?,
                Kind::Indexed => (0..info.max_entries())
                    .map(|i| {
                        let key = i.to_ne_bytes().to_vec();
                        let value = saved.lookup(&key)?.unwrap_or_default();
                        Ok((key, value))
                    })
                    .collect::<io::Result<_>>()?,
                Kind::Ring => Vec::new(),
            };
            maps.push(saved);
        }
        Ok(Some(Self { maps }))
    }

    /// Puts every map back as it was when taken.
    pub fn restore(&self) -> io::Result<()> {
        for m in &self.maps {
            match m.kind {
                Kind::Keyed => {
                    // Deleting the first key until there is none: an
                    // iteration would skip keys as they go.
                    while let Some(key) = m.next_key(None)? {
                        m.delete(&key)?;
                    }
                    for (k, v) in &m.entries {
                        m.update(k, v)?;
                    }
                }
                Kind::Indexed => {
                    for (k, v) in &m.entries {
                        if m.lookup(k)?.as_deref() != Some(v.as_slice()) {
                            m.update(k, v)?;
                        }
                    }
                }
                Kind::Ring => {
                    let map = Map::from_map_data(
                        MapData::from_id(m.map.info().map_err(io::Error::other)?.id())
                            .map_err(io::Error::other)?,
                    )
                    .map_err(io::Error::other)?;
                    let mut ring = RingBuf::try_from(map).map_err(io::Error::other)?;
                    while ring.next().is_some() {}
                }
            }
        }
        Ok(())
    }
}

impl Saved {
    fn fd(&self) -> BorrowedFd<'_> {
        self.map.fd().as_fd()
    }

    fn lookup(&self, key: &[u8]) -> io::Result<Option<Vec<u8>>> {
        let mut value = vec![0u8; self.value_size];
        match elem(
            BPF_MAP_LOOKUP_ELEM,
            self.fd(),
            key.as_ptr(),
            value.as_mut_ptr(),
        ) {
            Ok(()) => Ok(Some(value)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn update(&self, key: &[u8], value: &[u8]) -> io::Result<()> {
        // BPF_ANY (flags 0): the kernel only reads the value.
        elem(
            BPF_MAP_UPDATE_ELEM,
            self.fd(),
            key.as_ptr(),
            value.as_ptr().cast_mut(),
        )
    }

    fn delete(&self, key: &[u8]) -> io::Result<()> {
        match elem(
            BPF_MAP_DELETE_ELEM,
            self.fd(),
            key.as_ptr(),
            std::ptr::null_mut(),
        ) {
            Err(e) if not_found(&e) => Ok(()),
            other => other,
        }
    }

    /// The key after `key` (the first with `None`).
    fn next_key(&self, key: Option<&[u8]>) -> io::Result<Option<Vec<u8>>> {
        let mut next = vec![0u8; self.key_size];
        let key = key.map_or(std::ptr::null(), <[u8]>::as_ptr);
        match elem(BPF_MAP_GET_NEXT_KEY, self.fd(), key, next.as_mut_ptr()) {
            Ok(()) => Ok(Some(next)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every entry of a keyed map.
    fn keyed(&self) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        let mut key = None;
        while let Some(k) = self.next_key(key.as_deref())? {
            if let Some(v) = self.lookup(&k)? {
                out.push((k.clone(), v));
            }
            key = Some(k);
        }
        Ok(out)
    }
}
