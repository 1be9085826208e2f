//! Each map checked against this layout as it is opened: a reused pin
//! must have the sizes and type this agent reads and writes, and a map
//! newer than an older agent's pins may be missing from them.
use aya::maps::{Map, MapError};
use policy_common::{
    config::Config,
    conntrack::{CtEntry, CtKey, FragEntry, FragKey},
    conntrack_share::{CtShare, CtUsageKey},
    endpoint::{EndpointInfo, EndpointMeta},
    event::FlowBudget,
    identity::IdentityName,
    ipcache::IpcacheEntry,
    maps as names,
    policy::{PolicyEntry, PolicyKey},
    rule_name::{RuleKey, RuleName},
    service::{ServiceAddr, ServiceEntry},
};

use super::{error::Error, pins::PinLayout};

/// Key and value sizes each map must have in this layout.
fn expected_sizes(name: &str) -> Option<(usize, usize)> {
    use std::mem::size_of;
    Some(match name {
        names::CONFIG => (4, size_of::<Config>()),
        names::ENDPOINT_SLOTS | names::ENDPOINTS => (4, size_of::<EndpointInfo>()),
        names::ENDPOINT_META => (4, size_of::<EndpointMeta>()),
        names::IPCACHE_HOSTS_V4 => (4, size_of::<IpcacheEntry>()),
        names::IPCACHE_HOSTS_V6 => (16, size_of::<IpcacheEntry>()),
        names::IPCACHE_V4 => (8, size_of::<IpcacheEntry>()),
        names::IPCACHE_V6 => (20, size_of::<IpcacheEntry>()),
        names::POLICY => (size_of::<PolicyKey>(), size_of::<PolicyEntry>()),
        names::IDENTITY_NAMES => (4, size_of::<IdentityName>()),
        names::RULE_NAMES => (size_of::<RuleKey>(), size_of::<RuleName>()),
        names::SERVICES => (4 + size_of::<ServiceAddr>(), size_of::<ServiceEntry>()),
        names::CONNTRACK => (size_of::<CtKey>(), size_of::<CtEntry>()),
        names::FRAGMENTS => (size_of::<FragKey>(), size_of::<FragEntry>()),
        names::CT_SHARE => (4, size_of::<CtShare>()),
        names::CT_USAGE => (size_of::<CtUsageKey>(), 8),
        names::COUNTERS => (4, 8),
        names::POD_RANGES => (4 + size_of::<ServiceAddr>(), 4),
        names::ENFORCED => (size_of::<ServiceAddr>(), 4),
        names::FLOW_BUDGET => (4, size_of::<FlowBudget>()),
        _ => return None,
    })
}

/// The map the kernel actually has (a reused pin) must match this layout:
/// aya checks sizes against the ELF definition only.
fn verify_pinned(name: &'static str, layout: &PinLayout, map: &Map) -> Result<(), Error> {
    let data = match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::LpmTrie(d)
        | Map::PerCpuArray(d) => d,
        _ => return Ok(()),
    };
    let (Some((key, value)), Ok(info)) = (expected_sizes(name), data.info()) else {
        return Ok(());
    };
    if info.key_size() as usize != key || info.value_size() as usize != value {
        return Err(Error::LayoutMismatch {
            path: layout.map(name),
            expected: format!("key size {key}, value size {value}"),
            found: format!(
                "key size {}, value size {}",
                info.key_size(),
                info.value_size()
            ),
        });
    }
    Ok(())
}

/// Turns aya's size checks into a layout error naming the pin.
fn typed<T>(name: &'static str, layout: Option<&PinLayout>, map: Map) -> Result<T, Error>
where
    T: TryFrom<Map, Error = MapError>,
{
    if let Some(l) = layout {
        verify_pinned(name, l, &map)?;
    }
    T::try_from(map).map_err(|e| match (&e, layout) {
        (MapError::InvalidKeySize { size, expected }, Some(l)) => Error::LayoutMismatch {
            path: l.map(name),
            expected: format!("key size {expected}"),
            found: format!("key size {size}"),
        },
        (MapError::InvalidValueSize { size, expected }, Some(l)) => Error::LayoutMismatch {
            path: l.map(name),
            expected: format!("value size {expected}"),
            found: format!("value size {size}"),
        },
        (MapError::InvalidMapType { map_type }, Some(l)) => Error::LayoutMismatch {
            path: l.map(name),
            expected: "the map type of this layout".to_owned(),
            found: format!("map type {map_type}"),
        },
        _ => Error::map(name)(e),
    })
}

/// Maps newer than the layout version: pins an older agent left may lack
/// them. Loading the object creates them beside the others; a reader of
/// such pins goes on without them.
pub(super) const ADDED_LATER: [&str; 2] = [names::RULE_NAMES, names::FLOW_BUDGET];

/// The map `name` from `source`, typed and checked against `layout`.
pub(super) fn field<T>(
    name: &'static str,
    layout: Option<&PinLayout>,
    source: &mut impl FnMut(&'static str) -> Result<Map, Error>,
) -> Result<T, Error>
where
    T: TryFrom<Map, Error = MapError>,
{
    typed(name, layout, source(name)?)
}
