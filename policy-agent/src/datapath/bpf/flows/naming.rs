//! Turning a [`FlowRecord`] into a [`FlowEvent`]: the local pod from
//! `ENDPOINT_META`, the peer from the local pods' addresses, the rules
//! from `RULE_NAMES`.
//!
//! Which policies a record names is [`super::policies`].
//!
//! A record may name a rule removed a moment before it is read, so the
//! namer keeps every name it has seen ([`FlowNamer`]), and reads the pins
//! again on a miss, at most every [`MISS_REFRESH`].
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use policy_common::{
    endpoint::{ENDPOINT_HAS_V4, ENDPOINT_HAS_V6},
    event::FlowRecord,
    identity,
    maps::capacity,
    proto,
    rule_name::{RuleKey, RuleName, kind},
    verdict::{FIRST_DROP, Reason},
};

use super::Error;
pub use super::policies::{is_new_flow, live_labels, policies};
use super::{
    clock::WallClock,
    policies::rule_keys,
    record::{Flow, FlowEvent, Peer, Verdict},
    stats::RuleLabels,
};
use crate::datapath::bpf::{
    maps::BpfMaps,
    name_tables::{NameTables, address, endpoint_text},
    pins::PinLayout,
};

/// The least time between two reads of the pins for a name not known.
pub const MISS_REFRESH: Duration = Duration::from_millis(100);
/// Every this often the pins are read again anyway (new local pods'
/// addresses cause no miss).
pub const PERIODIC_REFRESH: Duration = Duration::from_secs(5);

/// What names records: the pinned tables, and the local pods' addresses.
#[derive(Clone, Debug, Default)]
pub struct Names {
    pub tables: NameTables,
    /// A local pod's address → its interface.
    pub addresses: BTreeMap<IpAddr, u32>,
}

/// Where [`Names`] are read from.
pub trait NameSource {
    fn read(&mut self) -> Result<Names, Error>;
}

/// The pins under a layout, opened once and again after a failure.
pub struct PinnedNames {
    layout: PinLayout,
    maps: Option<BpfMaps>,
}

impl PinnedNames {
    pub fn new(layout: &PinLayout) -> Self {
        Self {
            layout: layout.clone(),
            maps: None,
        }
    }

    fn read_from(maps: &BpfMaps) -> Result<Names, crate::datapath::bpf::Error> {
        let mut addresses = BTreeMap::new();
        for (ifindex, ep) in maps.endpoints()? {
            if ep.flags & ENDPOINT_HAS_V4 != 0 {
                addresses.insert(IpAddr::from(ep.ipv4), ifindex);
            }
            if ep.flags & ENDPOINT_HAS_V6 != 0 {
                addresses.insert(IpAddr::from(ep.ipv6), ifindex);
            }
        }
        Ok(Names {
            tables: NameTables {
                identities: maps.read_identities()?,
                endpoints: maps.read_meta()?,
                rules: maps.read_rule_names()?,
            },
            addresses,
        })
    }
}

impl NameSource for PinnedNames {
    fn read(&mut self) -> Result<Names, Error> {
        let maps = match self.maps.take() {
            Some(m) => m,
            None => BpfMaps::from_pins(&self.layout).map_err(Error::Bpf)?,
        };
        let names = Self::read_from(&maps).map_err(Error::Bpf)?;
        self.maps = Some(maps);
        Ok(names)
    }
}

/// Something a record refers to that the cache did not hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Miss {
    Rule(RuleKey),
    Endpoint(u32),
    Identity(u32),
}

/// Names records, keeping every name it has seen.
pub struct FlowNamer<S> {
    source: S,
    clock: WallClock,
    /// Every name seen (see [`merge`]).
    names: Names,
    /// The rules named in the pins at the last read, as metric labels.
    live: BTreeSet<RuleLabels>,
    last_read: Option<Instant>,
    /// Misses the last read did not answer: they wait for the periodic one.
    unanswered: HashSet<Miss>,
}

impl<S: NameSource> FlowNamer<S> {
    /// Reads the names once (a failure leaves them empty: records are
    /// named as unknown until a read succeeds).
    pub fn new(source: S, clock: WallClock) -> Self {
        let mut this = Self {
            source,
            clock,
            names: Names::default(),
            live: BTreeSet::new(),
            last_read: None,
            unanswered: HashSet::new(),
        };
        let _ = this.refresh();
        this
    }

    /// Reads the pins and keeps what they hold beside what was seen.
    pub fn refresh(&mut self) -> Result<(), Error> {
        self.last_read = Some(Instant::now());
        let fresh = self.source.read()?;
        self.live = live_labels(&fresh.tables.rules);
        merge(&mut self.names, fresh);
        Ok(())
    }

    /// The periodic read, when due.
    pub fn tick(&mut self) {
        if self
            .last_read
            .is_none_or(|t| t.elapsed() >= PERIODIC_REFRESH)
        {
            self.unanswered.clear();
            let _ = self.refresh();
        }
    }

    /// Keeps `names` (about to leave the pins) beside what was seen; a
    /// name the pins hold wins.
    pub fn keep(&mut self, names: impl IntoIterator<Item = (RuleKey, RuleName)>) {
        for (k, n) in names {
            self.names.tables.rules.entry(k).or_insert(n);
        }
    }

