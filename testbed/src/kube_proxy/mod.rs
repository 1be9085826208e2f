//! A kube-proxy stand-in for the simulated nodes: from the cluster model
//! (Services, EndpointSlices, the node's name and addresses, the cluster
//! CIDR) it writes exactly the rules kube-proxy writes, in iptables mode
//! (`iptables-restore --noflush` per family plus the jump rules) or
//! nftables mode (`ip`/`ip6 kube-proxy` tables by `nft -f`), or IPVS
//! mode (Service addresses on the `kube-ipvs0` dummy device, virtual
//! servers by `ipvsadm -R`; needs the `ip_vs` module, see
//! [`ipvs_missing`]), into one node's network namespace. Backends are chosen by
//! [`policy_agent::cluster::backends`], the same choice the agent models.
//!
//! Every sync is a full sync, atomic as kube-proxy's: one restore per
//! family that flushes and refills every chain and deletes stale ones, or
//! one nft transaction that flushes and refills the table. UDP conntrack
//! entries towards endpoints that went away are deleted, as kube-proxy
//! does. [`KubeProxy::remove`] (also on drop) deletes exactly what it
//! installed.
mod chain_names;
mod iptables;
mod ipvs;
mod model;
mod nft;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use ipnet::IpNet;

pub use self::chain_names::{
    base32, endpoint_hash, hash_and_truncate, nft_endpoint_base, nft_service_base, port_proto_hash,
    sha256,
};
use self::model::{SvcPort, join_host_port};
pub use self::{
    iptables::{JUMPS, Jump},
    model::Family,
};
use crate::{Error, NetNs};
use policy_agent::cluster::ClusterState;

/// Which kube-proxy backend to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    Iptables,
    Nftables,
    Ipvs,
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
            Self::Ipvs => "ipvs",
        })
    }
}

/// What kube-proxy is started with on one node.
#[derive(Clone, Debug, Default)]
pub struct ProxyConfig {
    /// `--hostname-override`: decides which endpoints are local.
    pub node_name: String,
    /// The node's addresses: a family runs only if the node has one.
    pub node_ips: Vec<IpAddr>,
    /// `--cluster-cidr` (detect-local mode ClusterCIDR), one per family;
    /// without one, off-cluster sources to a ClusterIP are not
    /// masqueraded and Local external policies have no pod short circuit.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--service-cluster-ip-range`: nftables mode drops traffic to
    /// unallocated ClusterIPs in it.
    pub service_cidrs: Vec<IpNet>,
}

impl ProxyConfig {
    fn families(&self) -> Vec<Family> {
        let mut f: Vec<Family> = self.node_ips.iter().map(Family::of).collect();
        f.sort();
        f.dedup();
        f
    }

    fn cluster_cidr(&self, family: Family) -> Option<&IpNet> {
        self.cluster_cidrs
            .iter()
            .find(|c| family.holds(&c.network()))
    }
}

/// The rules one family's first sync writes: the `iptables-restore`
/// input or the `nft -f` transaction (iptables mode's jump rules are
/// separate commands, [`JUMPS`]).
pub fn render(
    mode: ProxyMode,
    config: &ProxyConfig,
    state: &ClusterState,
    family: Family,
) -> String {
    let ports = model::service_ports(state, &config.node_name, family);
    let cidr = config.cluster_cidr(family);
    match mode {
        ProxyMode::Iptables => iptables::render(&ports, family, cidr, &BTreeSet::new()).restore,
        ProxyMode::Nftables => {
            nft::render(
                &ports,
                family,
                cidr,
                &config.service_cidrs,
                true,
                &BTreeSet::new(),
            )
            .transaction
        }
        ProxyMode::Ipvs => ipvs::restore(&ipvs::Wanted::default(), &ipvs::wanted(&ports, family)),
    }
}

/// Why this kernel cannot run IPVS mode (no `ip_vs`, after trying to load
/// it), or None.
pub fn ipvs_missing() -> Option<String> {
    let _ = std::process::Command::new("modprobe")
        .args(["-q", "ip_vs"])
        .status();
    let _ = std::process::Command::new("modprobe")
        .args(["-q", "ip_vs_rr"])
        .status();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    if !std::path::Path::new("/proc/net/ip_vs").exists() {
        return Some(format!(
            "kernel {} has no ip_vs (IPVS) module",
            release.trim()
        ));
    }
    None
}

