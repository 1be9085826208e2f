//! Applying a ruleset: read what is installed, write only what differs,
//! atomically (`ipset restore` with swap, `iptables-restore --noflush` for
//! the agent's chains only), flush conntrack for pods whose rules changed,
//! and `reset`. An installed chain or set is the agent's only if its name
//! has the exact shape the agent gives (`ruleset::is_own_chain`,
//! `is_own_set`); those of the earlier `PA…` naming are removed only where
//! that version's FORWARD chain shows it ran.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use tracing::{debug, warn};

use super::{
    Error,
    ruleset::{
        Chain, Family, HOOKS, LEGACY_FORWARD_CHAIN, Ruleset, is_legacy_chain, is_legacy_set,
        is_own_chain, is_own_set,
    },
};
use crate::{
    cluster::PodRef,
    exec,
    mapstate::fnv1a64,
    netlink::conntrack::{self, FlowSide, MarkReport},
};

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
    /// Per family: the agent's chains their built-in chain jumps to
    /// (see [`HOOKS`]).
    hooked: BTreeMap<Family, BTreeSet<&'static str>>,
    /// Objects of the earlier naming, to remove (see [`Legacy`]).
    legacy: Legacy,
}

/// Chains and sets of the earlier naming (`PA-FORWARD`, `PA-I-<8 hex>`,
/// `PAI-<8 hex>-v4`), left by an agent of that version: counted as ours
/// only where its `PA-FORWARD` chain exists, so a foreign `PA…` object on
/// a node that never ran it is never touched.
#[derive(Debug, Default)]
struct Legacy {
    /// Per family: the chains, and whether FORWARD jumps to PA-FORWARD.
    chains: BTreeMap<Family, (BTreeSet<String>, bool)>,
    sets: BTreeSet<String>,
}

impl Installed {
    /// Whether `fam`'s built-in chain jumps to the agent's chain `own`.
    fn is_hooked(&self, fam: Family, own: &str) -> bool {
        self.hooked.get(&fam).is_some_and(|h| h.contains(own))
    }
}

impl Legacy {
    /// The iptables-restore lines that unhook and delete `fam`'s chains.
    fn removal(&self, fam: Family) -> String {
        let Some((chains, hooked)) = self.chains.get(&fam) else {
            return String::new();
        };
        let mut text = String::new();
        if *hooked {
            text += &format!("-D FORWARD -j {LEGACY_FORWARD_CHAIN}\n");
        }
        for name in chains {
            text += &format!(":{name} - [0:0]\n");
        }
        for name in chains {
            text += &format!("-X {name}\n");
        }
        text
    }
}

/// Whether a FORWARD rule (as iptables-save prints it) jumps to `chain`.
fn jumps_to(rule: &str, chain: &str) -> bool {
    let words: Vec<&str> = rule.split_whitespace().collect();
    words.windows(2).any(|w| w[0] == "-j" && w[1] == chain)
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
    /// Conntrack deletions that failed: those pods' established flows keep
    /// their old verdict until a later apply retries them.
    pub conntrack_failed: Vec<(PodRef, IpAddr, String)>,
}

impl ApplyReport {
    pub fn wrote_anything(&self) -> bool {
        self.sets_written + self.chains_written + self.chains_removed > 0
    }
}

/// A conntrack revocation: which side of a flow the address is on.
type Flush = (FlowSide, IpAddr);

