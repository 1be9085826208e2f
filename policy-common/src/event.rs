//! Flow records, sent through the `DROP_EVENTS` ring buffer: every new
//! flow the classifier judges by policy (allowed or dropped), and every
//! other dropped packet, each with what decided it.
//!
//! A record carries a compact rule reference ([`RuleRef`]); the agent
//! turns it into names through `RULE_NAMES`. Records are rate-limited per
//! CPU ([`FlowBudget`]); what the limit holds back is counted
//! (`Reason::RecordLimited`), as is what a full ring loses
//! (`Reason::EventLost`).
use crate::{assert_size, policy::TierSlot, verdict::Reason};

/// What decided a new flow, as the policy lookup found it: the
/// NetworkPolicy rule of the first entry that allowed it (`rule_ref`, 0
/// when none did) and, for an endpoint ClusterNetworkPolicy tiers judge,
/// the best slot of each tier. Which of them decided follows from the
/// record's reason.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RuleRef {
    /// `PolicyEntry::rule_ref` of the first allowing NetworkPolicy entry.
    pub network_policy: u32,
    pub admin: TierSlot,
    pub baseline: TierSlot,
}
assert_size!(RuleRef, 12);

impl RuleRef {
    /// What a record of `reason` keeps of what the lookup found: the
    /// NetworkPolicy rule for a NetworkPolicy allow, the deciding tier's
    /// slot for a tier's verdict, all of it for an established flow a
    /// change denied (the agent reads which decided), nothing for any
    /// other reason (no lookup decided it; a policy drop is named by the
    /// policies that isolate the pod, which the agent knows).
    #[inline(always)]
    pub const fn kept_for(self, reason: Reason) -> Self {
        let none = TierSlot::NONE;
        match reason {
            Reason::AllowPolicy => Self {
                network_policy: self.network_policy,
                admin: none,
                baseline: none,
            },
            Reason::AllowAdminTier | Reason::DropAdminTier => Self {
                network_policy: 0,
                admin: self.admin,
                baseline: none,
            },
            Reason::AllowBaselineTier | Reason::DropBaselineTier => Self {
                network_policy: 0,
                admin: none,
                baseline: self.baseline,
            },
            Reason::DropPolicyChanged => self,
            _ => Self {
                network_policy: 0,
                admin: none,
                baseline: none,
            },
        }
    }
}

/// [`FlowRecord::flags`]: the record is a new flow (its first packet,
/// allowed or dropped), not a dropped packet of some other kind.
pub const RECORD_NEW_FLOW: u8 = 1 << 0;

#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FlowRecord {
    /// CLOCK_MONOTONIC to a tick (`bpf_ktime_get_coarse_ns`).
    pub timestamp_ns: u64,
    /// Host-side interface of the local pod.
    pub ifindex: u32,
    pub endpoint_identity: u32,
    /// Label identity of the peer (0: none).
    pub peer_identity: u32,
    /// Address-class identity of the peer.
    pub peer_cidr_identity: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub protocol: u8,
    pub family: u8,
    /// [`crate::direction`].
    pub direction: u8,
    /// [`crate::verdict::Reason`] as u8.
    pub reason: u8,
    /// What decided it (meaningful for the reasons a policy lookup gives).
    pub rule: RuleRef,
    /// [`RECORD_NEW_FLOW`].
    pub flags: u8,
    /// Zero. Room for a second verdict judged in the kernel; the agent
    /// judges staged policies itself, from the record (its staged view).
    pub _reserved_reason: u8,
    pub _pad: u16,
    /// Zero, as `_reserved_reason`.
    pub _reserved_rule: RuleRef,
    pub _pad1: u32,
}
assert_size!(FlowRecord, 96);

/// The one slot (per CPU) of `FLOW_BUDGET`: a token bucket counted in
/// nanoseconds. Each record costs `cost_ns`; the bucket refills with the
/// time that passes, up to `burst_ns`. The agent writes `cost_ns` and
/// `burst_ns` (0: no limit); the classifier keeps the rest.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FlowBudget {
    pub cost_ns: u64,
    pub burst_ns: u64,
    pub tokens_ns: u64,
    pub last_ns: u64,
}
assert_size!(FlowBudget, 32);

