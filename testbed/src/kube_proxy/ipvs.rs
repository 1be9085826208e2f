//! IPVS mode, as kube-proxy's `pkg/proxy/ipvs/proxier.go` lays it out:
//! every ClusterIP, external IP and load-balancer IP of the family sits on
//! the dummy device `kube-ipvs0` (down, as kube-proxy leaves it) as a /32
//! or /128, so the kernel routes Service traffic to the node itself, where
//! IPVS (LOCAL_IN) picks a backend and forwards it by NAT (`ipvsadm -m`),
//! round robin. Virtual servers are kept in step with the cluster by one
//! `ipvsadm -R` per sync (added, changed, deleted; never
//! `ipvsadm-restore`, which clears the table first), addresses by
//! `ip addr`. `net.ipv4.vs.conntrack=1` as kube-proxy sets it.
//!
//! Left out: NodePorts (virtual servers on the node's addresses),
//! session affinity, and the helper iptables rules (masquerade of
//! off-cluster sources and hairpin, the IPVS access filter).
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use super::model::{Family, SvcPort, join_host_port};

/// The dummy device every Service address sits on.
pub const DUMMY: &str = policy_agent::netlink::IPVS_DUMMY;

/// One virtual server: protocol flag (`-t`, `-u`, `--sctp-service`),
/// "address:port".
pub type Virtual = (&'static str, String);

/// What one family's sync wants: the addresses on the dummy device and
/// the virtual servers with their real servers ("address:port").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub addresses: BTreeSet<IpAddr>,
    pub servers: BTreeMap<Virtual, BTreeSet<String>>,
}

fn flag(protocol: &str) -> &'static str {
    match protocol {
        "udp" => "-u",
        "sctp" => "--sctp-service",
        _ => "-t",
    }
}

/// The addresses and virtual servers of `ports` (one family's).
pub fn wanted(ports: &[SvcPort], family: Family) -> Wanted {
    let mut out = Wanted::default();
    for p in ports {
        let frontends: Vec<IpAddr> = std::iter::once(p.cluster_ip)
            .chain(p.external_ips.iter().copied())
            .chain(p.lb_ips.iter().copied())
            .filter(|ip| family.holds(ip))
            .collect();
        let reals: BTreeSet<String> = p
            .reachable()
            .iter()
            .map(|b| join_host_port(&b.address, b.port))
            .collect();
        for ip in frontends {
            out.addresses.insert(ip);
            // A Service without endpoints keeps its virtual server, empty:
            // IPVS answers nothing (kube-proxy's IPVS mode rejects through
            // its helper rules, left out here).
            out.servers.insert(
                (flag(p.protocol), join_host_port(&ip, p.port)),
                reals.clone(),
            );
        }
    }
    out
}

/// The `ipvsadm -R` input taking `old` to `new`: stale virtual
/// servers deleted, new ones added (round robin), real servers added and
/// removed (masquerading, i.e. NAT).
pub fn restore(old: &Wanted, new: &Wanted) -> String {
    let mut out = String::new();
    for v in old.servers.keys().filter(|v| !new.servers.contains_key(*v)) {
        let _ = writeln!(out, "-D {} {}", v.0, v.1);
    }
    for (v, reals) in &new.servers {
        let before = old.servers.get(v);
        if before.is_none() {
            let _ = writeln!(out, "-A {} {} -s rr", v.0, v.1);
        }
        let before = before.cloned().unwrap_or_default();
        for r in before.difference(reals) {
            let _ = writeln!(out, "-d {} {} -r {r}", v.0, v.1);
        }
        for r in reals.difference(&before) {
            let _ = writeln!(out, "-a {} {} -r {r} -m -w 1", v.0, v.1);
        }
    }
    out
}

/// The prefix length of a host address of `ip`'s family.
pub fn host_prefix(ip: &IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_adds_changes_and_deletes() {
        let a: IpAddr = "10.96.0.50".parse().unwrap();
        let mut old = Wanted::default();
        old.addresses.insert(a);
        old.servers.insert(
            ("-t", "10.96.0.50:80".into()),
            ["10.244.1.10:8080".to_owned(), "10.244.2.10:8080".into()].into(),
        );
        old.servers
            .insert(("-u", "10.96.0.50:81".into()), BTreeSet::new());
        let mut new = old.clone();
        new.servers.remove(&("-u", "10.96.0.50:81".into()));
        new.servers.insert(
            ("-t", "10.96.0.50:80".into()),
            ["10.244.1.10:8080".to_owned(), "10.244.2.11:8080".into()].into(),
        );
        new.servers.insert(
            ("-t", "[fd00:96::50]:80".into()),
            ["[fd00:244:1::10]:8080".to_owned()].into(),
        );
        assert_eq!(
            restore(&old, &new),
            "-D -u 10.96.0.50:81\n\
             -d -t 10.96.0.50:80 -r 10.244.2.10:8080\n\
             -a -t 10.96.0.50:80 -r 10.244.2.11:8080 -m -w 1\n\
             -A -t [fd00:96::50]:80 -s rr\n\
             -a -t [fd00:96::50]:80 -r [fd00:244:1::10]:8080 -m -w 1\n"
        );
        assert_eq!(restore(&new, &new), "");
    }
}