/// Revokes the conntrack entries of `flushes` (an address as the flow's
/// original source, original destination, or reply source for a backend
/// behind DNAT): sets the agent's connmark bit (`mark`) on them, the
/// other bits kept. A revoked flow's replies wait and its next
/// original-direction packet is judged again (see the FORWARD rules).
/// Deleting the entries instead let the kernel pick the flow up again in
/// the name of whichever side spoke first — the pod whose ingress had
/// just closed, answering, made it its own flow and the peer rode it back
/// in.
///
/// Over ctnetlink, one dump for all of them (see `netlink::conntrack`:
/// `conntrack -U` failed once a few hundred entries matched). A failure
/// is tried again a few times before it is reported (and kept for the
/// next apply to retry): setting the bit is idempotent.
fn revoke_conntrack(flushes: &[Flush], mark: u32) -> Result<MarkReport, Error> {
    const ATTEMPTS: u32 = 4;
    let mut attempt = 1;
    loop {
        match conntrack::mark_flows(flushes, mark) {
            Ok(report) => return Ok(report),
            Err(e) if attempt >= ATTEMPTS => return Err(e.into()),
            Err(e) => {
                debug!(attempt, error = %e, "conntrack revocation failed; trying again");
                std::thread::sleep(std::time::Duration::from_millis(10 * u64::from(attempt)));
                attempt += 1;
            }
        }
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
    /// Conntrack deletions that failed, by flow side and address (with the
    /// pod): retried by the next apply, whether or not its rules changed.
    pending_flushes: BTreeMap<Flush, PodRef>,
}

impl Executor {
    pub fn new(backend: Backend) -> Self {
        Self {
            backend,
            pending_flushes: BTreeMap::new(),
        }
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
        let mut legacy_sets = BTreeSet::new();
        for line in run("ipset", &["save"], None)?.lines() {
            let mut parts = line.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("create"), Some(name), _) if is_own_set(name) => {
                    inst.sets.entry(name.to_owned()).or_default();
                }
                (Some("add"), Some(name), Some(rest)) if is_own_set(name) => {
                    if let Some(e) = parse_entry(rest) {
                        inst.sets.entry(name.to_owned()).or_default().insert(e);
                    }
                }
                (Some("create"), Some(name), _) if is_legacy_set(name) => {
                    legacy_sets.insert(name.to_owned());
                }
                _ => {}
            }
        }
        for fam in Family::BOTH {
            let text = run(&self.tables(fam, "-save"), &["-t", "filter"], None)?;
            let chains = inst.chains.entry(fam).or_default();
            let mut hooked = BTreeSet::new();
            let mut legacy_chains = BTreeSet::new();
            let mut legacy_hooked = false;
            for line in text.lines() {
                if let Some(name) = line
                    .strip_prefix(':')
                    .and_then(|l| l.split_whitespace().next())
                {
                    if is_own_chain(name) {
                        chains.entry(name.to_owned()).or_default();
                    } else if is_legacy_chain(name) {
                        legacy_chains.insert(name.to_owned());
                    }
                } else if let Some(rest) = line.strip_prefix("-A ") {
                    let mut it = rest.splitn(2, ' ');
                    let (chain, rule) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
                    for (builtin, own) in HOOKS {
                        if chain == builtin && jumps_to(rule, own) {
                            hooked.insert(own);
                        }
                    }
                    if chain == "FORWARD" {
                        legacy_hooked |= jumps_to(rule, LEGACY_FORWARD_CHAIN);
                    }
                    if is_own_chain(chain)
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
            if legacy_chains.contains(LEGACY_FORWARD_CHAIN) {
                inst.legacy
                    .chains
                    .insert(fam, (legacy_chains, legacy_hooked));
            }
        }
        if !inst.legacy.chains.is_empty() {
            inst.legacy.sets = legacy_sets;
        }
        Ok(inst)
    }

    /// The ranges of the installed pod-range guard: the leading drops of
    /// the agent's FORWARD chain (`-s <range> ... "pa-agent: unenforced"`).
    pub fn installed_pod_ranges(&self) -> Result<Vec<IpNet>, Error> {
        let mut out = Vec::new();
        for fam in Family::BOTH {
            let text = run(&self.tables(fam, "-save"), &["-t", "filter"], None)?;
            out.extend(super::pod_range_guard::installed_ranges(&text));
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Makes the installed state equal `desired`, writing nothing when it
    /// already is.
    pub fn apply(&mut self, desired: &Ruleset) -> Result<ApplyReport, Error> {
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
            // A chain that is not rendered needs no hook.
            let unhooked: Vec<(&str, &str)> = HOOKS
                .into_iter()
                .filter(|(_, own)| names.contains(own) && !inst.is_hooked(fam, own))
                .collect();
            let legacy = inst.legacy.removal(fam);
            if dirty.is_empty() && stale.is_empty() && unhooked.is_empty() && legacy.is_empty() {
                continue;
            }
            // The earlier naming's chains go in the same transaction.
            let mut text = String::from("*filter\n");
            text += &legacy;
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
            for (builtin, own) in unhooked {
                text += &format!("-I {builtin} 1 -j {own}\n");
            }
            text += "COMMIT\n";
            debug!(family = ?fam, "iptables-restore:\n{text}");
            run(&self.tables(fam, "-restore"), &["--noflush"], Some(&text))?;
            report.chains_written += dirty.len();
            report.chains_removed += stale.len();
        }

        // 3. Sets nothing references any more.
        for name in inst
            .sets
            .keys()
            .filter(|n| !desired.sets.contains_key(*n))
            .chain(&inst.legacy.sets)
        {
            if let Err(e) = run("ipset", &["destroy", name], None) {
                warn!(set = %name, error = %e, "could not destroy a stale set");
            }
        }

        // 4. Established flows of pods whose rules or peer sets changed, and
        // the deletions an earlier apply could not do.
        let changed: BTreeSet<&String> = changed_sets.iter().copied().collect();
        let mut flushes = std::mem::take(&mut self.pending_flushes);
        for (chain, (pod, dir, ips)) in &desired.pod_chains {
            // Pod chains jump to policy chains; only those use sets.
            let refs = desired.chain_refs.get(chain).into_iter().flatten();
            let policy_changed = refs.clone().any(|c| changed_chains.contains(c));
            let uses_changed = refs
                .filter_map(|c| desired.chain_sets.get(c))
                .any(|sets| sets.iter().any(|s| changed.contains(s)));
            if !(changed_chains.contains(chain) || uses_changed || policy_changed) {
                continue;
            }
            // Ingress: flows to the pod, directly (`-d`) or through a
            // Service's DNAT, where the pod answers (`--reply-src`).
            let sides: &[FlowSide] = if *dir == policy_common::direction::INGRESS {
                &[FlowSide::OrigDst, FlowSide::ReplySrc]
            } else {
                &[FlowSide::OrigSrc]
            };
            for ip in ips {
                for side in sides {
                    flushes.insert((*side, *ip), pod.clone());
                }
            }
        }
        let mark = if desired.mark == 0 {
            super::DEFAULT_MARK
        } else {
            desired.mark
        };
        if flushes.is_empty() {
            return Ok(report);
        }
        let targets: Vec<Flush> = flushes.keys().copied().collect();
        match revoke_conntrack(&targets, mark) {
            Ok(done) => {
                for ((side, ip), n) in &done.marked {
                    debug!(%ip, ?side, flows = n, "conntrack entries marked for re-judgement");
                    if !report.conntrack_flushed.contains(ip) {
                        report.conntrack_flushed.push(*ip);
                    }
                }
            }
            Err(e) => {
                for ((side, ip), pod) in flushes {
                    warn!(pod = %pod, %ip, error = %e, "cannot revoke conntrack entries; established flows keep their verdict until the retry");
                    report
                        .conntrack_failed
                        .push((pod.clone(), ip, e.to_string()));
                    self.pending_flushes.insert((side, ip), pod);
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
            let hooked: Vec<(&str, &str)> = HOOKS
                .into_iter()
                .filter(|(_, own)| inst.is_hooked(fam, own))
                .collect();
            let legacy = inst.legacy.removal(fam);
            if chains.is_empty() && hooked.is_empty() && legacy.is_empty() {
                continue;
            }
            let mut text = String::from("*filter\n");
            for (builtin, own) in hooked {
                text += &format!("-D {builtin} -j {own}\n");
            }
            text += &legacy;
            for name in chains.keys() {
                text += &format!(":{name} - [0:0]\n");
            }
            for name in chains.keys() {
                text += &format!("-X {name}\n");
            }
            text += "COMMIT\n";
            run(&self.tables(fam, "-restore"), &["--noflush"], Some(&text))?;
            report.chains += chains.len()
                + inst
                    .legacy
                    .chains
                    .get(&fam)
                    .map_or(0, |(chains, _)| chains.len());
        }
        for name in inst.sets.keys().chain(&inst.legacy.sets) {
            run("ipset", &["destroy", name], None)?;
            report.sets += 1;
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::iptables::FORWARD_CHAIN;

    #[test]
    fn a_jump_is_matched_by_its_whole_target() {
        assert!(jumps_to("-j pa-agent:FORWARD", FORWARD_CHAIN));
        assert!(!jumps_to("-j pa-agent:FORWARDER", FORWARD_CHAIN));
        assert!(!jumps_to("-j PA-FORWARDER", LEGACY_FORWARD_CHAIN));
        assert!(jumps_to(
            "-m comment --comment x -j PA-FORWARD",
            LEGACY_FORWARD_CHAIN
        ));
    }
}