    /// The rules the pins named at the last read.
    pub fn live_labels(&self) -> &BTreeSet<RuleLabels> {
        &self.live
    }

    pub fn names(&self) -> &Names {
        &self.names
    }

    /// `record`, named.
    pub fn name(&mut self, record: &FlowRecord) -> FlowEvent {
        let misses: Vec<Miss> = wanted(record)
            .into_iter()
            .filter(|m| !self.holds(m) && !self.unanswered.contains(m))
            .collect();
        if !misses.is_empty() && self.last_read.is_none_or(|t| t.elapsed() >= MISS_REFRESH) {
            let _ = self.refresh();
            let still: Vec<Miss> = misses.into_iter().filter(|m| !self.holds(m)).collect();
            self.unanswered.extend(still);
        }
        name_record(&self.names, &self.clock, record)
    }

    fn holds(&self, miss: &Miss) -> bool {
        let t = &self.names.tables;
        match miss {
            Miss::Rule(k) => t.rules.contains_key(k),
            Miss::Endpoint(i) => t.endpoints.contains_key(i),
            Miss::Identity(i) => t.identities.contains_key(i),
        }
    }
}

/// What naming `record` looks up (an isolating policy list: its first).
fn wanted(r: &FlowRecord) -> Vec<Miss> {
    let mut out = vec![Miss::Endpoint(r.ifindex)];
    if r.peer_identity >= identity::FIRST_LABEL {
        out.push(Miss::Identity(r.peer_identity));
    }
    if let Some(reason) = Reason::from_u8(r.reason) {
        out.extend(
            rule_keys(reason, &r.rule, r.direction, r.endpoint_identity)
                .into_iter()
                .map(Miss::Rule),
        );
    }
    out
}

/// Adds `fresh` to what was seen. A list of isolating policies is
/// replaced as a whole where the pins have it (a stale tail would name a
/// policy that no longer isolates); one the pins lost is kept. Past twice
/// the map's capacity, only what the pins hold now is kept.
pub fn merge(seen: &mut Names, fresh: Names) {
    let groups: BTreeSet<(u8, u32)> = fresh
        .tables
        .rules
        .keys()
        .filter(|k| k.kind == kind::ISOLATING)
        .map(|k| (k.direction, k.id))
        .collect();
    let rules = &mut seen.tables.rules;
    if rules.len() + fresh.tables.rules.len() > 2 * capacity::RULE_NAMES as usize {
        rules.clear();
    }
    rules.retain(|k, _| k.kind != kind::ISOLATING || !groups.contains(&(k.direction, k.id)));
    rules.extend(fresh.tables.rules);
    seen.tables.identities.extend(fresh.tables.identities);
    seen.tables.endpoints.extend(fresh.tables.endpoints);
    seen.addresses = fresh.addresses;
}

/// Names `record` from `names` alone (no read of the pins).
pub fn name_record(names: &Names, clock: &WallClock, r: &FlowRecord) -> FlowEvent {
    let t = &names.tables;
    let src = address(r.family, &r.src);
    let dst = address(r.family, &r.dst);
    let peer_ip = if r.direction == policy_common::direction::INGRESS {
        src
    } else {
        dst
    };
    let peer = match names.addresses.get(&peer_ip) {
        Some(ifindex) => Peer::pod(t.endpoint(*ifindex), peer_ip.to_string()),
        None => Peer::ip(peer_ip.to_string()),
    };
    let ported = matches!(r.protocol, proto::TCP | proto::UDP | proto::SCTP);
    let reason = Reason::from_u8(r.reason);
    FlowEvent {
        flow: Flow {
            time: clock.rfc3339(r.timestamp_ns),
            direction: policy_common::direction::name(r.direction).to_owned(),
            pod: t.endpoint(r.ifindex),
            peer,
            peer_identity: (r.peer_identity != 0).then(|| t.identity(r.peer_identity)),
            protocol: protocol(r.protocol),
            port: ported.then_some(r.dport),
            verdict: verdict(r.reason),
            reason: reason_name(r.reason),
            policies: reason
                .map(|s| policies(t, s, &r.rule, r.direction, r.endpoint_identity))
                .unwrap_or_default(),
            // Judged by the daemon against its staged view (see
            // `super::staged`), not carried by the record.
            staged: None,
        },
        src: endpoint_text(src, r.sport, r.protocol),
        dst: endpoint_text(dst, r.dport, r.protocol),
        peer_class: t.identity(r.peer_cidr_identity),
    }
}

fn verdict(reason: u8) -> Verdict {
    if reason >= FIRST_DROP {
        Verdict::Drop
    } else {
        Verdict::Allow
    }
}

fn reason_name(reason: u8) -> String {
    Reason::from_u8(reason).map_or_else(|| format!("reason {reason}"), |r| r.name().to_owned())
}

/// "TCP", "UDP", "SCTP", "ICMP", "ICMPv6", or the number.
pub fn protocol(p: u8) -> String {
    match p {
        proto::TCP => "TCP".into(),
        proto::UDP => "UDP".into(),
        proto::SCTP => "SCTP".into(),
        proto::ICMP => "ICMP".into(),
        proto::ICMPV6 => "ICMPv6".into(),
        other => other.to_string(),
    }
}
