//! Flow records: each verdict the pod chains give a new flow is also
//! logged to NFLOG, once, with the rule that decided it in the prefix
//! (see `flow_log::prefix`).
//!
//! The pod chains only see what the RELATED,ESTABLISHED shortcut lets
//! through: a flow's first packet (and the original-direction packets of
//! a revoked flow, until judged again). Where a rule set the mark or
//! dropped, it jumps to a record chain of its verdict instead:
//! ```text
//! R-<allow prefix>:  mark set -> RETURN          (an earlier rule decided)
//!                    set mark
//!                    over the budget -> goto LIMITED (counted, back)
//!                    NFLOG prefix
//! R-<drop prefix>:   over the budget -> LIMITED-DROP (counted, dropped)
//!                    NFLOG prefix; DROP
//! ```
//! The first NetworkPolicy rule that allows a flow marks and logs it; the
//! rules after it (in its policy chain or another policy's) find the mark
//! set and log nothing. A record chain is named by its prefix, so the
//! pods of one identity share them: one chain per (endpoint identity,
//! direction, allowing rule or tier slot), one per (identity, direction)
//! for a NetworkPolicy drop and one per identity for a forged source. The
//! policy, tier and source chains keep their rule count.
//!
//! The budget is one `hashlimit` bucket shared by every record rule (one
//! name): per node and family. Its name carries the rate, as a bucket
//! keeps the rate it was made with until no rule uses it.
use std::collections::BTreeMap;

use policy_common::{event::RuleRef, policy::TierSlot, verdict::Reason};

use super::super::{
    flow_log::RecordPrefix,
    ruleset::{Chain, ChainKind, Family, LIMITED_CHAIN, LIMITED_COMMENT, LIMITED_DROP_CHAIN},
};
use crate::{cluster::Problem, mapstate::fnv1a64};

/// The NFLOG group records go to by default.
pub const DEFAULT_GROUP: u16 = 10410;
/// Records a second per node and family, by default.
pub const DEFAULT_RATE: u32 = 1000;
/// Records at once past the rate, by default.
pub const DEFAULT_BURST: u32 = 200;

/// Flow records on the iptables datapath: where they go and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowLogOptions {
    /// The NFLOG group the record rules log to (one reader may bind it).
    pub group: u16,
    /// Records a second per node and family (0: no limit).
    pub per_second: u32,
    /// Records at once past the rate.
    pub burst: u32,
}

impl Default for FlowLogOptions {
    fn default() -> Self {
        Self {
            group: DEFAULT_GROUP,
            per_second: DEFAULT_RATE,
            burst: DEFAULT_BURST,
        }
    }
}

/// The record chains of one family, made as the pod chains need them.
pub(super) struct Records<'a> {
    opts: FlowLogOptions,
    mark: &'a str,
    name_bits: u32,
    fam: Family,
    /// Record chain name → the prefix it logs (a second prefix on one name
    /// is a collision).
    made: BTreeMap<String, RecordPrefix>,
    pub(super) problems: Vec<Problem>,
}

impl<'a> Records<'a> {
    pub(super) fn new(opts: FlowLogOptions, mark: &'a str, name_bits: u32, fam: Family) -> Self {
        Self {
            opts,
            mark,
            name_bits,
            fam,
            made: BTreeMap::new(),
            problems: Vec::new(),
        }
    }

    /// The record chain of a NetworkPolicy rule's allow.
    pub(super) fn allow_policy(
        &mut self,
        chains: &mut BTreeMap<String, Chain>,
        dir: u8,
        identity: u32,
        rule_ref: u32,
    ) -> Option<String> {
        let rule = RuleRef {
            network_policy: rule_ref,
            ..RuleRef::default()
        };
        self.chain(
            chains,
            RecordPrefix::new(Reason::AllowPolicy, dir, identity, rule),
        )
    }

    /// The record chain of a new flow no enforced policy judges, at a pod
    /// a staged policy would judge (`ENDPOINT_STAGED`): logged for the
    /// agent to judge against the staged view, and nothing else (no mark:
    /// the pod chains of its peer still judge it).
    pub(super) fn observe(
        &mut self,
        chains: &mut BTreeMap<String, Chain>,
        dir: u8,
        identity: u32,
    ) -> Option<String> {
        self.chain(
            chains,
            RecordPrefix::new(Reason::AllowNotIsolated, dir, identity, RuleRef::default()),
        )
    }

