//! What the iptables datapath installs, as data: sets and chains, and
//! their `ipset restore` / `iptables-restore` text.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use ipnet::IpNet;

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetKind {
    /// Pod addresses of one label identity.
    HashIp,
    /// Prefixes of an address class, with `nomatch` holes.
    HashNet,
}

impl SetKind {
    pub fn name(self) -> &'static str {
        match self {
            SetKind::HashIp => "hash:ip",
            SetKind::HashNet => "hash:net",
        }
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
        let base = match self.kind {
            SetKind::HashIp => net.addr().to_string(),
            SetKind::HashNet if net.prefix_len() == net.max_prefix_len() => net.addr().to_string(),
            SetKind::HashNet => net.to_string(),
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
    /// Pod chain name → (pod, its IPs): conntrack entries of these IPs are
    /// flushed when the chain (or a set it uses) changes.
    pub pod_chains: BTreeMap<String, (String, Vec<std::net::IpAddr>)>,
    /// Sets each policy chain references (for conntrack flushing on set
    /// changes; pod chains reach sets only through policy chains).
    pub chain_sets: BTreeMap<String, BTreeSet<String>>,
    /// Policy rule chains each pod chain jumps to.
    pub chain_refs: BTreeMap<String, BTreeSet<String>>,
}

/// The name of the chain the agent hooks into FORWARD.
pub const FORWARD_CHAIN: &str = "PA-FORWARD";
/// Prefix of every chain and set the agent owns.
pub const OWN_PREFIX: &str = "PA";

impl Ruleset {
    /// An `ipset restore` script that replaces `names` atomically (built in
    /// a temporary set, then swapped in).
    pub fn ipset_script(&self, names: &[&String]) -> String {
        let mut out = String::new();
        for name in names {
            let Some(set) = self.sets.get(*name) else {
                continue;
            };
            let tmp = format!("{name}-t");
            let create = |n: &str| {
                format!(
                    "create {n} {} family {} maxelem 1048576 -exist\n",
                    set.kind.name(),
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
            let _ = writeln!(
                out,
                "-I FORWARD 1 -j {FORWARD_CHAIN}   # added once, if missing\nCOMMIT"
            );
        }
        out
    }
}
