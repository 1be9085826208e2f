//! nftables mode: the transaction kube-proxy's `syncProxyRules` runs on a
//! full sync (`setupNFTables` and every Service port), as `nft -f` input.
use std::{collections::BTreeSet, fmt::Write as _};

use ipnet::IpNet;

use super::{
    chain_names::{nft_endpoint_base, nft_service_base},
    iptables::MASQ_MARK,
    model::{Family, SvcPort, join_host_port},
};
use policy_agent::cluster::Backend;

pub const TABLE: &str = "kube-proxy";

/// `nftablesBaseChains` (the layout of upstream commit b0f823e6):
/// name, type, hook, priority.
const BASE_CHAINS: [(&str, &str, &str, i32); 8] = [
    ("filter-prerouting", "filter", "prerouting", -110),
    ("filter-input", "filter", "input", -110),
    ("filter-forward", "filter", "forward", -110),
    ("filter-output", "filter", "output", -110),
    ("filter-output-post-dnat", "filter", "output", -90),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
];

/// `nftablesJumpChains`: destination, source, extra match.
const JUMP_CHAINS: [(&str, &str, &str); 11] = [
    ("nodeport-endpoints-check", "filter-input", "ct state new"),
    ("service-endpoints-check", "filter-input", "ct state new"),
    ("service-endpoints-check", "filter-forward", "ct state new"),
    ("service-endpoints-check", "filter-output", "ct state new"),
    ("firewall-check", "filter-prerouting", "ct state new"),
    ("firewall-check", "filter-output", "ct state new"),
    ("services", "nat-output", ""),
    ("services", "nat-prerouting", ""),
    ("masquerading", "nat-postrouting", ""),
    ("cluster-ips-check", "filter-forward", "ct state new"),
    (
        "cluster-ips-check",
        "filter-output-post-dnat",
        "ct state new",
    ),
];

/// The nft family keyword of a table.
pub fn table_family(family: Family) -> &'static str {
    match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    }
}

/// One family's transaction and the per-service chains it holds.
#[derive(Clone, Debug, Default)]
pub struct Rendered {
    pub transaction: String,
    pub service_chains: BTreeSet<String>,
}

struct Tx {
    out: String,
    prefix: String,
    created: BTreeSet<String>,
}

impl Tx {
    fn cmd(&mut self, verb: &str, what: &str, rest: &str) {
        let _ = writeln!(self.out, "{verb} {what} {}{rest}", self.prefix);
    }

    /// `ensureChain`: add and flush a chain once per transaction.
    fn ensure_chain(&mut self, chain: &str) {
        if self.created.insert(chain.to_owned()) {
            self.cmd("add", "chain", &format!(" {chain}"));
            self.cmd("flush", "chain", &format!(" {chain}"));
        }
    }

    fn rule(&mut self, chain: &str, rule: &str) {
        self.cmd("add", "rule", &format!(" {chain} {rule}"));
    }

    fn element(&mut self, set: &str, element: &str) {
        self.cmd("add", "element", &format!(" {set} {{ {element} }}"));
    }
}

