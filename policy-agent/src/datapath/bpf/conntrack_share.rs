//! Keeps each interface's share of `CONNTRACK` bound (the rule is in
//! `policy_common::conntrack_share`): counts what the map holds for each
//! interface, deletes what has expired, and writes how much of what each
//! interface opened is gone, so the classifier's estimate is the truth
//! again.
//!
//! Deleting expired entries matters as much as the count: an LRU map
//! evicts the least recently used entry, and a flooding pod's expired
//! entries are younger than another pod's idle connection. Swept, the map
//! holds live flows only, and no pod's flows are evicted while the live
//! ones fit.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap},
    time::{Duration, Instant},
};

use aya::maps::IterableMap as _;
use policy_common::{
    conntrack::{CtEntry, CtKey},
    conntrack_share::{CT_USAGE_OPENED, CT_USAGE_RELEASED, CtShare, CtUsageKey},
    maps as names,
};
use tracing::{info, warn};

use super::{error::Error, loader::endpoint_meta_name, maps::BpfMaps, pins::PinLayout};

/// Without `--conntrack-share`, one interface may hold this fraction of
/// the map (a quarter): one flooding pod then leaves the other pods three
/// quarters of it.
pub const DEFAULT_SHARE_DIVISOR: u32 = 4;
/// A count at least this often, so the bound stays fresh (see
/// `policy_common::conntrack_share::CT_SHARE_FRESH_NS`) and expired
/// entries do not pile up.
const COUNT_AT_LEAST_EVERY: Duration = Duration::from_secs(20);
/// At most this often: a count walks the whole map.
const COUNT_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// The bound for a map of `capacity` entries: the operator's
/// (`--conntrack-share`; 0 turns it off), or [`DEFAULT_SHARE_DIVISOR`].
pub fn share_for(setting: Option<u32>, capacity: u32) -> u32 {
    setting.unwrap_or((capacity / DEFAULT_SHARE_DIVISOR).max(1))
}

/// Now, on the classifier's clock (`bpf_ktime_get_coarse_ns`:
/// CLOCK_MONOTONIC at tick resolution).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill; the clock id is a constant.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// What one count found.
#[derive(Debug, Default)]
pub struct Count {
    /// Live entries, per interface.
    pub held: BTreeMap<u32, u64>,
    /// Expired entries deleted.
    pub swept: usize,
}

/// One count at `now`: reads what each interface opened, then walks
/// `CONNTRACK` (deleting expired entries), then writes each interface's
/// released counter, forgets the counters of interfaces that are no
/// endpoint any more, and stamps the bound with this count's time.
pub fn count(maps: &mut BpfMaps, share: u32, now: u64) -> Result<Count, Error> {
    // Opened first: a flow opened during the walk may be found by it and
    // so be counted twice (held, and opened after the read). The estimate
    // then errs high, never low, until the next count.
    let opened = counters(maps, CT_USAGE_OPENED)?;
    let entries = walk(maps);
    let mut out = Count::default();
    for (key, entry) in &entries {
        if entry.is_live(key.protocol, now) {
            *out.held.entry(key.ifindex).or_default() += 1;
        } else if maps.conntrack.remove(key).is_ok() {
            out.swept += 1;
        }
    }
    for (&ifindex, &n) in &opened {
        let held = out.held.get(&ifindex).copied().unwrap_or(0);
        let key = CtUsageKey {
            ifindex,
            counter: CT_USAGE_RELEASED,
        };
        super::maps::insert(
            names::CT_USAGE,
            maps.ct_usage.insert(key, n.wrapping_sub(held), 0),
            maps.ct_usage.map(),
        )?;
    }
    let gone: Vec<CtUsageKey> = maps
        .ct_usage
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !matches!(maps.endpoint(k.ifindex), Ok(Some(_))))
        .collect();
    for key in gone {
        let _ = maps.ct_usage.remove(&key);
    }
    maps.ct_share
        .set(
            0,
            CtShare {
                counted_ns: now,
                share,
                _pad: 0,
            },
            0,
        )
        .map_err(Error::map(names::CT_SHARE))?;
    Ok(out)
}

