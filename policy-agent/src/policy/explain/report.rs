//! What `explain` reports, as data (JSON) and as text.
use std::{
    fmt::{self, Write as _},
    net::IpAddr,
};

use serde::Serialize;

/// What one end of the flow is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerReport {
    pub address: IpAddr,
    /// "namespace/name" of the pod holding the address.
    pub pod: Option<String>,
    pub node: bool,
    /// The ipcache entry of the address.
    pub identity: u32,
    pub identity_name: String,
    pub cidr_identity: u32,
    pub cidr_identity_name: String,
}

/// One policy key, as probed or matched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyReport {
    pub endpoint_identity: u32,
    pub peer_identity: u32,
    pub direction: String,
    pub protocol: String,
    pub port: u16,
    pub port_prefix_len: u8,
    /// Whether the key is in the policy map.
    pub present: bool,
    pub rule_ref: Option<u32>,
    /// "namespace/name ingress[0]" of the rule behind the entry.
    pub rule: Option<String>,
}

/// A rule that matches the flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleMatch {
    pub rule_index: usize,
    pub rule_ref: u32,
    /// Which peers matched, e.g. `from[1] podSelector` or `from absent or empty`.
    pub peers: Vec<String>,
    /// Which ports matched, e.g. `ports[0] TCP 8000-8080`.
    pub ports: Vec<String>,
}

/// A policy that selects the endpoint in the direction judged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    pub valid: bool,
    pub errors: Vec<String>,
    pub matched_rules: Vec<RuleMatch>,
}

/// The judgement at one local endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DirectionReport {
    pub direction: String,
    pub endpoint: String,
    pub endpoint_identity: u32,
    pub endpoint_identity_name: String,
    pub isolated: bool,
    /// Policies selecting the endpoint that isolate this direction.
    pub policies: Vec<PolicyReport>,
    /// Keys probed, in the kernel's order.
    pub probed: Vec<KeyReport>,
    pub matched_key: Option<KeyReport>,
    /// [`Reason::name`] of the map verdict.
    pub map_reason: String,
    pub map_allowed: bool,
    pub rules_allowed: bool,
    /// The ClusterNetworkPolicy rule that decided (or passed the flow on),
    /// if one matched.
    pub tier: Option<TierReport>,
}

/// A ClusterNetworkPolicy rule, as `explain` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierReport {
    pub tier: String,
    pub policy: String,
    pub priority: u32,
    pub rule_index: usize,
    pub rule_name: String,
    pub action: String,
    /// For a Pass: the tier it handed the flow to.
    pub passed_to: Option<String>,
}

/// The explanation of one flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub src: PeerReport,
    pub dst: PeerReport,
    pub protocol: String,
    pub port: u16,
    pub allowed: bool,
    /// Judged at the source (its egress), if it is a local endpoint.
    pub egress: Option<DirectionReport>,
    /// Judged at the destination (its ingress), if it is a local endpoint.
    pub ingress: Option<DirectionReport>,
    pub notes: Vec<String>,
}

impl Explanation {
    /// Whether the map verdicts and the rule verdicts agree everywhere.
    pub fn consistent(&self) -> bool {
        [&self.egress, &self.ingress]
            .into_iter()
            .flatten()
            .all(|d| d.map_allowed == d.rules_allowed)
    }
}

fn write_side(f: &mut String, label: &str, p: &PeerReport) {
    let who = p.pod.clone().unwrap_or_else(|| {
        if p.node {
            "node".to_owned()
        } else {
            "external".to_owned()
        }
    });
    let _ = writeln!(
        f,
        "  {label}: {who} {} (identity {} {}, class {} {})",
        p.address, p.identity, p.identity_name, p.cidr_identity, p.cidr_identity_name
    );
}

fn write_key(f: &mut String, k: &KeyReport) {
    let _ = write!(
        f,
        "{{endpoint {}, peer {}, {}, {} {}/{}}}",
        k.endpoint_identity, k.peer_identity, k.direction, k.protocol, k.port, k.port_prefix_len
    );
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        let verdict = if self.allowed {
            "ALLOWED".to_owned()
        } else {
            let at: Vec<String> = [&self.egress, &self.ingress]
                .into_iter()
                .flatten()
                .filter(|d| !d.map_allowed)
                .map(|d| format!("{} of {}", d.direction, d.endpoint))
                .collect();
            format!("DROPPED at {}", at.join(" and "))
        };
        let _ = writeln!(s, "flow {} port {}: {verdict}", self.protocol, self.port);
        write_side(&mut s, "src", &self.src);
        write_side(&mut s, "dst", &self.dst);
        for d in [&self.egress, &self.ingress].into_iter().flatten() {
            let _ = writeln!(
                s,
                "{} at {} (identity {} {}): {}",
                d.direction,
                d.endpoint,
                d.endpoint_identity,
                d.endpoint_identity_name,
                if d.isolated {
                    "isolated"
                } else {
                    "not isolated"
                }
            );
            for p in &d.policies {
                let _ = writeln!(
                    s,
                    "  policy {}{}",
                    p.policy,
                    if p.valid {
                        ""
                    } else {
                        " (INVALID: allows nothing)"
                    }
                );
                for e in &p.errors {
                    let _ = writeln!(s, "    error: {e}");
                }
                if p.matched_rules.is_empty() {
                    let _ = writeln!(s, "    no rule matches");
                }
                for r in &p.matched_rules {
                    let _ = writeln!(
                        s,
                        "    rule {}[{}] matches: peers {}; ports {}",
                        d.direction,
                        r.rule_index,
                        r.peers.join(", "),
                        r.ports.join(", ")
                    );
                }
            }
            if let Some(t) = &d.tier {
                let _ = write!(
                    s,
                    "  {} tier: clusternetworkpolicy {} (priority {}) rule {}[{}] {:?}: {}",
                    t.tier, t.policy, t.priority, d.direction, t.rule_index, t.rule_name, t.action
                );
                if let Some(to) = &t.passed_to {
                    let _ = write!(s, ", passed to {to}");
                }
                s.push('\n');
            }
            for k in &d.probed {
                s.push_str("  probe ");
                write_key(&mut s, k);
                let _ = writeln!(s, "{}", if k.present { " present" } else { "" });
            }
            let _ = write!(s, "  map verdict: {}", d.map_reason);
            if let Some(k) = &d.matched_key {
                s.push_str(" via ");
                write_key(&mut s, k);
                if let Some(r) = &k.rule {
                    let _ = write!(s, " from {r}");
                }
            }
            let _ = writeln!(
                s,
                "; rules {}",
                if d.rules_allowed { "allow" } else { "deny" }
            );
        }
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        f.write_str(s.trim_end())
    }
}