/// The transaction of a full sync. `first` adds the add+delete of every
/// base chain kube-proxy does once per process; `stale` service chains are
/// flushed here (deleted by a later transaction, as kube-proxy does).
pub fn render(
    ports: &[SvcPort],
    family: Family,
    cluster_cidr: Option<&IpNet>,
    service_cidrs: &[IpNet],
    first: bool,
    stale: &BTreeSet<String>,
) -> Rendered {
    let fam = table_family(family);
    let (addr_type, no_localhost) = match family {
        Family::V4 => ("ipv4_addr", "ip daddr != 127.0.0.0/8"),
        Family::V6 => ("ipv6_addr", "ip6 daddr != ::1"),
    };
    let mut tx = Tx {
        out: String::new(),
        prefix: format!("{fam} {TABLE}"),
        created: BTreeSet::new(),
    };
    tx.cmd("add", "table", " { comment \"rules for kube-proxy\" ; }");
    if first {
        for (name, ..) in BASE_CHAINS {
            tx.cmd("add", "chain", &format!(" {name}"));
            tx.cmd("delete", "chain", &format!(" {name}"));
        }
    }
    for (name, kind, hook, priority) in BASE_CHAINS {
        tx.cmd(
            "add",
            "chain",
            &format!(" {name} {{ type {kind} hook {hook} priority {priority} ; }}"),
        );
        tx.cmd("flush", "chain", &format!(" {name}"));
    }
    for (to, from, extra) in JUMP_CHAINS {
        tx.ensure_chain(to);
        let rule = if extra.is_empty() {
            format!("jump {to}")
        } else {
            format!("{extra} jump {to}")
        };
        tx.rule(from, &rule);
    }
    for chain in [
        "services",
        "cluster-ips-check",
        "masquerading",
        "mark-for-masquerade",
    ] {
        tx.ensure_chain(chain);
    }
    tx.rule(
        "mark-for-masquerade",
        &format!("mark set mark or {MASQ_MARK}"),
    );
    tx.rule("masquerading", &format!("mark and {MASQ_MARK} == 0 return"));
    tx.rule("masquerading", &format!("mark set mark xor {MASQ_MARK}"));
    tx.rule("masquerading", "masquerade fully-random");
    tx.cmd(
        "add",
        "set",
        &format!(" cluster-ips {{ type {addr_type} ; comment \"Active ClusterIPs\" ; }}"),
    );
    tx.rule(
        "cluster-ips-check",
        &format!(
            "{fam} daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
        ),
    );
    let service_cidrs: Vec<String> = service_cidrs
        .iter()
        .filter(|c| match family {
            Family::V4 => matches!(c, IpNet::V4(_)),
            Family::V6 => matches!(c, IpNet::V6(_)),
        })
        .map(ToString::to_string)
        .collect();
    if !service_cidrs.is_empty() {
        tx.rule(
            "cluster-ips-check",
            &format!(
                "{fam} daddr {{ {} }} drop comment \"Drop traffic to unallocated ClusterIPs\"",
                service_cidrs.join(", ")
            ),
        );
    }
    // nodePortAddresses unset: the set is made sure not to exist.
    tx.cmd(
        "add",
        "set",
        &format!(
            " nodeport-ips {{ type {addr_type} ; comment \"IPs that accept NodePort traffic\" ; }}"
        ),
    );
    tx.cmd("delete", "set", " nodeport-ips");
    tx.cmd(
        "add",
        "map",
        &format!(
            " no-endpoint-services {{ type {addr_type} . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }}"
        ),
    );
    tx.cmd(
        "add",
        "map",
        " no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\" ; }",
    );
    tx.cmd(
        "add",
        "chain",
        " reject-chain { comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }",
    );
    tx.cmd("flush", "chain", " reject-chain");
    tx.rule("reject-chain", "reject");
    tx.rule(
        "service-endpoints-check",
        &format!("{fam} daddr . meta l4proto . th dport vmap @no-endpoint-services"),
    );
    tx.rule(
        "nodeport-endpoints-check",
        &format!("{no_localhost} meta l4proto . th dport vmap @no-endpoint-nodeports"),
    );
    tx.cmd(
        "add",
        "map",
        &format!(
            " firewall-ips {{ type {addr_type} . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\" ; }}"
        ),
    );
    tx.ensure_chain("firewall-check");
    tx.rule(
        "firewall-check",
        &format!("{fam} daddr . meta l4proto . th dport vmap @firewall-ips"),
    );
    tx.cmd(
        "add",
        "map",
        &format!(
            " service-ips {{ type {addr_type} . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }}"
        ),
    );
    tx.cmd(
        "add",
        "map",
        " service-nodeports { type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }",
    );
    tx.rule(
        "services",
        &format!("{fam} daddr . meta l4proto . th dport vmap @service-ips"),
    );
    tx.rule(
        "services",
        &format!(
            "fib daddr type local {no_localhost} meta l4proto . th dport vmap @service-nodeports"
        ),
    );
    tx.cmd("flush", "set", " cluster-ips");
    for map in [
        "service-ips",
        "firewall-ips",
        "no-endpoint-services",
        "no-endpoint-nodeports",
        "service-nodeports",
    ] {
        tx.cmd("flush", "map", &format!(" {map}"));
    }

    let cidr = cluster_cidr.map(ToString::to_string);
    let mut service_chains = BTreeSet::new();
    let mut cluster_ips = BTreeSet::new();
    for p in ports {
        let base = nft_service_base(&p.namespace, &p.name, p.protocol, &p.port_name);
        let svc_chain = format!("service-{base}");
        let local_chain = format!("local-{base}");
        let ext_chain = format!("external-{base}");
        let endpoint_chain = |b: &Backend| {
            format!(
                "endpoint-{}",
                nft_endpoint_base(
                    &p.namespace,
                    &p.name,
                    p.protocol,
                    &p.port_name,
                    b.address,
                    b.port
                )
            )
        };
        let mut ensure = |tx: &mut Tx, chain: &str| {
            service_chains.insert(chain.to_owned());
            tx.ensure_chain(chain);
        };
        for b in p.reachable() {
            ensure(&mut tx, &endpoint_chain(b));
        }
        if p.uses_cluster_chain() {
            ensure(&mut tx, &svc_chain);
        }
        if p.uses_local_chain() {
            ensure(&mut tx, &local_chain);
        }
        if p.uses_external_chain() {
            ensure(&mut tx, &ext_chain);
        }
        let internal_chain = if p.internal_local {
            &local_chain
        } else {
            &svc_chain
        };
        let external_policy_chain = if p.external_local {
            &local_chain
        } else {
            &svc_chain
        };
        let verdict = if p.has_any {
            "drop"
        } else {
            "goto reject-chain"
        };
        let proto = p.protocol;
        let cip = p.cluster_ip.to_string();
        let comment = format!("comment \"{}\"", p.spn);

        if cluster_ips.insert(cip.clone()) {
            tx.element("cluster-ips", &cip);
        }
        if p.has_internal() {
            tx.element(
                "service-ips",
                &format!("{cip} . {proto} . {} : goto {internal_chain}", p.port),
            );
        } else {
            tx.element(
                "no-endpoint-services",
                &format!("{cip} . {proto} . {} {comment} : {verdict}", p.port),
            );
        }
        for ip in p.external_ips.iter().chain(&p.lb_ips) {
            if p.has_any {
                tx.element(
                    "service-ips",
                    &format!("{ip} . {proto} . {} : goto {ext_chain}", p.port),
                );
            }
            if !p.has_external() {
                tx.element(
                    "no-endpoint-services",
                    &format!("{ip} . {proto} . {} {comment} : {verdict}", p.port),
                );
            }
        }
        if let Some(np) = p.node_port {
            if p.has_any {
                tx.element(
                    "service-nodeports",
                    &format!("{proto} . {np} : goto {ext_chain}"),
                );
            }
            if !p.has_external() {
                tx.element(
                    "no-endpoint-nodeports",
                    &format!("{proto} . {np} {comment} : {verdict}"),
                );
            }
        }
        if p.has_internal()
            && let Some(cidr) = &cidr
        {
            tx.rule(
                internal_chain,
                &format!(
                    "{fam} daddr {cip} {proto} dport {} {fam} saddr != {cidr} jump mark-for-masquerade",
                    p.port
                ),
            );
        }
        if p.uses_external_chain() {
            if !p.external_local {
                tx.rule(&ext_chain, "jump mark-for-masquerade");
            } else {
                if let Some(cidr) = &cidr {
                    tx.rule(
                        &ext_chain,
                        &format!(
                            "{fam} saddr {cidr} goto {svc_chain} comment \"short-circuit pod traffic\""
                        ),
                    );
                }
                tx.rule(
                    &ext_chain,
                    "fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\"",
                );
                tx.rule(
                    &ext_chain,
                    &format!(
                        "fib saddr type local goto {svc_chain} comment \"short-circuit local traffic\""
                    ),
                );
            }
            if p.has_external() {
                tx.rule(&ext_chain, &format!("goto {external_policy_chain}"));
            }
        }
        for (used, chain, endpoints) in [
            (p.uses_cluster_chain(), &svc_chain, &p.cluster),
            (p.uses_local_chain(), &local_chain, &p.local),
        ] {
            if used {
                let targets: Vec<String> = endpoints
                    .iter()
                    .enumerate()
                    .map(|(i, b)| format!("{i} : goto {}", endpoint_chain(b)))
                    .collect();
                tx.rule(
                    chain,
                    &format!(
                        "numgen random mod {} vmap {{ {} }}",
                        endpoints.len(),
                        targets.join(" , ")
                    ),
                );
            }
        }
        for b in p.reachable() {
            let chain = endpoint_chain(b);
            tx.rule(
                &chain,
                &format!("{fam} saddr {} jump mark-for-masquerade", b.address),
            );
            tx.rule(
                &chain,
                &format!(
                    "meta l4proto {proto} dnat to {}",
                    join_host_port(&b.address, b.port)
                ),
            );
        }
    }
    for chain in stale.difference(&service_chains) {
        tx.cmd("flush", "chain", &format!(" {chain}"));
    }
    Rendered {
        transaction: tx.out,
        service_chains,
    }
}

/// Deletes chains a previous sync flushed as stale.
pub fn delete_chains(family: Family, chains: &BTreeSet<String>) -> String {
    let fam = table_family(family);
    chains
        .iter()
        .map(|c| format!("delete chain {fam} {TABLE} {c}\n"))
        .collect()
}