/// The entries of `CONNTRACK`, each once. A walk restarts where the
/// kernel deleted the entry it stood on (a busy map evicts under it), so
/// it is bounded, and what it meets twice counts once.
fn walk(maps: &BpfMaps) -> StdHashMap<CtKey, CtEntry> {
    let capacity = maps
        .conntrack
        .map()
        .info()
        .map(|i| i.max_entries() as usize)
        .unwrap_or(0);
    // Grown as entries come: sized for the map's capacity, the table
    // took megabytes at every count however few flows there were.
    let mut seen = StdHashMap::new();
    let items = maps.conntrack.iter().take(capacity.saturating_mul(2));
    seen.extend(items.flatten());
    seen
}

/// One counter of every interface that has it.
fn counters(maps: &BpfMaps, counter: u32) -> Result<BTreeMap<u32, u64>, Error> {
    let mut out = BTreeMap::new();
    for item in maps.ct_usage.iter() {
        let (k, v) = item.map_err(Error::map(names::CT_USAGE))?;
        if k.counter == counter {
            out.insert(k.ifindex, v);
        }
    }
    Ok(out)
}

/// Whether some interface's estimate (opened − released) has reached
/// half its share: a count soon tells how much of it is still there.
fn near_share(maps: &BpfMaps, share: u32) -> bool {
    let (Ok(opened), Ok(released)) = (
        counters(maps, CT_USAGE_OPENED),
        counters(maps, CT_USAGE_RELEASED),
    ) else {
        return true;
    };
    opened
        .iter()
        .any(|(i, o)| o.wrapping_sub(released.get(i).copied().unwrap_or(0)) >= u64::from(share / 2))
}

/// Turns the bound on (or off, with `Some(0)`) for the maps pinned under
/// `layout`, and keeps it fresh from a thread of its own until the pins
/// go. False when the maps cannot be opened.
pub(super) fn spawn(layout: &PinLayout, setting: Option<u32>) -> bool {
    let mut maps = match BpfMaps::from_pins(layout) {
        Ok(m) => m,
        Err(e) => {
            warn!(error = %e, "conntrack share: maps unavailable");
            return false;
        }
    };
    let capacity = maps
        .conntrack
        .map()
        .info()
        .map(|i| i.max_entries())
        .unwrap_or(0);
    let share = share_for(setting, capacity);
    if share == 0 {
        let _ = maps.ct_share.set(0, CtShare::default(), 0);
        info!("conntrack share: off (one pod may fill the conntrack map)");
        return true;
    }
    info!(
        share,
        capacity, "conntrack share: the most entries one pod holds"
    );
    let pin = layout.map(names::CONNTRACK);
    let spawned = std::thread::Builder::new()
        .name("conntrack-share".into())
        .spawn(move || {
            let mut full = BTreeSet::new();
            let mut last: Option<Instant> = None;
            while pin.exists() {
                let since = last.map_or(Duration::MAX, |t| t.elapsed());
                if since >= COUNT_AT_LEAST_EVERY
                    || (since >= COUNT_AT_MOST_EVERY && near_share(&maps, share))
                {
                    last = Some(Instant::now());
                    match count(&mut maps, share, now_ns()) {
                        Ok(c) => report(&maps, &c, share, &mut full),
                        Err(e) => warn!(error = %e, "conntrack share: count failed"),
                    }
                }
                std::thread::sleep(COUNT_AT_MOST_EVERY);
            }
        });
    spawned.is_ok()
}

/// Says once when a pod reaches its share, and once when it is below it
/// again.
fn report(maps: &BpfMaps, c: &Count, share: u32, full: &mut BTreeSet<u32>) {
    let name = |ifindex: u32| {
        maps.meta(ifindex)
            .map(|m| endpoint_meta_name(&m))
            .unwrap_or_else(|| format!("ifindex {ifindex}"))
    };
    for (&ifindex, &held) in &c.held {
        if held >= u64::from(share) && full.insert(ifindex) {
            warn!(
                pod = %name(ifindex),
                held,
                share,
                "a pod holds its whole conntrack share: its new flows are not tracked (replies judged as new) until some close"
            );
        }
    }
    full.retain(|ifindex| {
        let held = c.held.get(ifindex).copied().unwrap_or(0);
        let still = held >= u64::from(share);
        if !still {
            info!(pod = %name(*ifindex), held, share, "a pod is below its conntrack share again");
        }
        still
    });
}
