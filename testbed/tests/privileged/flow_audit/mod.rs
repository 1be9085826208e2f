//! Every flow record a conformance check made, held to an evaluator of
//! NetworkPolicy written from the API text (the unprivileged suite's
//! oracle, shared by path, which knows no compiler code): an allow by
//! policy names a rule that admits the flow; a policy drop names exactly
//! the policies isolating the pod in that direction, none of which admits
//! it; a flow of a pod nothing isolates names nothing.
use std::{collections::BTreeSet, net::IpAddr};

use policy_agent::{cluster::ObjectRef, source::manifests::load_dir};
use policy_testbed::fixtures::conformance::{Backend, Conformance, FlowAudit, NODE};

#[allow(dead_code, unused_imports, clippy::all)]
#[path = "../../../../policy-agent/tests/unprivileged/support/oracle.rs"]
mod oracle;

#[allow(dead_code, unused_imports, clippy::all)]
#[path = "../../../../policy-agent/tests/unprivileged/support/cnp_oracle.rs"]
mod cnp_oracle;

/// A fresh conformance node whose checks also hold the flow records
/// their traffic made to the evaluator (on BPF from the pinned ring, on
/// iptables from NFLOG).
pub fn audited(prefix: &'static str, backend: Backend) -> Conformance {
    let c = Conformance::new(prefix, backend);
    *c.flow_audit.borrow_mut() = Some(audit());
    c
}

/// The audit every conformance check runs.
pub fn audit() -> FlowAudit {
    Box::new(|c, what, records| {
        let judged = judge(c, records).unwrap_or_else(|wrong| {
            panic!(
                "{what}: {} flow record(s) disagree with the API evaluator:\n{}\nall records:\n{}",
                wrong.len(),
                wrong.join("\n"),
                records
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        });
        let reasons: BTreeSet<&str> = records
            .iter()
            .filter_map(|r| r["reason"].as_str())
            .collect();
        assert!(
            judged > 0 || records.is_empty(),
            "{what}: none of {} records was one a policy lookup decided: {reasons:?}",
            records.len()
        );
        eprintln!(
            "{what}: {judged} of {} flow records held to the evaluator",
            records.len()
        );
    })
}

fn protocol(name: &str) -> Option<u8> {
    Some(match name {
        "TCP" => 6,
        "UDP" => 17,
        "SCTP" => 132,
        "ICMP" => 1,
        "ICMPv6" => 58,
        other => other.parse().ok()?,
    })
}

fn object(id: &str) -> Option<ObjectRef> {
    let (ns, name) = id.split_once('/')?;
    Some(ObjectRef::new(ns, name))
}

/// The records' (namespace/name, rule) pairs of one kind.
fn named(record: &serde_json::Value) -> Vec<(String, Option<u64>)> {
    record["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                format!(
                    "{}/{}",
                    p["namespace"].as_str().unwrap_or(""),
                    p["name"].as_str().unwrap_or("")
                ),
                p["rule"].as_u64(),
            )
        })
        .collect()
}

/// Whether a tier's verdict names the ClusterNetworkPolicy rule the
/// reference evaluator finds deciding, in the record's tier.
fn tier_agrees(
    reason: &str,
    record: &serde_json::Value,
    rule: Option<&(String, usize)>,
) -> Result<(), String> {
    let tier = if reason.contains("admin") {
        "Admin"
    } else {
        "Baseline"
    };
    let named: Vec<(&str, Option<u64>, &str)> = record["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or(""),
                p["rule"].as_u64(),
                p["tier"].as_str().unwrap_or(""),
            )
        })
        .collect();
    match (named.as_slice(), rule) {
        ([(name, Some(index), t)], Some((policy, i)))
            if name == policy && *index == *i as u64 && *t == tier =>
        {
            Ok(())
        }
        _ => Err(format!(
            "a tier's verdict must name the {tier} rule that decides; the evaluator's: {rule:?}"
        )),
    }
}

/// Whether what a record of `reason` names agrees with the evaluator.
fn agrees(
    reason: &str,
    names: &[(String, Option<u64>)],
    word: &oracle::NetworkPolicyWord,
) -> Result<(), String> {
    let isolating: BTreeSet<String> = word
        .isolating
        .iter()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .collect();
    let admitting: BTreeSet<(String, u64)> = word
        .admitting
        .iter()
        .map(|(p, i)| (format!("{}/{}", p.namespace, p.name), *i as u64))
        .collect();
    match reason {
        "allow_policy" => match names {
            [(policy, Some(rule))] if admitting.contains(&(policy.clone(), *rule)) => Ok(()),
            _ => Err(format!(
                "an allow must name one rule that admits the flow; the evaluator's: {admitting:?}"
            )),
        },
        "drop_policy" => {
            let got: BTreeSet<String> = names.iter().map(|(p, _)| p.clone()).collect();
            if got == isolating && admitting.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "a policy drop must name exactly the isolating policies, none admitting; the evaluator's: isolating {isolating:?}, admitting {admitting:?}"
                ))
            }
        }
        _ if names.is_empty() && isolating.is_empty() => Ok(()),
        _ => Err(format!(
            "a pod nothing isolates names nothing; the evaluator's isolating: {isolating:?}"
        )),
    }
}

/// Judges every record a policy lookup decided; the number judged, or
/// what is wrong.
fn judge(c: &Conformance, records: &[serde_json::Value]) -> Result<usize, Vec<String>> {
    let node_ips: Vec<IpAddr> = c
        .node()
        .node
        .spawn(policy_agent::netlink::local_addresses)
        .ok()
        .and_then(|t| t.join().ok())
        .and_then(|r| r.ok())
        .and_then(|r| r.ok())
        .unwrap_or_default();
    let state = load_dir(&c.dir).cluster_state(NODE, node_ips);
    let world = oracle::World::new(&state, true);
    let mut wrong = Vec::new();
    let mut judged = 0;
    for r in records {
        let reason = r["reason"].as_str().unwrap_or_default();
        if !matches!(
            reason,
            "allow_policy"
                | "drop_policy"
                | "allow_not_isolated"
                | "allow_admin_tier"
                | "drop_admin_tier"
                | "allow_baseline_tier"
                | "drop_baseline_tier"
        ) {
            continue;
        }
        let fail = |why: String| format!("{why}: {r}");
        let (Some(pod), Some(proto)) = (
            r["pod"].as_str().and_then(object),
            r["protocol"].as_str().and_then(protocol),
        ) else {
            wrong.push(fail("no pod or protocol".into()));
            continue;
        };
        let Some(peer) = r["peer"]["ip"]
            .as_str()
            .and_then(|s| s.parse::<IpAddr>().ok())
        else {
            wrong.push(fail("no peer address".into()));
            continue;
        };
        if !state.pods.contains_key(&pod) {
            wrong.push(fail(format!("{pod:?} is no pod of the cluster")));
            continue;
        }
        let ingress = r["direction"] == "ingress";
        let port = r["port"].as_u64().unwrap_or(0) as u16;
        judged += 1;
        let verdict = if reason.contains("tier") {
            let rule = world.tier_rule(&pod, ingress, peer, proto, port);
            tier_agrees(reason, r, rule.as_ref())
        } else {
            let word = world.network_policies(&pod, ingress, peer, proto, port);
            agrees(reason, &named(r), &word)
        };
        if let Err(why) = verdict {
            wrong.push(fail(why));
        }
    }
    if wrong.is_empty() {
        Ok(judged)
    } else {
        Err(wrong)
    }
}
