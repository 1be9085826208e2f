//! What the iptables datapath installs, as data: sets and chains, and
//! their `ipset restore` / `iptables-restore` text.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use ipnet::IpNet;

use crate::cluster::{PodRef, Problem};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const BOTH: [Family; 2] = [Family::V4, Family::V6];

    pub fn ipset_family(self) -> &'static str {
        match self {
            Family::V4 => "inet",
            Family::V6 => "inet6",
        }
    }

    pub fn suffix(self) -> &'static str {
        match self {
            Family::V4 => "4",
            Family::V6 => "6",
        }
    }

    pub fn of(net: &IpNet) -> Self {
        match net {
            IpNet::V4(_) => Family::V4,
            IpNet::V6(_) => Family::V6,
        }
    }
}

/// What a set stands for; its ipset type follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SetKind {
    /// Pod addresses of one label identity (`hash:ip`).
    Identity,
    /// Prefixes of an address class, with `nomatch` holes (`hash:net`).
    Class,
    /// Everything outside every carved prefix (`hash:net`).
    World,
    /// The enforced local addresses (`--pod-cidr`, `hash:ip`).
    Enforced,
}

impl SetKind {
    /// The ipset type.
    pub fn ipset_type(self) -> &'static str {
        if self.is_net() { "hash:net" } else { "hash:ip" }
    }

    pub fn is_net(self) -> bool {
        matches!(self, SetKind::Class | SetKind::World)
    }

    fn letter(self) -> char {
        match self {
            SetKind::Identity => 'I',
            SetKind::Class => 'C',
            SetKind::World => 'W',
            SetKind::Enforced => 'L',
        }
    }
}

/// A set's name before the family is chosen: its kind and the hash of what
/// it stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SetName {
    pub kind: SetKind,
    pub hash: u64,
}

impl SetName {
    /// `pa-agent:I-<16 hex>-4`: 29 characters, 31 with the temporary
    /// suffix, the most ipset accepts.
    pub fn render(self, fam: Family) -> String {
        format!(
            "{OWN_PREFIX}{}-{:016x}-{}",
            self.kind.letter(),
            self.hash,
            fam.suffix()
        )
    }
}

/// The kinds of chains, each a letter in the name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainKind {
    /// What an ingress-isolated pod may receive.
    Ingress,
    /// What an egress-isolated pod may send.
    Egress,
    /// The rules one policy gives one endpoint identity in one direction.
    Policy,
    /// The addresses a pod may send from.
    Source,
    /// What a pod whose egress tiers judge sends the node itself.
    ToNode,
    /// One flow record's verdict: marks or drops, and logs it to NFLOG
    /// (see `render::records`).
    Record,
}

impl ChainKind {
    pub const ALL: [ChainKind; 6] = [
        ChainKind::Ingress,
        ChainKind::Egress,
        ChainKind::Policy,
        ChainKind::Source,
        ChainKind::ToNode,
        ChainKind::Record,
    ];

    /// The letter after the prefix: one place, so that every kind the
    /// agent writes is also one it recognises (and removes) as its own.
    pub const fn letter(self) -> char {
        match self {
            ChainKind::Ingress => 'I',
            ChainKind::Egress => 'E',
            ChainKind::Policy => 'P',
            ChainKind::Source => 'S',
            ChainKind::ToNode => 'N',
            ChainKind::Record => 'R',
        }
    }

    /// `pa-agent:P-<16 hex>`: 27 characters (iptables allows 28).
    pub fn name(self, hash: u64) -> String {
        format!("{OWN_PREFIX}{}-{hash:016x}", self.letter())
    }
}

/// One ipset: entries are (prefix, nomatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpSet {
    pub name: String,
    pub kind: SetKind,
    pub family: Family,
    pub entries: BTreeSet<(IpNet, bool)>,
}

impl IpSet {
    pub fn entry_text(&self, net: &IpNet, nomatch: bool) -> String {
        let base = if !self.kind.is_net() || net.prefix_len() == net.max_prefix_len() {
            net.addr().to_string()
        } else {
            net.to_string()
        };
        if nomatch {
            format!("{base} nomatch")
        } else {
            base
        }
    }
}

