//! Turning numbers (identities, ifindexes, reasons) into words.
use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr};

use policy_common::{
    endpoint::EndpointMeta,
    family,
    identity::{self, IdentityName},
    proto,
    rule_name::{RuleKey, RuleName},
};

use super::loader::endpoint_meta_name;
use crate::mapstate::{RuleText, identity_name_str, rule_name_text};

/// Lookup tables read from the pinned metadata maps.
#[derive(Clone, Debug, Default)]
pub struct NameTables {
    pub identities: BTreeMap<u32, std::sync::Arc<IdentityName>>,
    pub endpoints: BTreeMap<u32, EndpointMeta>,
    /// Empty when the pins predate `RULE_NAMES`.
    pub rules: BTreeMap<RuleKey, RuleName>,
}

impl NameTables {
    pub fn identity(&self, id: u32) -> String {
        match id {
            identity::ANY => "any".to_owned(),
            identity::NODE => "node".to_owned(),
            identity::WORLD => "world".to_owned(),
            identity::IN_TRANSIT => "in transit".to_owned(),
            _ => match self.identities.get(&id) {
                Some(n) => identity_name_str(n),
                None => format!("unknown identity {id}"),
            },
        }
    }

    /// The rule `key` names, with its direction, index and priority.
    pub fn rule(&self, key: &RuleKey) -> Option<(RuleText, &RuleName)> {
        self.rules.get(key).map(|n| (rule_name_text(n), n))
    }

    pub fn endpoint(&self, ifindex: u32) -> String {
        match self.endpoints.get(&ifindex) {
            Some(m) => endpoint_meta_name(m),
            None => format!("ifindex {ifindex}"),
        }
    }
}

pub fn protocol_name(p: u8) -> String {
    match p {
        proto::ANY => "any".into(),
        proto::TCP => "TCP".into(),
        proto::UDP => "UDP".into(),
        proto::SCTP => "SCTP".into(),
        proto::ICMP => "ICMP".into(),
        proto::ICMPV6 => "ICMPv6".into(),
        other => format!("proto {other}"),
    }
}

/// An address from a 16-byte field (IPv4 in the first 4 bytes).
pub fn address(fam: u8, bytes: &[u8; 16]) -> IpAddr {
    if fam == family::IPV4 {
        IpAddr::from([bytes[0], bytes[1], bytes[2], bytes[3]])
    } else {
        IpAddr::from(*bytes)
    }
}

/// "10.0.0.1:80" or "[fd00::1]:80"; no port for portless protocols.
pub fn endpoint_text(ip: IpAddr, port: u16, protocol: u8) -> String {
    let mut s = String::new();
    let ported = matches!(protocol, proto::TCP | proto::UDP | proto::SCTP);
    match (ip, ported) {
        (IpAddr::V6(v6), true) => {
            let _ = write!(s, "[{v6}]:{port}");
        }
        (ip, true) => {
            let _ = write!(s, "{ip}:{port}");
        }
        (ip, false) => {
            let _ = write!(s, "{ip}");
        }
    }
    s
}
