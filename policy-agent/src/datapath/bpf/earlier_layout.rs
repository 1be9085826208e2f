//! An upgrade across layout versions (`<root>/v<N>` beside this agent's
//! `<root>/v<LAYOUT_VERSION>`): the earlier agent's pins keep enforcing
//! until this agent's programs are on every interface, its tracked flows
//! are carried over so established connections survive the upgrade, and
//! its pins are removed after this agent's first full pass (which unpins
//! its TCX links, detaching them; its netlink filters were replaced in
//! place, at the same slot).
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, IterableMap, Map, MapData};
use policy_common::{
    LAYOUT_VERSION,
    conntrack::{CT_OPENER_EITHER, CtEntry, CtKey},
    direction, maps as names, proto,
};
use tracing::{info, warn};

use super::{error::Error, maps::BpfMaps, pins::PinLayout};

/// The version whose conntrack key this agent can read: one flow per
/// direction it was opened, keyed as its first packet travelled.
const DIRECTIONAL_CT: u32 = 3;

/// `CONNTRACK`'s key in layout 3.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
struct DirectionalCtKey {
    ifindex: u32,
    src: [u8; 16],
    dst: [u8; 16],
    sport: u16,
    dport: u16,
    protocol: u8,
    family: u8,
    direction: u8,
    _pad: u8,
}

// SAFETY: plain old data, every bit pattern valid (the kernel's key bytes).
unsafe impl aya::Pod for DirectionalCtKey {}

const _: () = assert!(size_of::<DirectionalCtKey>() == size_of::<CtKey>());

/// The earlier layouts pinned under the same root, oldest first.
pub fn earlier(layout: &PinLayout) -> Vec<(u32, PathBuf)> {
    let Ok(dir) = std::fs::read_dir(layout.root()) else {
        return Vec::new();
    };
    let mut out: Vec<(u32, PathBuf)> = dir
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let version: u32 = name.to_str()?.strip_prefix('v')?.parse().ok()?;
            (version < LAYOUT_VERSION).then(|| (version, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// The flow key of layout 3 in this layout's form (see `CtKey`).
fn convert(old: &DirectionalCtKey) -> CtKey {
    let (local, remote, local_port, remote_port) = if old.direction == direction::EGRESS {
        (old.src, old.dst, old.sport, old.dport)
    } else {
        (old.dst, old.src, old.dport, old.sport)
    };
    let echo = matches!(old.protocol, proto::ICMP | proto::ICMPV6);
    CtKey {
        ifindex: old.ifindex,
        local,
        remote,
        local_port,
        remote_port,
        protocol: old.protocol,
        family: old.family,
        opener: if echo {
            old.direction
        } else {
            CT_OPENER_EITHER
        },
        _pad: 0,
    }
}

/// Copies the tracked flows of layout 3 under `dir` into this layout's
/// `CONNTRACK` (new entries only: what this layout holds is newer), each
/// at revision 0, which no endpoint has: its first packet judges it again
/// under this agent's policy (the earlier agent's revisions are not this
/// one's). Returns how many were carried.
pub fn carry_conntrack(dir: &Path, maps: &mut BpfMaps) -> Result<usize, Error> {
    let path = dir.join("maps").join(names::CONNTRACK);
    let data = MapData::from_pin(&path).map_err(Error::map(names::CONNTRACK))?;
    let map = Map::from_map_data(data).map_err(Error::map(names::CONNTRACK))?;
    let old: HashMap<MapData, DirectionalCtKey, CtEntry> =
        HashMap::try_from(map).map_err(Error::map(names::CONNTRACK))?;
    let mut carried = 0;
    // Bounded: a walk restarts where the kernel deleted its entry.
    let capacity = old.map().info().map(|i| i.max_entries()).unwrap_or(0) as usize;
    for (key, entry) in old.iter().take(capacity.saturating_mul(2)).flatten() {
        let new = convert(&key);
        if maps.conntrack.get(&new, 0).is_ok() {
            continue;
        }
        // BPF_NOEXIST: the classifier may have opened it meanwhile.
        let entry = CtEntry {
            revision: 0,
            ..entry
        };
        if maps.conntrack.insert(new, entry, 1).is_ok() {
            carried += 1;
        }
    }
    Ok(carried)
}

/// At open, before the first sync: carries the tracked flows of the
/// layout just before this one, if it is pinned here and readable.
pub fn carry_over(layout: &PinLayout, maps: &mut BpfMaps) {
    let Some((version, dir)) = earlier(layout).pop() else {
        return;
    };
    if version != DIRECTIONAL_CT {
        warn!(pins = %dir.display(), version, "pins of an earlier layout whose flows this agent cannot read: its established flows are judged again as new");
        return;
    }
    match carry_conntrack(&dir, maps) {
        Ok(n) => {
            info!(pins = %dir.display(), flows = n, "carried the tracked flows of the earlier layout over")
        }
        Err(e) => {
            warn!(pins = %dir.display(), error = %e, "cannot read the tracked flows of the earlier layout: its established flows are judged again as new")
        }
    }
}

/// After a full pass put this agent's programs on every interface: the
/// earlier layouts' pins go (their TCX links detach as their pins do).
/// False when some could not be removed (tried again after the next full
/// pass).
pub fn retire(layout: &PinLayout) -> bool {
    let mut done = true;
    for (version, dir) in earlier(layout) {
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                info!(pins = %dir.display(), version, "removed the pins of an earlier layout")
            }
            Err(e) => {
                warn!(pins = %dir.display(), error = %e, "cannot remove the pins of an earlier layout; its programs may still run on interfaces where its TCX links are");
                done = false;
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    fn old(direction: u8, protocol: u8) -> DirectionalCtKey {
        DirectionalCtKey {
            ifindex: 7,
            src: [1; 16],
            dst: [2; 16],
            sport: 1000,
            dport: 80,
            protocol,
            family: policy_common::family::IPV6,
            direction,
            _pad: 0,
        }
    }

    #[test]
    fn a_flow_keeps_its_pod_side_local_whichever_way_it_was_opened() {
        let out = convert(&old(direction::EGRESS, proto::TCP));
        assert_eq!((out.local, out.local_port), ([1; 16], 1000));
        assert_eq!((out.remote, out.remote_port), ([2; 16], 80));
        assert_eq!(out.opener, CT_OPENER_EITHER);
        let inn = convert(&old(direction::INGRESS, proto::UDP));
        assert_eq!((inn.local, inn.local_port), ([2; 16], 80));
        assert_eq!((inn.remote, inn.remote_port), ([1; 16], 1000));
        assert_eq!(inn.opener, CT_OPENER_EITHER);
    }

    #[test]
    fn an_echo_keeps_the_way_its_request_went() {
        assert_eq!(
            convert(&old(direction::INGRESS, proto::ICMP)).opener,
            direction::INGRESS
        );
        assert_eq!(
            convert(&old(direction::EGRESS, proto::ICMPV6)).opener,
            direction::EGRESS
        );
    }

    #[test]
    fn only_lower_versions_are_earlier() {
        let root = std::env::temp_dir().join(format!("pa-earlier-{}", std::process::id()));
        for v in ["v1", "v3", &format!("v{LAYOUT_VERSION}"), "v99", "other"] {
            std::fs::create_dir_all(root.join(v)).unwrap();
        }
        let found: Vec<u32> = earlier(&PinLayout::new(&root))
            .into_iter()
            .map(|(v, _)| v)
            .collect();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(found, vec![1, 3]);
    }
}