#[derive(Debug, Default)]
struct Installed {
    /// Per-service chains the last sync wrote.
    chains: BTreeSet<String>,
    /// nft: chains flushed as stale, still to delete.
    stale: BTreeSet<String>,
    /// UDP service ports' frontends and endpoints (conntrack clean-up).
    udp: BTreeMap<String, UdpPort>,
    /// IPVS: the addresses and virtual servers the last sync left.
    ipvs: ipvs::Wanted,
    /// The text last applied.
    text: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct UdpPort {
    /// (address, port) frontends; a NodePort has no address.
    frontends: Vec<(Option<IpAddr>, u16)>,
    endpoints: BTreeSet<(IpAddr, u16)>,
}

fn udp_ports(ports: &[SvcPort]) -> BTreeMap<String, UdpPort> {
    ports
        .iter()
        .filter(|p| p.protocol == "udp")
        .map(|p| {
            let mut frontends = vec![(Some(p.cluster_ip), p.port)];
            frontends.extend(
                p.external_ips
                    .iter()
                    .chain(&p.lb_ips)
                    .map(|ip| (Some(*ip), p.port)),
            );
            frontends.extend(p.node_port.map(|np| (None, np)));
            let endpoints = p.reachable().iter().map(|b| (b.address, b.port)).collect();
            (
                p.spn.clone(),
                UdpPort {
                    frontends,
                    endpoints,
                },
            )
        })
        .collect()
}

/// kube-proxy running on one simulated node.
#[derive(Debug)]
pub struct KubeProxy {
    netns: String,
    mode: ProxyMode,
    config: ProxyConfig,
    installed: BTreeMap<Family, Installed>,
    removed: bool,
}

impl KubeProxy {
    /// Starts kube-proxy in `netns`: writes the rules of `state` for every
    /// family the node has an address of.
    pub fn install(
        netns: &NetNs,
        mode: ProxyMode,
        config: ProxyConfig,
        state: &ClusterState,
    ) -> Result<Self, Error> {
        if config.node_ips.is_empty() {
            return Err(Error::Invalid(
                "kube-proxy needs the node's addresses".into(),
            ));
        }
        let mut this = Self {
            netns: netns.name.clone(),
            mode,
            config,
            installed: BTreeMap::new(),
            removed: false,
        };
        // Dropped (and so removed) if a family fails.
        for family in this.config.families() {
            this.sync(family, state, true)?;
        }
        Ok(this)
    }

    /// Syncs to a changed cluster state (a Service gained or lost
    /// endpoints, was added or deleted), atomically per family.
    pub fn update(&mut self, state: &ClusterState) -> Result<(), Error> {
        for family in self.config.families() {
            self.sync(family, state, false)?;
        }
        Ok(())
    }

    pub fn mode(&self) -> ProxyMode {
        self.mode
    }

    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The restore input / nft transaction last applied, per family.
    pub fn rules(&self) -> String {
        self.installed
            .iter()
            .map(|(f, i)| format!("# {} {}\n{}", self.mode, f.name(), i.text))
            .collect()
    }

    /// Removes every rule, chain and table it installed.
    pub fn remove(mut self) -> Result<(), Error> {
        self.remove_all()
    }

    fn ns(&self) -> NetNs {
        NetNs::borrow(&self.netns)
    }