impl FlowBudget {
    /// A budget of `per_second` records a second on each CPU, up to
    /// `burst` at once (`per_second` 0: no limit).
    pub const fn new(per_second: u64, burst: u64) -> Self {
        if per_second == 0 {
            return Self {
                cost_ns: 0,
                burst_ns: 0,
                tokens_ns: 0,
                last_ns: 0,
            };
        }
        let cost_ns = 1_000_000_000 / per_second;
        let burst = if burst == 0 { 1 } else { burst };
        Self {
            cost_ns,
            burst_ns: cost_ns * burst,
            tokens_ns: cost_ns * burst,
            last_ns: 0,
        }
    }

    /// Whether one more record may go out at `now_ns`, taking its cost.
    #[inline(always)]
    pub fn take(&mut self, now_ns: u64) -> bool {
        if self.cost_ns == 0 {
            return true;
        }
        let elapsed = now_ns.saturating_sub(self.last_ns);
        self.last_ns = now_ns;
        let tokens = self.tokens_ns.saturating_add(elapsed);
        let tokens = if tokens > self.burst_ns {
            self.burst_ns
        } else {
            tokens
        };
        if tokens >= self.cost_ns {
            self.tokens_ns = tokens - self.cost_ns;
            true
        } else {
            self.tokens_ns = tokens;
            false
        }
    }
}

#[cfg(feature = "user")]
crate::user_pod!(FlowRecord, FlowBudget, RuleRef);

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn a_budget_lets_its_burst_out_at_once_then_its_rate() {
        let mut b = FlowBudget::new(10, 3);
        let t0 = 5 * SECOND;
        // The burst, at once (the first call also refills: capped).
        assert_eq!((0..10).filter(|_| b.take(t0)).count(), 3);
        // A tenth of a second is one more record, no more.
        assert!(b.take(t0 + SECOND / 10));
        assert!(!b.take(t0 + SECOND / 10));
        // Fractions are kept: two half-periods make one record.
        assert!(!b.take(t0 + SECOND / 10 + SECOND / 20));
        assert!(b.take(t0 + SECOND / 10 + SECOND / 10));
        // A long pause refills the burst, never more.
        let later = t0 + 100 * SECOND;
        assert_eq!((0..10).filter(|_| b.take(later)).count(), 3);
    }

    #[test]
    fn a_budget_of_zero_is_no_limit() {
        let mut b = FlowBudget::new(0, 5);
        assert!((0..10_000).all(|i| b.take(i)));
        let mut zeroed = FlowBudget::default();
        assert!(zeroed.take(1));
    }

    #[test]
    fn a_record_keeps_what_its_reason_decided_by() {
        let all = RuleRef {
            network_policy: 7,
            admin: TierSlot::new(3, crate::policy::action::DENY),
            baseline: TierSlot::new(9, crate::policy::action::ACCEPT),
        };
        let np_only = RuleRef {
            network_policy: 7,
            ..RuleRef::default()
        };
        let admin_only = RuleRef {
            admin: all.admin,
            ..RuleRef::default()
        };
        let baseline_only = RuleRef {
            baseline: all.baseline,
            ..RuleRef::default()
        };
        for (reason, kept) in [
            (Reason::AllowPolicy, np_only),
            (Reason::AllowAdminTier, admin_only),
            (Reason::DropAdminTier, admin_only),
            (Reason::AllowBaselineTier, baseline_only),
            (Reason::DropBaselineTier, baseline_only),
            (Reason::DropPolicyChanged, all),
            (Reason::DropPolicy, RuleRef::default()),
            (Reason::AllowNotIsolated, RuleRef::default()),
            (Reason::DropSpoofed, RuleRef::default()),
        ] {
            assert_eq!(all.kept_for(reason), kept, "{reason:?}");
        }
    }
}
