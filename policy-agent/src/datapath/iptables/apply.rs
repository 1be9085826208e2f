//! Applying a ruleset: read what is installed, write only what differs,
//! atomically (`ipset restore` with swap, `iptables-restore --noflush` for
//! the agent's chains only), flush conntrack for pods whose rules changed,
//! and `reset`.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use tracing::{debug, warn};

use super::{
    Error,
    ruleset::{Chain, FORWARD_CHAIN, Family, OWN_PREFIX, Ruleset},
};
use crate::{exec, mapstate::fnv1a64};

/// Which iptables binaries to drive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// Whatever `iptables` is on this machine.
    #[default]
    Auto,
    Nft,
    Legacy,
}

fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, Error> {
    Ok(exec::run_with_input(program, args, stdin)?)
}

/// What is installed now, as far as the agent's objects go.
#[derive(Debug, Default)]
struct Installed {
    sets: BTreeMap<String, BTreeSet<(IpNet, bool)>>,
    /// Per family: chain → its content hash (from the marker rule).
    chains: BTreeMap<Family, BTreeMap<String, String>>,
    /// Per family: whether FORWARD jumps to PA-FORWARD.
    hooked: BTreeMap<Family, bool>,
}

fn parse_entry(text: &str) -> Option<(IpNet, bool)> {
    let mut parts = text.split_whitespace();
    let addr = parts.next()?;
    let nomatch = parts.any(|p| p == "nomatch");
    let net = match addr.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => IpNet::from(addr.parse::<IpAddr>().ok()?),
    };
    Some((net, nomatch))
}

/// The content hash of a chain, carried by its first rule (a no-op
/// comment), so "unchanged" is decided without parsing iptables-save's
/// canonical form of every rule.
fn chain_hash(chain: &Chain) -> String {
    format!("{:016x}", fnv1a64(chain.rules.join("\n").as_bytes()))
}

const MARKER: &str = "policy-agent:";

/// What one apply did.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub sets_written: usize,
    pub chains_written: usize,
    pub chains_removed: usize,
    pub conntrack_flushed: Vec<IpAddr>,
}

impl ApplyReport {
    pub fn wrote_anything(&self) -> bool {
        self.sets_written + self.chains_written + self.chains_removed > 0
    }
}

/// What reset removed.
#[derive(Debug, Default)]
pub struct ResetReport {
    pub chains: usize,
    pub sets: usize,
}

pub struct Executor {
    pub backend: Backend,
}

impl Executor {
    pub fn new(backend: Backend) -> Self {
        Self { backend }
    }

    fn tables(&self, fam: Family, what: &str) -> String {
        let base = match fam {
            Family::V4 => format!("iptables{what}"),
            Family::V6 => format!("ip6tables{what}"),
        };
        match self.backend {
            Backend::Auto => base,
            Backend::Nft => format!("{}-nft{}", base.trim_end_matches(what), what),
            Backend::Legacy => format!("{}-legacy{}", base.trim_end_matches(what), what),
        }
    }

    /// Fails early and clearly when a tool is missing.
    pub fn check(&self) -> Result<(), Error> {
        run("ipset", &["version"], None)?;
        for fam in Family::BOTH {
            run(&self.tables(fam, "-save"), &["-t", "filter"], None)?;
        }
        Ok(())
    }