    /// The record chain of a drop by `reason` (no rule: the policies
    /// isolating the identity name it).
    pub(super) fn drop(
        &mut self,
        chains: &mut BTreeMap<String, Chain>,
        reason: Reason,
        dir: u8,
        identity: u32,
    ) -> Option<String> {
        self.chain(
            chains,
            RecordPrefix::new(reason, dir, identity, RuleRef::default()),
        )
    }

    /// The record chain of a tier slot's Accept or Deny (`tier` 0: Admin,
    /// 1: Baseline); None for a Pass, which decides nothing.
    pub(super) fn tier(
        &mut self,
        chains: &mut BTreeMap<String, Chain>,
        tier: usize,
        slot: TierSlot,
        dir: u8,
        identity: u32,
    ) -> Option<String> {
        use policy_common::policy::action;
        let (reason, rule) = match (tier, slot.action()) {
            (0, action::ACCEPT) => (Reason::AllowAdminTier, admin(slot)),
            (0, action::DENY) => (Reason::DropAdminTier, admin(slot)),
            (_, action::ACCEPT) => (Reason::AllowBaselineTier, baseline(slot)),
            (_, action::DENY) => (Reason::DropBaselineTier, baseline(slot)),
            _ => return None,
        };
        self.chain(chains, RecordPrefix::new(reason, dir, identity, rule))
    }

    fn chain(
        &mut self,
        chains: &mut BTreeMap<String, Chain>,
        prefix: RecordPrefix,
    ) -> Option<String> {
        let text = prefix.encode();
        let hash = fnv1a64(format!("record/{text}/{:?}", self.fam).as_bytes());
        let hash = if self.name_bits >= 64 {
            hash
        } else {
            hash & ((1u64 << self.name_bits) - 1)
        };
        let name = ChainKind::Record.name(hash);
        match self.made.get(&name) {
            Some(p) if *p == prefix => return Some(name),
            Some(_) => {
                // Fail open for the record only: the verdict is rendered
                // as without records.
                self.problems.push(Problem::node(format!(
                    "iptables: the record chain of \"{text}\" collides with another's (hash collision); those flows are judged without a record"
                )));
                return None;
            }
            None => {}
        }
        self.made.insert(name.clone(), prefix);
        let mark = self.mark;
        let log = format!(
            "-j NFLOG --nflog-group {} --nflog-prefix \"{text}\"",
            self.opts.group
        );
        let rules = if prefix.reason.is_drop() {
            let mut rules: Vec<String> = self
                .limit()
                .map(|l| format!("{l}-j {LIMITED_DROP_CHAIN}"))
                .into_iter()
                .collect();
            rules.extend([log, "-j DROP".into()]);
            rules
        } else if prefix.reason == Reason::AllowNotIsolated {
            let mut rules: Vec<String> = self
                .limit()
                .map(|l| format!("{l}-g {LIMITED_CHAIN}"))
                .into_iter()
                .collect();
            rules.push(log);
            rules
        } else {
            let mut rules = vec![
                format!("-m mark --mark {mark}/{mark} -j RETURN"),
                format!("-j MARK --set-xmark {mark}/{mark}"),
            ];
            rules.extend(self.limit().map(|l| format!("{l}-g {LIMITED_CHAIN}")));
            rules.push(log);
            rules
        };
        chains.insert(
            name.clone(),
            Chain {
                name: name.clone(),
                rules,
            },
        );
        Some(name)
    }

    /// The match of a record over the budget (None: no limit).
    fn limit(&self) -> Option<String> {
        let FlowLogOptions {
            per_second, burst, ..
        } = self.opts;
        if per_second == 0 {
            return None;
        }
        let burst = burst.max(1);
        // 15 characters, the most hashlimit takes.
        let name = format!(
            "pa-flows-{:06x}",
            fnv1a64(format!("{per_second}/{burst}").as_bytes()) & 0xff_ffff
        );
        Some(format!(
            "-m hashlimit --hashlimit-above {per_second}/sec --hashlimit-burst {burst} --hashlimit-name {name} "
        ))
    }

    /// The two chains every record chain over the budget ends in: their
    /// one rule's packet counter is what the budget held back.
    pub(super) fn limited_chains(&self) -> [Chain; 2] {
        let comment = format!("-m comment --comment \"{LIMITED_COMMENT}\"");
        [
            Chain {
                name: LIMITED_CHAIN.into(),
                rules: vec![format!("{comment} -j RETURN")],
            },
            Chain {
                name: LIMITED_DROP_CHAIN.into(),
                rules: vec![format!("{comment} -j DROP")],
            },
        ]
    }
}

fn admin(slot: TierSlot) -> RuleRef {
    RuleRef {
        admin: slot,
        ..RuleRef::default()
    }
}

