//! iptables mode: the `iptables-restore --noflush` input kube-proxy's
//! `syncProxyRules` writes (a full sync), and its jump rules.
use std::{collections::BTreeSet, fmt::Write as _};

use ipnet::IpNet;

use super::{
    chain_names::{endpoint_hash, port_proto_hash},
    model::{Family, SvcPort, join_host_port},
};
use policy_agent::cluster::Backend;

/// kube-proxy's masquerade mark (`1 << 14`, `%#08x`).
pub const MASQ_MARK: &str = "0x004000";

pub const FILTER_CHAINS: [&str; 5] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
];
pub const NAT_CHAINS: [&str; 4] = [
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
];

/// One of `iptablesJumpChains`: inserted (prepended) into a built-in chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Jump {
    pub table: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    pub comment: &'static str,
    pub new_only: bool,
}

impl Jump {
    /// The rule's arguments after `-t table -X from` (extra args, then the
    /// comment, then the target, as kube-proxy orders them).
    pub fn args(&self) -> Vec<&'static str> {
        let mut a = Vec::new();
        if self.new_only {
            a.extend(["-m", "conntrack", "--ctstate", "NEW"]);
        }
        a.extend(["-m", "comment", "--comment", self.comment, "-j", self.to]);
        a
    }
}

const fn jump(
    table: &'static str,
    to: &'static str,
    from: &'static str,
    comment: &'static str,
    new_only: bool,
) -> Jump {
    Jump {
        table,
        from,
        to,
        comment,
        new_only,
    }
}

/// `iptablesJumpChains`, in upstream's order (each is prepended, so the
/// last one ends up first in its chain).
pub const JUMPS: [Jump; 12] = [
    jump(
        "filter",
        "KUBE-EXTERNAL-SERVICES",
        "INPUT",
        "kubernetes externally-visible service portals",
        true,
    ),
    jump(
        "filter",
        "KUBE-EXTERNAL-SERVICES",
        "FORWARD",
        "kubernetes externally-visible service portals",
        true,
    ),
    jump(
        "filter",
        "KUBE-NODEPORTS",
        "INPUT",
        "kubernetes health check service ports",
        false,
    ),
    jump(
        "filter",
        "KUBE-SERVICES",
        "FORWARD",
        "kubernetes service portals",
        true,
    ),
    jump(
        "filter",
        "KUBE-SERVICES",
        "OUTPUT",
        "kubernetes service portals",
        true,
    ),
    jump(
        "filter",
        "KUBE-FORWARD",
        "FORWARD",
        "kubernetes forwarding rules",
        false,
    ),
    jump(
        "filter",
        "KUBE-PROXY-FIREWALL",
        "INPUT",
        "kubernetes load balancer firewall",
        true,
    ),
    jump(
        "filter",
        "KUBE-PROXY-FIREWALL",
        "OUTPUT",
        "kubernetes load balancer firewall",
        true,
    ),
    jump(
        "filter",
        "KUBE-PROXY-FIREWALL",
        "FORWARD",
        "kubernetes load balancer firewall",
        true,
    ),
    jump(
        "nat",
        "KUBE-SERVICES",
        "OUTPUT",
        "kubernetes service portals",
        false,
    ),
    jump(
        "nat",
        "KUBE-SERVICES",
        "PREROUTING",
        "kubernetes service portals",
        false,
    ),
    jump(
        "nat",
        "KUBE-POSTROUTING",
        "POSTROUTING",
        "kubernetes postrouting rules",
        false,
    ),
];

/// One family's restore input and the per-service nat chains it holds.
#[derive(Clone, Debug, Default)]
pub struct Rendered {
    pub restore: String,
    pub service_chains: BTreeSet<String>,
}

/// Per-service chain names (`servicePortInfo` in upstream).
struct Chains {
    svc: String,
    svl: String,
    ext: String,
}

impl Chains {
    fn of(p: &SvcPort) -> Self {
        let h = port_proto_hash(&p.spn, p.protocol);
        Self {
            svc: format!("KUBE-SVC-{h}"),
            svl: format!("KUBE-SVL-{h}"),
            ext: format!("KUBE-EXT-{h}"),
        }
    }
}

fn sep_chain(p: &SvcPort, b: &Backend) -> String {
    format!(
        "KUBE-SEP-{}",
        endpoint_hash(&p.spn, p.protocol, &join_host_port(&b.address, b.port))
    )
}

/// A line of the restore input; lines are built from words the way
/// kube-proxy's LineBuffer joins them.
fn line(out: &mut String, words: &[&str]) {
    out.push_str(&words.join(" "));
    out.push('\n');
}

/// `-A <chain> [-m comment --comment <comment>] <rest>`: the shape of
/// every rule kube-proxy writes (`rest` holds no quoted words).
fn rule(out: &mut String, chain: &str, comment: Option<&str>, rest: &str) {
    out.push_str("-A ");
    out.push_str(chain);
    if let Some(c) = comment {
        out.push_str(" -m comment --comment ");
        out.push_str(c);
    }
    if !rest.is_empty() {
        out.push(' ');
        out.push_str(rest);
    }
    out.push('\n');
}

