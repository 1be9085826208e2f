//! `policy-agent dump`: the pinned maps decoded into names.
use std::fmt;

use policy_common::{
    config::CONFIG_DEBUG_LOG,
    endpoint::{
        ATTACH_CREATED_CLSACT, ATTACH_NETLINK, ATTACH_TCX, ENDPOINT_EGRESS_ISOLATED,
        ENDPOINT_INGRESS_ISOLATED,
    },
    identity,
    policy::{ENTRY_TIERS_ONLY, PolicyKey, TierSlot},
    rule_name::{RuleKey, kind},
    service::{SERVICE_NODE_ADDRESS, SERVICE_RANGE},
};
use serde::Serialize;

use crate::datapath::bpf::{
    error::Error,
    maps::BpfMaps,
    name_tables::{NameTables, address, endpoint_text, protocol_name},
    pins::PinLayout,
};

#[derive(Debug, Serialize)]
pub struct Dump {
    pub pin_dir: String,
    pub debug_log: bool,
    pub endpoints: Vec<EndpointRow>,
    pub identities: Vec<IdentityRow>,
    pub ipcache: Vec<IpcacheRow>,
    pub policy: Vec<PolicyRow>,
    pub conntrack: Vec<CtRow>,
    pub counters: Vec<CounterRow>,
    /// Service frontends (`SERVICES`): addresses and ranges.
    pub services: Vec<ServiceRow>,
    /// `--pod-cidr` (the pod-range guard: see docs/design/pod-range-guard.md), and whether
    /// the classifier checks it.
    pub pod_ranges: Vec<String>,
    /// Named as before the pod-range guard had its name (scripts read it).
    #[serde(rename = "catchall_on")]
    pub guard_on: bool,
    /// Enforced local addresses and whose they are.
    pub enforced: Vec<EnforcedRow>,
}

#[derive(Debug, Serialize)]
pub struct ServiceRow {
    pub prefix: String,
    /// A Service range (ServiceCIDR or `--service-cidr`).
    pub range: bool,
    /// One of this node's addresses (some Service has a nodePort).
    pub node_address: bool,
}

#[derive(Debug, Serialize)]
pub struct EnforcedRow {
    pub address: String,
    pub ifindex: u32,
    /// The endpoint's name, or "(node)" for the node's own addresses.
    pub endpoint: String,
}

#[derive(Debug, Serialize)]
pub struct EndpointRow {
    pub ifindex: u32,
    pub pod: String,
    pub identity: u32,
    pub labels: String,
    pub ingress_isolated: bool,
    pub egress_isolated: bool,
    pub revision: u32,
    pub attach: String,
}

#[derive(Debug, Serialize)]
pub struct IdentityRow {
    pub identity: u32,
    pub kind: &'static str,
    pub name: String,
}

#[derive(Debug, Serialize)]
pub struct IpcacheRow {
    pub prefix: String,
    pub identity: u32,
    pub identity_name: String,
    pub cidr_identity: u32,
    pub cidr_name: String,
}

#[derive(Debug, Serialize)]
pub struct PolicyRow {
    pub endpoint_identity: u32,
    pub endpoint: String,
    pub direction: &'static str,
    pub peer_identity: u32,
    pub peer: String,
    pub protocol: String,
    /// "80", "8000/13" (a block of ports) or "any".
    pub ports: String,
    pub rule_ref: u32,
    /// Whether a NetworkPolicy rule allows the key (else the entry holds
    /// tier slots only).
    pub network_policy: bool,
    /// The NetworkPolicy rule `rule_ref` names (None: tier slots only, or
    /// no name pinned, as in pins of an older agent).
    pub rule: Option<RuleRow>,
    /// The ClusterNetworkPolicy rule of each tier that decides the key.
    pub admin: Option<TierRow>,
    pub baseline: Option<TierRow>,
}

/// A NetworkPolicy rule, by name.
#[derive(Debug, Serialize)]
pub struct RuleRow {
    /// `namespace/name` ("…" marks a cut text).
    pub policy: String,
    pub direction: &'static str,
    /// The rule's index in the policy's `ingress` or `egress` list.
    pub rule: u32,
}

/// A tier slot, decoded: the action, the policy's priority and the rule's
/// index in it (the rank orders policies of one priority by name), and,
/// where `RULE_NAMES` has it, the ClusterNetworkPolicy and rule names.
#[derive(Debug, Serialize)]
pub struct TierRow {
    pub action: &'static str,
    pub priority: u32,
    pub rule: u32,
    pub rank: u32,
    /// The ClusterNetworkPolicy's name (None: not pinned).
    pub policy: Option<String>,
    /// The rule's `name` (None: it has none, or not pinned).
    pub rule_name: Option<String>,
}

fn tier_row(names: &NameTables, key: &PolicyKey, tier: u8, slot: TierSlot) -> Option<TierRow> {
    if slot.is_none() {
        return None;
    }
    let named = names.rule(&RuleKey::new(tier, key.direction, slot.rank()));
    Some(TierRow {
        action: slot.action_name(),
        priority: slot.priority(),
        rule: slot.rule_index(),
        rank: slot.rank(),
        policy: named.as_ref().map(|(t, _)| t.policy.clone()),
        rule_name: named.and_then(|(t, _)| (!t.rule.is_empty()).then_some(t.rule)),
    })
}