/// A chain: its rules as `iptables-restore` writes them after `-A NAME `.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    pub rules: Vec<String>,
}

/// Everything the agent installs for one state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ruleset {
    pub sets: BTreeMap<String, IpSet>,
    pub chains: BTreeMap<Family, Vec<Chain>>,
    /// Pod chain name → (pod, direction, its IPs): conntrack entries of
    /// these IPs are flushed when the chain (or a set it uses) changes.
    pub pod_chains: BTreeMap<String, (PodRef, u8, Vec<std::net::IpAddr>)>,
    /// Sets each policy chain references (for conntrack flushing on set
    /// changes; pod chains reach sets only through policy chains).
    pub chain_sets: BTreeMap<String, BTreeSet<String>>,
    /// Policy rule chains each pod chain jumps to.
    pub chain_refs: BTreeMap<String, BTreeSet<String>>,
    /// What could not be rendered (name collisions), each failing closed.
    pub problems: Vec<Problem>,
    /// The agent's mark bit (packet mark while judging, connmark for
    /// revoked flows); 0: [`super::DEFAULT_MARK`].
    pub mark: u32,
}

/// Prefix of every chain and set the agent owns. A separator no other
/// tool's names use: the former prefix `PA` alone made foreign sets such
/// as `PAYROLL` look like stale ones of ours. Checked with ipset 7 and
/// iptables 1.8 (nft and legacy): both take it in names.
pub const OWN_PREFIX: &str = "pa-agent:";
/// The name of the chain the agent hooks into FORWARD.
pub const FORWARD_CHAIN: &str = "pa-agent:FORWARD";
/// The name of the chain the agent hooks into OUTPUT: what IPVS
/// (kube-proxy's IPVS mode) forwards to a backend was delivered to the
/// node (the Service address is local, on `kube-ipvs0`) and leaves
/// through OUTPUT, never through FORWARD.
pub const OUTPUT_CHAIN: &str = "pa-agent:OUTPUT";
/// The name of the chain the agent hooks into INPUT: the pods' source
/// checks for what they send to the node's own addresses — with
/// kube-proxy's IPVS mode that includes every ClusterIP, whose traffic
/// then leaves through OUTPUT judged as its source address's pod.
pub const INPUT_CHAIN: &str = "pa-agent:INPUT";
/// The chain `pa-agent:INPUT` sends the encapsulations a pod sends to the
/// node's own addresses to (IP-in-IP, GRE, VXLAN, ...: see
/// `policy_common::encapsulation`): decapsulated, their inner packet would
/// travel on with a source the pod chose, so they are no node traffic and
/// an egress-isolated pod's go through its egress chain. Rendered only
/// when some local pod is egress-isolated.
pub const TUNNEL_CHAIN: &str = "pa-agent:TUNNEL";
/// Where an allowing record chain goes when the record budget is spent:
/// its one rule counts the records not logged, and returns to the chain
/// that judged the flow (reached by `-g`). Rendered only with records on.
pub const LIMITED_CHAIN: &str = "pa-agent:LIMITED";
/// The same for a dropping record chain: counts and drops.
pub const LIMITED_DROP_CHAIN: &str = "pa-agent:LIMITED-DROP";
/// The comment of the counting rule of both.
pub const LIMITED_COMMENT: &str = "pa-agent: flow records over the budget";
/// The built-in chains the agent hooks (first rule: a jump to its own
/// chain), each with that chain; hooked when the chain is rendered.
pub const HOOKS: [(&str, &str); 3] = [
    ("FORWARD", FORWARD_CHAIN),
    ("INPUT", INPUT_CHAIN),
    ("OUTPUT", OUTPUT_CHAIN),
];
/// The suffix of the temporary set a changed set is built in.
pub const TEMP_SUFFIX: &str = "-t";

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `name` is a chain this agent makes: its exact shape, not
/// just the prefix.
pub fn is_own_chain(name: &str) -> bool {
    if [TUNNEL_CHAIN, LIMITED_CHAIN, LIMITED_DROP_CHAIN].contains(&name)
        || HOOKS.iter().any(|(_, own)| *own == name)
    {
        return true;
    }
    name.strip_prefix(OWN_PREFIX)
        .and_then(|rest| rest.split_once('-'))
        .is_some_and(|(kind, hash)| {
            let mut letters = kind.chars();
            let letter = letters.next();
            letters.next().is_none()
                && ChainKind::ALL.iter().any(|k| Some(k.letter()) == letter)
                && is_hex(hash, 16)
        })
}