    fn installed(&self) -> Result<Installed, Error> {
        let mut inst = Installed::default();
        for line in run("ipset", &["save"], None)?.lines() {
            let mut parts = line.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("create"), Some(name), _) if name.starts_with(OWN_PREFIX) => {
                    inst.sets.entry(name.to_owned()).or_default();
                }
                (Some("add"), Some(name), Some(rest)) if name.starts_with(OWN_PREFIX) => {
                    if let Some(e) = parse_entry(rest) {
                        inst.sets.entry(name.to_owned()).or_default().insert(e);
                    }
                }
                _ => {}
            }
        }
        for fam in Family::BOTH {
            let text = run(&self.tables(fam, "-save"), &["-t", "filter"], None)?;
            let chains = inst.chains.entry(fam).or_default();
            let mut hooked = false;
            for line in text.lines() {
                if let Some(name) = line
                    .strip_prefix(':')
                    .and_then(|l| l.split_whitespace().next())
                    && name.starts_with("PA-")
                {
                    chains.entry(name.to_owned()).or_default();
                } else if let Some(rest) = line.strip_prefix("-A ") {
                    let mut it = rest.splitn(2, ' ');
                    let (chain, rule) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
                    if chain == "FORWARD" && rule.contains(&format!("-j {FORWARD_CHAIN}")) {
                        hooked = true;
                    }
                    if chain.starts_with("PA-")
                        && let Some(pos) = rule.find(MARKER)
                    {
                        let hash: String = rule[pos + MARKER.len()..]
                            .chars()
                            .take_while(char::is_ascii_hexdigit)
                            .collect();
                        chains.insert(chain.to_owned(), hash);
                    }
                }
            }
            inst.hooked.insert(fam, hooked);
        }
        Ok(inst)
    }

    /// Makes the installed state equal `desired`, writing nothing when it
    /// already is.
    pub fn apply(&self, desired: &Ruleset) -> Result<ApplyReport, Error> {
        let inst = self.installed()?;
        let mut report = ApplyReport::default();

        // 1. Sets that are new or differ, swapped in atomically.
        let changed_sets: Vec<&String> = desired
            .sets
            .iter()
            .filter(|(name, set)| inst.sets.get(*name) != Some(&set.entries))
            .map(|(n, _)| n)
            .collect();
        if !changed_sets.is_empty() {
            run(
                "ipset",
                &["restore"],
                Some(&desired.ipset_script(&changed_sets)),
            )?;
            report.sets_written = changed_sets.len();
        }

        // 2. Chains, per family, in one iptables-restore transaction each.
        let mut changed_chains: BTreeSet<String> = BTreeSet::new();
        for fam in Family::BOTH {
            let want: Vec<&Chain> = desired
                .chains
                .get(&fam)
                .map(|v| v.iter().collect())
                .unwrap_or_default();
            let have = inst.chains.get(&fam).cloned().unwrap_or_default();
            let names: BTreeSet<&str> = want.iter().map(|c| c.name.as_str()).collect();
            let stale: Vec<&String> = have
                .keys()
                .filter(|n| !names.contains(n.as_str()))
                .collect();
            let dirty: Vec<(&Chain, String)> = want
                .iter()
                .map(|c| (*c, chain_hash(c)))
                .filter(|(c, hash)| have.get(&c.name) != Some(hash))
                .collect();
            let hooked = inst.hooked.get(&fam).copied().unwrap_or(false);
            if dirty.is_empty() && stale.is_empty() && hooked {
                continue;
            }
            let mut text = String::from("*filter\n");
            for (c, _) in &dirty {
                text += &format!(":{} - [0:0]\n", c.name);
            }
            for name in &stale {
                text += &format!(":{name} - [0:0]\n");
            }
            for (c, hash) in &dirty {
                text += &format!("-A {} -m comment --comment \"{MARKER}{hash}\"\n", c.name);
                for rule in &c.rules {
                    text += &format!("-A {} {rule}\n", c.name);
                }
                changed_chains.insert(c.name.clone());
            }
            for name in &stale {
                text += &format!("-X {name}\n");
            }
            if !hooked {
                text += &format!("-I FORWARD 1 -j {FORWARD_CHAIN}\n");
            }
            text += "COMMIT\n";
            debug!(family = ?fam, "iptables-restore:\n{text}");
            run(&self.tables(fam, "-restore"), &["--noflush"], Some(&text))?;
            report.chains_written += dirty.len();
            report.chains_removed += stale.len();
        }

        // 3. Sets nothing references any more.
        for name in inst.sets.keys().filter(|n| !desired.sets.contains_key(*n)) {
            if let Err(e) = run("ipset", &["destroy", name], None) {
                warn!(set = %name, error = %e, "could not destroy a stale set");
            }
        }

        // 4. Established flows of pods whose rules or peer sets changed.
        let changed: BTreeSet<&String> = changed_sets.iter().copied().collect();
        for (chain, (pod, ips)) in &desired.pod_chains {
            // Pod chains jump to policy chains; only those use sets.
            let refs = desired.chain_refs.get(chain).into_iter().flatten();
            let policy_changed = refs.clone().any(|c| changed_chains.contains(c));
            let uses_changed = refs
                .filter_map(|c| desired.chain_sets.get(c))
                .any(|sets| sets.iter().any(|s| changed.contains(s)));
            if !(changed_chains.contains(chain) || uses_changed || policy_changed) {
                continue;
            }
            let side = if chain.starts_with("PA-I-") {
                "-d"
            } else {
                "-s"
            };
            for ip in ips {
                // Exit status 1 means "no entries": not an error.
                match run("conntrack", &["-D", side, &ip.to_string()], None) {
                    Ok(_) | Err(Error::Command(exec::CommandError::Failed { .. })) => {
                        report.conntrack_flushed.push(*ip)
                    }
                    Err(e) => {
                        warn!(pod, error = %e, "cannot flush conntrack; established flows keep their verdict");
                        break;
                    }
                }
            }
        }
        Ok(report)
    }

    /// Removes every chain and set the agent owns (and its FORWARD jump),
    /// nothing else.
    pub fn reset(&self) -> Result<ResetReport, Error> {
        let inst = self.installed()?;
        let mut report = ResetReport::default();
        for fam in Family::BOTH {
            let chains = inst.chains.get(&fam).cloned().unwrap_or_default();
            let hooked = inst.hooked.get(&fam).copied().unwrap_or(false);
            if chains.is_empty() && !hooked {
                continue;
            }
            let mut text = String::from("*filter\n");
            if hooked {
                text += &format!("-D FORWARD -j {FORWARD_CHAIN}\n");
            }
            for name in chains.keys() {
                text += &format!(":{name} - [0:0]\n");
            }
            for name in chains.keys() {
                text += &format!("-X {name}\n");
            }
            text += "COMMIT\n";
            run(&self.tables(fam, "-restore"), &["--noflush"], Some(&text))?;
            report.chains += chains.len();
        }
        for name in inst.sets.keys() {
            run("ipset", &["destroy", name], None)?;
            report.sets += 1;
        }
        Ok(report)
    }
}