fn quoted(s: &str) -> String {
    format!("\"{s}\"")
}

/// The restore input of a full sync for one family. `stale` are service
/// chains installed before and no longer wanted: flushed and deleted in
/// the same restore, as kube-proxy does.
pub fn render(
    ports: &[SvcPort],
    family: Family,
    cluster_cidr: Option<&IpNet>,
    stale: &BTreeSet<String>,
) -> Rendered {
    let mut t = Tables::default();
    for c in FILTER_CHAINS {
        line(&mut t.filter_chains, &[&format!(":{c} - [0:0]")]);
    }
    for c in NAT_CHAINS {
        line(&mut t.nat_chains, &[&format!(":{c} - [0:0]")]);
    }
    let masq_test = format!("{MASQ_MARK}/{MASQ_MARK}");
    let nat = &mut t.nat_rules;
    rule(
        nat,
        "KUBE-POSTROUTING",
        None,
        &format!("-m mark ! --mark {masq_test} -j RETURN"),
    );
    rule(
        nat,
        "KUBE-POSTROUTING",
        None,
        &format!("-j MARK --xor-mark {MASQ_MARK}"),
    );
    rule(
        nat,
        "KUBE-POSTROUTING",
        Some(&quoted("kubernetes service traffic requiring SNAT")),
        "-j MASQUERADE --random-fully",
    );
    rule(
        nat,
        "KUBE-MARK-MASQ",
        None,
        &format!("-j MARK --or-mark {MASQ_MARK}"),
    );
    let cidr = cluster_cidr.map(ToString::to_string);
    for p in ports {
        service_port(&mut t, p, cidr.as_deref());
    }

    // Chains no longer in use: a chain line flushes, then -X deletes.
    for chain in stale.difference(&t.service_chains) {
        line(&mut t.nat_chains, &[&format!(":{chain} - [0:0]")]);
        line(&mut t.nat_rules, &["-X", chain]);
    }

    // The NodePort capture must be the last rule of KUBE-SERVICES
    // (nodePortAddresses unset; localhost NodePorts off).
    let loopback = match family {
        Family::V4 => "127.0.0.0/8",
        Family::V6 => "::1/128",
    };
    rule(
        &mut t.nat_rules,
        "KUBE-SERVICES",
        Some("\"kubernetes service nodeports; NOTE: this must be the last rule in this chain\""),
        &format!("-m addrtype --dst-type LOCAL ! -d {loopback} -j KUBE-NODEPORTS"),
    );

    let filter = &mut t.filter_rules;
    rule(
        filter,
        "KUBE-FORWARD",
        None,
        "-m conntrack --ctstate INVALID -j DROP",
    );
    rule(
        filter,
        "KUBE-FORWARD",
        Some("\"kubernetes forwarding rules\""),
        &format!("-m mark --mark {masq_test} -j ACCEPT"),
    );
    rule(
        filter,
        "KUBE-FORWARD",
        Some("\"kubernetes forwarding conntrack rule\""),
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );

    let mut restore = String::new();
    let _ = write!(
        restore,
        "*filter\n{}{}COMMIT\n*nat\n{}{}COMMIT\n",
        t.filter_chains, t.filter_rules, t.nat_chains, t.nat_rules
    );
    Rendered {
        restore,
        service_chains: t.service_chains,
    }
}

/// The two tables being written, and the per-service chains declared.
#[derive(Default)]
struct Tables {
    filter_chains: String,
    filter_rules: String,
    nat_chains: String,
    nat_rules: String,
    service_chains: BTreeSet<String>,
}

impl Tables {
    /// Declares a per-service nat chain (once).
    fn declare(&mut self, name: &str) {
        if self.service_chains.insert(name.to_owned()) {
            line(&mut self.nat_chains, &[&format!(":{name} - [0:0]")]);
        }
    }
}