    fn sync(&mut self, family: Family, state: &ClusterState, first: bool) -> Result<(), Error> {
        let ports = model::service_ports(state, &self.config.node_name, family);
        let cidr = self.config.cluster_cidr(family).copied();
        let ns = self.ns();
        let installed = self.installed.entry(family).or_default();
        match self.mode {
            ProxyMode::Iptables => {
                let r = iptables::render(&ports, family, cidr.as_ref(), &installed.chains);
                feed(&ns, restore_program(family), &["--noflush"], &r.restore)?;
                installed.chains = r.service_chains;
                installed.text = r.restore;
                for j in &iptables::JUMPS {
                    let mut check = vec!["-w", "-t", j.table, "-C", j.from];
                    check.extend(j.args());
                    if ns.exec(iptables_program(family), &check).is_err() {
                        let mut insert = vec!["-w", "-t", j.table, "-I", j.from];
                        insert.extend(j.args());
                        ns.exec(iptables_program(family), &insert)?;
                    }
                }
            }
            ProxyMode::Nftables => {
                installed.delete_stale(&ns, family);
                let mut stale: BTreeSet<String> = installed.chains.clone();
                stale.extend(installed.stale.iter().cloned());
                let r = nft::render(
                    &ports,
                    family,
                    cidr.as_ref(),
                    &self.config.service_cidrs,
                    first,
                    &stale,
                );
                feed(&ns, "nft", &["-f", "-"], &r.transaction)?;
                let now_stale: BTreeSet<String> =
                    stale.difference(&r.service_chains).cloned().collect();
                installed.chains = r.service_chains;
                installed.text = r.transaction;
                // kube-proxy deletes stale chains a second later (kernels
                // before 6.2 see a chain as referenced a little longer);
                // try now, else on the next sync.
                installed.stale = now_stale;
                installed.delete_stale(&ns, family);
            }
            ProxyMode::Ipvs => {
                if first {
                    ipvs_node_setup(&ns)?;
                }
                let want = ipvs::wanted(&ports, family);
                // Addresses first: a virtual server's traffic reaches IPVS
                // only once its address is local.
                for ip in want.addresses.difference(&installed.ipvs.addresses) {
                    let a = format!("{ip}/{}", ipvs::host_prefix(ip));
                    ns.ip(&["addr", "add", &a, "dev", ipvs::DUMMY])?;
                }
                let text = ipvs::restore(&installed.ipvs, &want);
                if !text.is_empty() {
                    feed(&ns, "ipvsadm", &["-R"], &text)?;
                }
                for ip in installed.ipvs.addresses.difference(&want.addresses) {
                    let a = format!("{ip}/{}", ipvs::host_prefix(ip));
                    ns.ip(&["addr", "del", &a, "dev", ipvs::DUMMY])?;
                }
                installed.text = text;
                installed.ipvs = want;
            }
        }
        // conntrack: UDP flows to endpoints that are gone, and flows to a
        // port that had no endpoints, are deleted (CleanStaleEntries).
        let udp = udp_ports(&ports);
        let old = std::mem::replace(&mut installed.udp, udp.clone());
        for (spn, now) in &udp {
            let before = old.get(spn).cloned().unwrap_or_default();
            if before.endpoints == now.endpoints {
                continue;
            }
            for (front, port) in &now.frontends {
                let port = port.to_string();
                let mut base = vec!["-D".to_owned(), "-p".into(), "udp".into()];
                if let Some(ip) = front {
                    base.extend(["--orig-dst".into(), ip.to_string()]);
                }
                base.extend(["--orig-port-dst".into(), port]);
                if before.endpoints.is_empty() {
                    conntrack(&ns, &base);
                }
                for (ip, _) in before.endpoints.difference(&now.endpoints) {
                    let mut args = base.clone();
                    args.extend(["--reply-src".into(), ip.to_string()]);
                    conntrack(&ns, &args);
                }
            }
        }
        Ok(())
    }