fn baseline(slot: TierSlot) -> RuleRef {
    RuleRef {
        baseline: slot,
        ..RuleRef::default()
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, path::Path};

    use policy_common::{direction, policy::action};

    use super::{
        super::{super::DEFAULT_MARK, NAME_BITS, RenderInput, render, render_with},
        *,
    };
    use crate::{
        cluster::PodRef,
        datapath::iptables::Ruleset,
        identity::IdentityAllocator,
        policy::{self, Compiled},
        source::manifests::{LoadedManifests, load_text},
    };

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: alpha, labels: {team: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: alpha, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {podIPs: [{ip: 10.1.0.10}, {ip: "fd00::10"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: alpha, labels: {app: db}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {podIPs: [{ip: 10.1.0.12}, {ip: "fd00::12"}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-web, namespace: alpha}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}], ports: [{port: 80}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: also-web, namespace: alpha}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: guard}
spec:
  tier: Admin
  priority: 5
  subject: {namespaces: {matchLabels: {team: a}}}
  egress:
  - {name: no-dns, action: Deny, to: [{namespaces: {}}], protocols: [{udp: {destinationPort: {number: 53}}}]}
  - {name: web-ok, action: Accept, to: [{namespaces: {}}], protocols: [{tcp: {destinationPort: {number: 8080}}}]}
"#;

    fn compiled() -> Compiled {
        let mut loaded = LoadedManifests::default();
        load_text(Path::new("cluster.yaml"), CLUSTER, &mut loaded);
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
        let state = loaded.cluster_state("n1", vec!["192.168.0.1".parse().unwrap()]);
        let c = policy::compile(&state, &mut IdentityAllocator::new());
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        c
    }

    fn rendered(c: &Compiled, records: Option<&FlowLogOptions>) -> Ruleset {
        let interfaces: BTreeMap<PodRef, String> = c
            .local_pods
            .keys()
            .map(|p| (p.clone(), format!("veth-{}", p.name)))
            .collect();
        let input = RenderInput {
            maps: &c.maps,
            local_pods: &c.local_pods,
            interfaces: &interfaces,
            rules: &c.rules,
            mark: DEFAULT_MARK,
            name_bits: NAME_BITS,
        };
        let r = render_with(&input, records);
        if records.is_none() {
            assert_eq!(r, render(&input), "records off renders as before");
        }
        r
    }

    fn chains(r: &Ruleset, fam: Family) -> BTreeMap<&str, &Vec<String>> {
        r.chains[&fam]
            .iter()
            .map(|c| (c.name.as_str(), &c.rules))
            .collect()
    }

    /// The chain a rule jumps to (`-j`/`-g`).
    fn target(rule: &str) -> Option<&str> {
        let words: Vec<&str> = rule.split_whitespace().collect();
        words
            .windows(2)
            .find(|w| w[0] == "-j" || w[0] == "-g")
            .map(|w| w[1])
    }

    /// The prefix a record chain logs.
    fn prefix_of(rules: &[String]) -> RecordPrefix {
        let log = rules
            .iter()
            .find(|r| r.contains("NFLOG"))
            .expect("a log rule");
        let text = log.split('"').nth(1).expect("a quoted prefix");
        RecordPrefix::decode(text).expect(text)
    }

    fn pod_identity(c: &Compiled, name: &str) -> u32 {
        c.maps
            .endpoints
            .iter()
            .find(|(p, _)| *p.name == *name)
            .map(|(_, e)| e.identity)
            .expect(name)
    }

    #[test]
    fn records_off_render_no_record_chain() {
        let c = compiled();
        let r = rendered(&c, None);
        for fam in Family::BOTH {
            let all = chains(&r, fam);
            assert!(all.keys().all(|n| !n.starts_with("pa-agent:R-")), "{all:?}");
            assert!(!all.contains_key(LIMITED_CHAIN));
            assert!(
                all.values()
                    .flat_map(|r| r.iter())
                    .all(|r| !r.contains("NFLOG"))
            );
        }
    }

    #[test]
    fn every_verdict_of_a_new_flow_goes_through_one_record_chain_naming_it() {
        let c = compiled();
        let opts = FlowLogOptions {
            group: 77,
            per_second: 10,
            burst: 3,
        };
        let r = rendered(&c, Some(&opts));
        let db = pod_identity(&c, "db");
        let web = pod_identity(&c, "web");
        for fam in Family::BOTH {
            let all = chains(&r, fam);
            assert_eq!(all[LIMITED_CHAIN].len(), 1);
            assert!(all[LIMITED_DROP_CHAIN][0].ends_with("-j DROP"));
            let mut seen: BTreeMap<Reason, Vec<RecordPrefix>> = BTreeMap::new();
            for (name, rules) in all.iter().filter(|(n, _)| n.starts_with("pa-agent:R-")) {
                let p = prefix_of(rules);
                assert!(
                    rules.iter().any(|r| r.contains("--nflog-group 77 ")),
                    "{name}: {rules:?}"
                );
                let limit = rules
                    .iter()
                    .find(|r| r.contains("--hashlimit-above 10/sec --hashlimit-burst 3 "))
                    .expect("a budget");
                if p.reason.is_drop() {
                    assert_eq!(target(limit), Some(LIMITED_DROP_CHAIN));
                    assert_eq!(rules.last().map(String::as_str), Some("-j DROP"));
                } else {
                    assert_eq!(target(limit), Some(LIMITED_CHAIN));
                    assert!(limit.contains(" -g "), "back to the judging chain: {limit}");
                    // Logged once: a flow already marked passes through.
                    assert!(rules[0].starts_with("-m mark --mark 0x800000/0x800000 -j RETURN"));
                    assert!(rules[1].contains("MARK --set-xmark"));
                }
                seen.entry(p.reason).or_default().push(p);
            }
            // db's ingress: each policy's rule allows, by its own rule ref.
            let allows = &seen[&Reason::AllowPolicy];
            let policies: Vec<String> = allows
                .iter()
                .map(|p| {
                    assert_eq!((p.direction, p.identity), (direction::INGRESS, db));
                    c.rules[&p.network_policy].policy.to_string()
                })
                .collect();
            assert!(
                policies.contains(&"alpha/allow-web".to_owned()),
                "{policies:?}"
            );
            assert!(
                policies.contains(&"alpha/also-web".to_owned()),
                "{policies:?}"
            );
            // What no policy allows at db, and what a pod forges.
            assert!(
                seen[&Reason::DropPolicy]
                    .iter()
                    .all(|p| p.identity == db && p.direction == direction::INGRESS)
            );
            assert_eq!(seen[&Reason::DropSpoofed].len(), 2, "one per pod identity");
            // The Admin tier's egress rules, by slot.
            let deny = &seen[&Reason::DropAdminTier];
            let accept = &seen[&Reason::AllowAdminTier];
            assert!(deny.iter().chain(accept).any(|p| p.identity == web));
            assert!(deny.iter().all(
                |p| p.direction == direction::EGRESS && p.rule().admin.action() == action::DENY
            ));
            assert!(
                accept
                    .iter()
                    .all(|p| p.rule().admin.action() == action::ACCEPT
                        && p.rule().network_policy == 0)
            );
            assert!(
                deny.iter()
                    .all(|p| p.rule().admin.rank() < accept[0].rule().admin.rank())
            );

            // Where they are used: every key of db's policy chains jumps
            // to an allow record, its pod chain's last rule to the drop.
            let ingress_db = all
                .iter()
                .find(|(n, rules)| {
                    n.starts_with("pa-agent:I-")
                        && rules.iter().any(|r| r.contains("alpha/allow-web"))
                })
                .map(|(_, rules)| *rules)
                .expect("db's ingress chain");
            let last = target(ingress_db.last().unwrap()).unwrap();
            assert_eq!(prefix_of(all[last]).reason, Reason::DropPolicy);
            for jump in ingress_db
                .iter()
                .filter(|r| r.contains("--comment \"alpha/"))
            {
                let policy_chain = all[target(jump).unwrap()];
                assert!(!policy_chain.is_empty());
                for key in policy_chain {
                    let record = all[target(key).unwrap()];
                    assert_eq!(prefix_of(record).reason, Reason::AllowPolicy, "{key}");
                }
            }
        }
    }

    #[test]
    fn a_budget_of_zero_renders_no_limit() {
        let c = compiled();
        let opts = FlowLogOptions {
            per_second: 0,
            ..FlowLogOptions::default()
        };
        let r = rendered(&c, Some(&opts));
        let all = chains(&r, Family::V4);
        let records: Vec<_> = all
            .iter()
            .filter(|(n, _)| n.starts_with("pa-agent:R-"))
            .collect();
        assert!(!records.is_empty());
        for (_, rules) in records {
            assert!(rules.iter().all(|r| !r.contains("hashlimit")), "{rules:?}");
            assert!(rules.iter().any(|r| r.contains("--nflog-group 10410 ")));
        }
    }
}