/// Whether `name` is a set this agent makes (a temporary one included).
pub fn is_own_set(name: &str) -> bool {
    let name = name.strip_suffix(TEMP_SUFFIX).unwrap_or(name);
    let Some(rest) = name.strip_prefix(OWN_PREFIX) else {
        return false;
    };
    let mut parts = rest.split('-');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next()),
        (Some("I" | "C" | "W" | "L"), Some(hash), Some("4" | "6"), None) if is_hex(hash, 16)
    )
}

/// The FORWARD chain of the earlier naming (`PA` prefix, 32-bit hashes).
pub const LEGACY_FORWARD_CHAIN: &str = "PA-FORWARD";

/// Whether `name` has the exact shape of a chain of the earlier naming.
/// Such chains are removed only where [`LEGACY_FORWARD_CHAIN`] exists (an
/// agent of that version ran here), so a foreign `PA-…` elsewhere is safe.
pub fn is_legacy_chain(name: &str) -> bool {
    name == LEGACY_FORWARD_CHAIN
        || name
            .strip_prefix("PA-")
            .and_then(|rest| rest.split_once('-'))
            .is_some_and(|(kind, hash)| matches!(kind, "I" | "E" | "P") && is_hex(hash, 8))
}

/// Whether `name` has the exact shape of a set of the earlier naming.
pub fn is_legacy_set(name: &str) -> bool {
    let name = name.strip_suffix(TEMP_SUFFIX).unwrap_or(name);
    let Some(rest) = name.strip_prefix("PA") else {
        return false;
    };
    let mut parts = rest.split('-');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next()),
        (Some("I" | "C" | "W"), Some(hash), Some("v4" | "v6"), None) if is_hex(hash, 8)
    )
}

impl Ruleset {
    /// An `ipset restore` script that replaces `names` atomically (built in
    /// a temporary set, then swapped in).
    pub fn ipset_script(&self, names: &[&String]) -> String {
        let mut out = String::new();
        for name in names {
            let Some(set) = self.sets.get(*name) else {
                continue;
            };
            let tmp = format!("{name}{TEMP_SUFFIX}");
            let create = |n: &str| {
                format!(
                    "create {n} {} family {} maxelem 1048576 -exist\n",
                    set.kind.ipset_type(),
                    set.family.ipset_family()
                )
            };
            out += &create(name);
            out += &create(&tmp);
            let _ = writeln!(out, "flush {tmp}");
            for (net, nomatch) in &set.entries {
                let _ = writeln!(out, "add {tmp} {}", set.entry_text(net, *nomatch));
            }
            let _ = writeln!(out, "swap {tmp} {name}\ndestroy {tmp}");
        }
        out
    }

    /// The whole ruleset as text, for review (`policy-agent render`).
    pub fn render_text(&self) -> String {
        let mut out = String::from("# ipset restore\n");
        let names: Vec<&String> = self.sets.keys().collect();
        out += &self.ipset_script(&names);
        for fam in Family::BOTH {
            let _ = writeln!(
                out,
                "\n# {} --noflush",
                if fam == Family::V4 {
                    "iptables-restore"
                } else {
                    "ip6tables-restore"
                }
            );
            out += "*filter\n";
            for chain in self.chains.get(&fam).into_iter().flatten() {
                let _ = writeln!(out, ":{} - [0:0]", chain.name);
            }
            for chain in self.chains.get(&fam).into_iter().flatten() {
                for rule in &chain.rules {
                    let _ = writeln!(out, "-A {} {rule}", chain.name);
                }
            }
            for (builtin, own) in HOOKS {
                let _ = writeln!(out, "-I {builtin} 1 -j {own}   # added once, if missing");
            }
            let _ = writeln!(out, "COMMIT");
        }
        for p in &self.problems {
            let _ = writeln!(out, "# not rendered as written: {p}");
        }
        out
    }
}