fn rule_row(names: &NameTables, key: &PolicyKey, rule_ref: u32, flags: u32) -> Option<RuleRow> {
    if flags & ENTRY_TIERS_ONLY != 0 {
        return None;
    }
    let (text, name) = names.rule(&RuleKey::new(kind::NETWORK_POLICY, key.direction, rule_ref))?;
    Some(RuleRow {
        policy: text.qualified(),
        direction: policy_common::direction::name(name.direction),
        rule: u32::from(name.rule_index),
    })
}

#[derive(Debug, Serialize)]
pub struct CtRow {
    pub endpoint: String,
    pub protocol: String,
    pub src: String,
    pub dst: String,
    pub opened: &'static str,
    pub revision: u32,
}

#[derive(Debug, Serialize)]
pub struct CounterRow {
    pub reason: &'static str,
    pub direction: &'static str,
    pub packets: u64,
}

fn attach_text(bits: u32) -> String {
    let mut parts = Vec::new();
    if bits & ATTACH_TCX != 0 {
        parts.push("tcx");
    }
    if bits & ATTACH_NETLINK != 0 {
        parts.push("netlink");
    }
    if bits & ATTACH_CREATED_CLSACT != 0 {
        parts.push("created-clsact");
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(",")
    }
}

/// Reads everything pinned under `layout`.
pub fn dump(layout: &PinLayout) -> Result<Dump, Error> {
    let maps = BpfMaps::from_pins(layout)?;
    let state = maps.read_state()?;
    let names = NameTables {
        identities: state.identities.clone(),
        endpoints: maps.read_meta()?,
        rules: state.rule_names.clone(),
    };
    let config = maps.config()?;
    let endpoints = state
        .endpoints
        .iter()
        .map(|(ifindex, ep)| EndpointRow {
            ifindex: *ifindex,
            pod: names.endpoint(*ifindex),
            identity: ep.identity,
            labels: names.identity(ep.identity),
            ingress_isolated: ep.flags & ENDPOINT_INGRESS_ISOLATED != 0,
            egress_isolated: ep.flags & ENDPOINT_EGRESS_ISOLATED != 0,
            revision: ep.revision,
            attach: attach_text(names.endpoints.get(ifindex).map(|m| m.attach).unwrap_or(0)),
        })
        .collect();
    let identities = state
        .identities
        .keys()
        .map(|id| IdentityRow {
            identity: *id,
            kind: if identity::is_cidr(*id) {
                "cidr"
            } else {
                "labels"
            },
            name: names.identity(*id),
        })
        .collect();
    let ipcache = state
        .ipcache
        .iter()
        .map(|(net, e)| IpcacheRow {
            prefix: net.to_string(),
            identity: e.identity,
            identity_name: if e.identity == identity::ANY {
                "-".into()
            } else {
                names.identity(e.identity)
            },
            cidr_identity: e.cidr_identity,
            cidr_name: names.identity(e.cidr_identity),
        })
        .collect();
    let policy = state
        .policy
        .iter()
        .map(|(k, v)| PolicyRow {
            endpoint_identity: k.endpoint_identity,
            endpoint: names.identity(k.endpoint_identity),
            direction: policy_common::direction::name(k.direction),
            peer_identity: k.peer_identity,
            peer: names.identity(k.peer_identity),
            protocol: protocol_name(k.protocol),
            ports: match k.port_prefix_len {
                0 => "any".into(),
                16 => k.port.to_string(),
                len => format!("{}-{} ({}/{len})", k.port, k.port | (0xffff >> len), k.port),
            },
            rule_ref: v.rule_ref,
            network_policy: v.flags & ENTRY_TIERS_ONLY == 0,
            rule: rule_row(&names, k, v.rule_ref, v.flags),
            admin: tier_row(&names, k, kind::ADMIN, v.admin),
            baseline: tier_row(&names, k, kind::BASELINE, v.baseline),
        })
        .collect();
    let mut conntrack = Vec::new();
    for item in maps.conntrack.iter() {
        let (k, v) = item.map_err(Error::map(policy_common::maps::CONNTRACK))?;
        // The key names the pod's side and the peer's; the row, the
        // opener's source and destination.
        let (src, sport, dst, dport) = k.as_opened(v.direction);
        conntrack.push(CtRow {
            endpoint: names.endpoint(k.ifindex),
            protocol: protocol_name(k.protocol),
            src: endpoint_text(address(k.family, &src), sport, k.protocol),
            dst: endpoint_text(address(k.family, &dst), dport, k.protocol),
            opened: policy_common::direction::name(v.direction),
            revision: v.revision,
        });
    }
    let counters = maps
        .counters()?
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|((reason, dir), packets)| CounterRow {
            reason: reason.name(),
            direction: policy_common::direction::name(dir),
            packets,
        })
        .collect();
    let services = state
        .services
        .iter()
        .map(|(net, e)| ServiceRow {
            prefix: net.to_string(),
            range: e.flags & SERVICE_RANGE != 0,
            node_address: e.flags & SERVICE_NODE_ADDRESS != 0,
        })
        .collect();
    let (ranges, guard_on, held) = maps.read_pod_range_guard()?;
    let enforced = held
        .into_iter()
        .map(|(ip, ifindex)| EnforcedRow {
            address: ip.to_string(),
            ifindex,
            endpoint: if ifindex == policy_common::pod_range_guard::ENFORCED_NODE {
                "(node)".into()
            } else {
                names.endpoint(ifindex)
            },
        })
        .collect();
    Ok(Dump {
        pod_ranges: ranges.iter().map(ToString::to_string).collect(),
        guard_on,
        enforced,
        pin_dir: layout.versioned().display().to_string(),
        debug_log: config.flags & CONFIG_DEBUG_LOG != 0,
        endpoints,
        identities,
        ipcache,
        policy,
        conntrack,
        counters,
        services,
    })
}