    fn remove_all(&mut self) -> Result<(), Error> {
        if self.removed {
            return Ok(());
        }
        self.removed = true;
        let ns = self.ns();
        let mut first_error = None;
        for (family, installed) in std::mem::take(&mut self.installed) {
            let result = match self.mode {
                ProxyMode::Iptables => {
                    for j in &iptables::JUMPS {
                        let mut delete = vec!["-w", "-t", j.table, "-D", j.from];
                        delete.extend(j.args());
                        // Absent already (never inserted, or flushed).
                        let _ = ns.exec(iptables_program(family), &delete);
                    }
                    let mut restore = String::from("*filter\n");
                    let declare = |out: &mut String, chains: &[&str]| {
                        for c in chains {
                            out.push_str(&format!(":{c} - [0:0]\n"));
                        }
                        for c in chains {
                            out.push_str(&format!("-X {c}\n"));
                        }
                    };
                    declare(&mut restore, &iptables::FILTER_CHAINS);
                    restore.push_str("COMMIT\n*nat\n");
                    let mut nat: Vec<&str> = iptables::NAT_CHAINS.to_vec();
                    nat.extend(installed.chains.iter().map(String::as_str));
                    declare(&mut restore, &nat);
                    restore.push_str("COMMIT\n");
                    feed(&ns, restore_program(family), &["--noflush"], &restore)
                }
                ProxyMode::Nftables => feed(
                    &ns,
                    "nft",
                    &["-f", "-"],
                    &format!(
                        "delete table {} {}\n",
                        nft::table_family(family),
                        nft::TABLE
                    ),
                ),
                ProxyMode::Ipvs => {
                    let text = ipvs::restore(&installed.ipvs, &ipvs::Wanted::default());
                    if text.is_empty() {
                        Ok(())
                    } else {
                        feed(&ns, "ipvsadm", &["-R"], &text)
                    }
                }
            };
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        // The device, and every address on it, goes with the last family.
        if self.mode == ProxyMode::Ipvs
            && let Err(e) = ns.ip(&["link", "del", ipvs::DUMMY])
        {
            first_error.get_or_insert(e);
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        let _ = self.remove_all();
    }
}

/// The node as kube-proxy's IPVS mode leaves it before its first sync:
/// the dummy device (down) and the sysctls it sets.
fn ipvs_node_setup(ns: &NetNs) -> Result<(), Error> {
    if ns.ip(&["link", "show", ipvs::DUMMY]).is_err() {
        ns.ip(&["link", "add", ipvs::DUMMY, "type", "dummy"])?;
    }
    for s in [
        "net.ipv4.vs.conntrack=1",
        "net.ipv4.vs.expire_nodest_conn=1",
        "net.ipv4.vs.expire_quiescent_template=1",
    ] {
        ns.exec("sysctl", &["-q", "-w", s])?;
    }
    Ok(())
}

fn iptables_program(family: Family) -> &'static str {
    match family {
        Family::V4 => "iptables",
        Family::V6 => "ip6tables",
    }
}

fn restore_program(family: Family) -> &'static str {
    match family {
        Family::V4 => "iptables-restore",
        Family::V6 => "ip6tables-restore",
    }
}

impl Installed {
    /// nft: deletes the chains flushed as stale; what the kernel still
    /// sees as referenced is tried again on the next sync.
    fn delete_stale(&mut self, ns: &NetNs, family: Family) {
        if !self.stale.is_empty()
            && feed(
                ns,
                "nft",
                &["-f", "-"],
                &nft::delete_chains(family, &self.stale),
            )
            .is_ok()
        {
            self.stale.clear();
        }
    }
}

/// Runs `program args` inside `ns` with `input` on stdin.
fn feed(ns: &NetNs, program: &str, args: &[&str], input: &str) -> Result<(), Error> {
    let mut cmd = ns.command(program);
    cmd.args(args);
    policy_agent::exec::output(&mut cmd, Some(input))?;
    Ok(())
}

/// `conntrack -D ...`; finding nothing to delete is no failure.
fn conntrack(ns: &NetNs, args: &[String]) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _ = ns.exec("conntrack", &args);
}

/// What of kube-proxy is left in a network namespace: every iptables
/// line naming a KUBE- chain (both families) and any kube-proxy nft table.
pub fn leftovers(netns: &NetNs) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    for program in ["iptables-save", "ip6tables-save"] {
        let text = netns.exec(program, &[])?;
        out.extend(
            text.lines()
                .filter(|l| l.contains("KUBE-"))
                .map(|l| format!("{program}: {l}")),
        );
    }
    let tables = netns.exec("nft", &["list", "tables"])?;
    out.extend(
        tables
            .lines()
            .filter(|l| l.contains(nft::TABLE))
            .map(|l| format!("nft: {l}")),
    );
    if netns.ip(&["link", "show", ipvs::DUMMY]).is_ok() {
        out.push(format!("link {}", ipvs::DUMMY));
    }
    // Without ip_vs in the kernel there are no virtual servers to list.
    if let Ok(text) = netns.exec("ipvsadm", &["-Ln"]) {
        out.extend(
            text.lines()
                .filter(|l| l.starts_with("TCP") || l.starts_with("UDP") || l.starts_with("SCTP"))
                .map(|l| format!("ipvsadm: {l}")),
        );
    }
    Ok(out)
}

/// The endpoint string kube-proxy hashes and sorts by ("ip:port").
pub fn endpoint_string(ip: &IpAddr, port: u16) -> String {
    join_host_port(ip, port)
}

#[cfg(test)]
mod tests;