/// Every rule of one service port: its captures (ClusterIP, external and
/// load-balancer IPs, NodePort), the masquerade rules, the service chains
/// balancing across the endpoints, and the endpoint chains.
fn service_port(t: &mut Tables, p: &SvcPort, cidr: Option<&str>) {
    let ch = Chains::of(p);
    let proto = p.protocol;
    let l4 = format!("-m {proto} -p {proto}");
    let cip = p.cluster_ip.to_string();
    let port = p.port;
    let (internal_chain, external_policy_chain) = (
        if p.internal_local { &ch.svl } else { &ch.svc },
        if p.external_local { &ch.svl } else { &ch.svc },
    );
    let (filter_target, filter_comment) = if !p.has_any {
        ("REJECT", quoted(&format!("{} has no endpoints", p.spn)))
    } else {
        ("DROP", quoted(&format!("{} has no local endpoints", p.spn)))
    };
    let cluster_ip_comment = quoted(&format!("{} cluster IP", p.spn));

    // Capture the ClusterIP.
    if p.has_internal() {
        rule(
            &mut t.nat_rules,
            "KUBE-SERVICES",
            Some(&cluster_ip_comment),
            &format!("{l4} -d {cip} --dport {port} -j {internal_chain}"),
        );
    } else {
        rule(
            &mut t.filter_rules,
            "KUBE-SERVICES",
            Some(&filter_comment),
            &format!("{l4} -d {cip} --dport {port} -j {filter_target}"),
        );
    }
    // External IPs and load-balancer IPs.
    for (ips, what) in [
        (&p.external_ips, "external IP"),
        (&p.lb_ips, "loadbalancer IP"),
    ] {
        for ip in ips {
            if p.has_any {
                rule(
                    &mut t.nat_rules,
                    "KUBE-SERVICES",
                    Some(&quoted(&format!("{} {what}", p.spn))),
                    &format!("{l4} -d {ip} --dport {port} -j {}", ch.ext),
                );
            }
            if !p.has_external() {
                rule(
                    &mut t.filter_rules,
                    "KUBE-EXTERNAL-SERVICES",
                    Some(&filter_comment),
                    &format!("{l4} -d {ip} --dport {port} -j {filter_target}"),
                );
            }
        }
    }
    // NodePort.
    if let Some(np) = p.node_port {
        if p.has_any {
            rule(
                &mut t.nat_rules,
                "KUBE-NODEPORTS",
                Some(&p.spn),
                &format!("{l4} --dport {np} -j {}", ch.ext),
            );
        }
        if !p.has_external() {
            rule(
                &mut t.filter_rules,
                "KUBE-EXTERNAL-SERVICES",
                Some(&filter_comment),
                &format!("-m addrtype --dst-type LOCAL {l4} --dport {np} -j {filter_target}"),
            );
        }
    }
    // Internal traffic: masquerade what does not come from a pod.
    if p.has_internal()
        && let Some(cidr) = cidr
    {
        rule(
            &mut t.nat_rules,
            internal_chain,
            Some(&cluster_ip_comment),
            &format!("{l4} -d {cip} --dport {port} ! -s {cidr} -j KUBE-MARK-MASQ"),
        );
    }
    // External traffic.
    if p.uses_external_chain() {
        t.declare(&ch.ext);
        let nat = &mut t.nat_rules;
        let spn = &p.spn;
        if !p.external_local {
            rule(
                nat,
                &ch.ext,
                Some(&quoted(&format!(
                    "masquerade traffic for {spn} external destinations"
                ))),
                "-j KUBE-MARK-MASQ",
            );
        } else {
            if let Some(cidr) = cidr {
                rule(
                    nat,
                    &ch.ext,
                    Some(&quoted(&format!(
                        "pod traffic for {spn} external destinations"
                    ))),
                    &format!("-s {cidr} -j {}", ch.svc),
                );
            }
            rule(
                nat,
                &ch.ext,
                Some(&quoted(&format!(
                    "masquerade LOCAL traffic for {spn} external destinations"
                ))),
                "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
            );
            rule(
                nat,
                &ch.ext,
                Some(&quoted(&format!(
                    "route LOCAL traffic for {spn} external destinations"
                ))),
                &format!("-m addrtype --src-type LOCAL -j {}", ch.svc),
            );
        }
        if p.has_external() {
            rule(nat, &ch.ext, None, &format!("-j {external_policy_chain}"));
        }
    }
    // Load balancing across the endpoints.
    if p.uses_cluster_chain() {
        t.declare(&ch.svc);
        service_to_endpoints(&mut t.nat_rules, p, &ch.svc, &p.cluster);
    }
    if p.uses_local_chain() {
        t.declare(&ch.svl);
        service_to_endpoints(&mut t.nat_rules, p, &ch.svl, &p.local);
    }
    // Endpoint chains.
    for b in p.reachable() {
        let sep = sep_chain(p, b);
        t.declare(&sep);
        let to = join_host_port(&b.address, b.port);
        rule(
            &mut t.nat_rules,
            &sep,
            Some(&p.spn),
            &format!("-s {} -j KUBE-MARK-MASQ", b.address),
        );
        rule(
            &mut t.nat_rules,
            &sep,
            Some(&p.spn),
            &format!("{l4} -j DNAT --to-destination {to}"),
        );
    }
}

/// `writeServiceToEndpointRules`: a probability cascade, each endpoint
/// picked with probability exactly 1/N.
fn service_to_endpoints(out: &mut String, p: &SvcPort, chain: &str, endpoints: &[Backend]) {
    let n = endpoints.len();
    for (i, b) in endpoints.iter().enumerate() {
        let comment = quoted(&format!(
            "{} -> {}",
            p.spn,
            join_host_port(&b.address, b.port)
        ));
        let sep = sep_chain(p, b);
        let mut words = vec!["-A", chain, "-m", "comment", "--comment", &comment];
        let probability = format!("{:.10}", 1.0 / (n - i) as f64);
        if i < n - 1 {
            words.extend([
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &probability,
            ]);
        }
        words.extend(["-j", &sep]);
        line(out, &words);
    }
}
