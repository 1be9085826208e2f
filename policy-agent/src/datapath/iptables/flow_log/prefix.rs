//! The NFLOG prefix of a record rule: what a [`FlowRecord`] carries that
//! the packet itself does not say (why, in which direction, at which
//! endpoint identity, by which rule).
//!
//! `pa1 <reason> <direction> <identity> <rule_ref> <admin> <baseline>`:
//! the reason and direction in decimal, the rest in hex (the tier slots
//! raw, rank and action). At most 48 bytes, under NFLOG's 63.
//!
//! [`FlowRecord`]: policy_common::event::FlowRecord
use policy_common::{direction, event::RuleRef, policy::TierSlot, verdict::Reason};

/// The first word of every prefix this agent renders: the scheme and its
/// version, so a prefix of another tool (or a later scheme) is told apart.
pub const PREFIX_TAG: &str = "pa1";
/// The longest prefix NFLOG keeps (64 bytes with the NUL).
pub const MAX_PREFIX_LEN: usize = 63;

/// What one record rule says about the flows it logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordPrefix {
    pub reason: Reason,
    /// [`policy_common::direction`].
    pub direction: u8,
    /// The local pod's label identity.
    pub identity: u32,
    /// What decided it, as `RuleRef::kept_for(reason)` keeps it.
    pub network_policy: u32,
    pub admin: u32,
    pub baseline: u32,
}

impl RecordPrefix {
    pub fn new(reason: Reason, direction: u8, identity: u32, rule: RuleRef) -> Self {
        let rule = rule.kept_for(reason);
        Self {
            reason,
            direction,
            identity,
            network_policy: rule.network_policy,
            admin: rule.admin.0,
            baseline: rule.baseline.0,
        }
    }

    pub fn rule(&self) -> RuleRef {
        RuleRef {
            network_policy: self.network_policy,
            admin: TierSlot(self.admin),
            baseline: TierSlot(self.baseline),
        }
    }

    /// The prefix text (no quotes; it holds no character iptables or
    /// iptables-restore would read specially but the spaces).
    pub fn encode(&self) -> String {
        format!(
            "{PREFIX_TAG} {} {} {:x} {:x} {:x} {:x}",
            self.reason as u8,
            self.direction,
            self.identity,
            self.network_policy,
            self.admin,
            self.baseline
        )
    }

    /// The prefix `text` encodes, or None when it is not one of ours
    /// (another tool's, a later scheme, a reason this build does not
    /// know).
    pub fn decode(text: &str) -> Option<Self> {
        let mut words = text.split(' ');
        if words.next()? != PREFIX_TAG {
            return None;
        }
        let reason = Reason::from_u8(words.next()?.parse().ok()?)?;
        let dir: u8 = words.next()?.parse().ok()?;
        if dir != direction::INGRESS && dir != direction::EGRESS {
            return None;
        }
        let mut hex = || u32::from_str_radix(words.next()?, 16).ok();
        let (identity, network_policy, admin, baseline) = (hex()?, hex()?, hex()?, hex()?);
        if words.next().is_some() {
            return None;
        }
        Some(Self {
            reason,
            direction: dir,
            identity,
            network_policy,
            admin,
            baseline,
        })
    }
}

#[cfg(test)]
mod tests {
    use policy_common::policy::action;

    use super::*;

    fn rule(np: u32, admin: TierSlot, baseline: TierSlot) -> RuleRef {
        RuleRef {
            network_policy: np,
            admin,
            baseline,
        }
    }

    #[test]
    fn every_reason_round_trips_and_keeps_only_what_decided_it() {
        let all = rule(
            0xdead_beef,
            TierSlot::new(TierSlot::MAX_RANK, action::DENY),
            TierSlot::new(1, action::ACCEPT),
        );
        for reason in Reason::ALL {
            for dir in [direction::INGRESS, direction::EGRESS] {
                let p = RecordPrefix::new(reason, dir, u32::MAX, all);
                let text = p.encode();
                assert!(text.len() <= MAX_PREFIX_LEN, "{text}");
                let back = RecordPrefix::decode(&text).expect(&text);
                assert_eq!(back, p, "{text}");
                assert_eq!(back.reason, reason);
                assert_eq!(back.rule(), all.kept_for(reason), "{text}");
                assert_eq!(back.identity, u32::MAX);
                assert_eq!(back.direction, dir);
            }
        }
    }

    #[test]
    fn an_allow_names_its_rule_and_a_tier_verdict_its_slot() {
        let slot = TierSlot::new(7, action::ACCEPT);
        let np = RecordPrefix::new(
            Reason::AllowPolicy,
            direction::INGRESS,
            0x1a,
            rule(42, slot, slot),
        );
        assert_eq!(np.encode(), "pa1 1 0 1a 2a 0 0");
        let admin = RecordPrefix::new(
            Reason::AllowAdminTier,
            direction::EGRESS,
            0x1a,
            rule(42, slot, slot),
        );
        assert_eq!(admin.encode(), format!("pa1 13 1 1a 0 {:x} 0", slot.0));
        assert_eq!(admin.rule().admin.rank(), 7);
        let drop = RecordPrefix::new(
            Reason::DropPolicy,
            direction::INGRESS,
            0x1a,
            rule(42, slot, slot),
        );
        assert_eq!(drop.encode(), "pa1 32 0 1a 0 0 0");
    }

    #[test]
    fn what_is_not_ours_is_refused() {
        for text in [
            "",
            "pa1",
            "pa2 1 0 1a 2a 0 0",
            "pa1 1 0 1a 2a 0",
            "pa1 1 0 1a 2a 0 0 0",
            "pa1 99 0 1a 2a 0 0",
            "pa1 1 2 1a 2a 0 0",
            "pa1 1 0 1g 2a 0 0",
            "pa1 1 0 100000000 2a 0 0",
            "pa1  1 0 1a 2a 0 0",
            "IN=eth0 OUT= SRC=10.0.0.1",
        ] {
            assert_eq!(RecordPrefix::decode(text), None, "{text:?}");
        }
    }
}