impl fmt::Display for Dump {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "pins: {}   kernel debug log: {}",
            self.pin_dir,
            if self.debug_log { "on" } else { "off" }
        )?;
        writeln!(f, "\nENDPOINTS ({})", self.endpoints.len())?;
        for e in &self.endpoints {
            let iso = match (e.ingress_isolated, e.egress_isolated) {
                (true, true) => "ingress+egress isolated",
                (true, false) => "ingress isolated",
                (false, true) => "egress isolated",
                (false, false) => "not isolated",
            };
            writeln!(
                f,
                "  if{:<5} {:<32} id {:<8} rev {:<4} {iso:<24} [{}] {}",
                e.ifindex, e.pod, e.identity, e.revision, e.attach, e.labels
            )?;
        }
        writeln!(f, "\nIDENTITIES ({})", self.identities.len())?;
        for i in &self.identities {
            writeln!(f, "  {:<10} {:<6} {}", i.identity, i.kind, i.name)?;
        }
        writeln!(f, "\nIPCACHE ({})", self.ipcache.len())?;
        for r in &self.ipcache {
            writeln!(
                f,
                "  {:<28} pod {:<10} class {:<10} {} | {}",
                r.prefix, r.identity, r.cidr_identity, r.identity_name, r.cidr_name
            )?;
        }
        writeln!(f, "\nPOLICY ({})", self.policy.len())?;
        for p in &self.policy {
            let np = match (&p.rule, p.network_policy) {
                (Some(r), _) => format!("{} {} rule {}", r.policy, r.direction, r.rule),
                (None, true) => format!("rule {:08x}", p.rule_ref),
                (None, false) => "tiers only   ".to_owned(),
            };
            let mut tiers = String::new();
            for (tier, row) in [("Admin", &p.admin), ("Baseline", &p.baseline)] {
                if let Some(t) = row {
                    let policy = t.policy.as_deref().map(|n| format!(" {n}"));
                    let rule = t.rule_name.as_deref().map(|n| format!(" {n:?}"));
                    tiers += &format!(
                        " {tier} {}{} (priority {}, rule {}{})",
                        t.action,
                        policy.unwrap_or_default(),
                        t.priority,
                        t.rule,
                        rule.unwrap_or_default()
                    );
                }
            }
            writeln!(
                f,
                "  {:<8} {:<7} peer {:<10} {:<6} {:<22} {np}{tiers}  [{}] <- [{}]",
                p.endpoint_identity,
                p.direction,
                p.peer_identity,
                p.protocol,
                p.ports,
                p.endpoint,
                p.peer
            )?;
        }
        writeln!(f, "\nCONNTRACK ({})", self.conntrack.len())?;
        for c in &self.conntrack {
            writeln!(
                f,
                "  {:<28} {:<6} {} -> {} (opened {}, rev {})",
                c.endpoint, c.protocol, c.src, c.dst, c.opened, c.revision
            )?;
        }
        writeln!(f, "\nSERVICES ({})", self.services.len())?;
        for s in &self.services {
            let why = match (s.range, s.node_address) {
                (true, _) => "range",
                (false, true) => "node address",
                (false, false) => "address",
            };
            writeln!(f, "  {:<44} {why}", s.prefix)?;
        }
        writeln!(
            f,
            "\nPOD RANGES ({}, pod-range guard {}): {}",
            self.pod_ranges.len(),
            if self.guard_on { "on" } else { "off" },
            self.pod_ranges.join(" ")
        )?;
        writeln!(f, "\nENFORCED ({})", self.enforced.len())?;
        for e in &self.enforced {
            writeln!(f, "  {:<40} if{:<5} {}", e.address, e.ifindex, e.endpoint)?;
        }
        writeln!(f, "\nCOUNTERS")?;
        for c in &self.counters {
            writeln!(f, "  {:<26} {:<7} {}", c.reason, c.direction, c.packets)?;
        }
        Ok(())
    }
}
