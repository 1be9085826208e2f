//! The kernel classifier: judges every packet on a local pod's host-side
//! veth against the policy maps the agent writes.
//!
//! `from_pod` runs at host-veth ingress (what the pod sends: its egress
//! policy); `to_pod` at host-veth egress (what reaches the pod: its ingress
//! policy); `to_uplink` and `from_uplink` on every other interface. See
//! `docs/ARCHITECTURE.md` for the maps and the lookup order.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// An atomic add on a map value (BPF_ATOMIC): the target has no
// compare-and-swap, so `core::sync::atomic` offers no read-modify-write.
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

#[cfg(target_arch = "bpf")]
mod classify;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod pod_range_guard;

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{macros::classifier, programs::TcContext};
    use policy_common::direction;

    use crate::classify::classify;

    /// Host-veth ingress: the pod's egress.
    #[classifier]
    pub fn from_pod(ctx: TcContext) -> i32 {
        classify(&ctx, direction::EGRESS)
    }

    /// Host-veth egress: the pod's ingress.
    #[classifier]
    pub fn to_pod(ctx: TcContext) -> i32 {
        // First the egress of a client whose packet DNAT brought here.
        if crate::classify::marked(&ctx) && !crate::classify::dnat_hook(&ctx) {
            return crate::classify::DROP;
        }
        // Out of line: see `dnat_hook`.
        crate::classify::classify_out_of_line(&ctx, direction::INGRESS)
    }

    /// Uplink egress: a pod's egress to a Service backend on another node.
    #[classifier]
    pub fn to_uplink(ctx: TcContext) -> i32 {
        crate::classify::uplink::<false>(&ctx)
    }

    /// Uplink ingress (with `--pod-cidr`): nothing enters the node for a
    /// local address that is not enforced yet.
    #[classifier]
    pub fn from_uplink(ctx: TcContext) -> i32 {
        crate::pod_range_guard::from_uplink::<false>(&ctx)
    }

    /// [`to_uplink`] on a device without a link-layer header (loaded only
    /// where the node has one).
    #[classifier]
    pub fn to_uplink_l3(ctx: TcContext) -> i32 {
        crate::classify::uplink::<true>(&ctx)
    }

    /// [`from_uplink`] on a device without a link-layer header.
    #[classifier]
    pub fn from_uplink_l3(ctx: TcContext) -> i32 {
        crate::pod_range_guard::from_uplink::<true>(&ctx)
    }
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    panic!("policy-ebpf only runs as a BPF object; build it for bpfel-unknown-none");
}

/// Reference programs for the benchmarks and tests, loaded only by them:
/// the floors the classifier's per-packet cost is compared with, and a
/// stand-in for a foreign program.
#[cfg(target_arch = "bpf")]
mod floors {
    use aya_ebpf::{bindings::TC_ACT_UNSPEC, macros::classifier, programs::TcContext};
    use policy_common::conntrack::CtEntry;

    use crate::{
        classify::fill_ct_key,
        maps::{CONNTRACK, SCRATCH},
        parse::{IP, parse},
    };

    /// Returns at once: the cost of running any program at all.
    #[classifier]
    pub fn floor_empty(_ctx: TcContext) -> i32 {
        TC_ACT_UNSPEC
    }

    /// Another product's program that accepts everything (`TC_ACT_OK`
    /// ends a TCX chain): the tests check ours runs before it.
    #[classifier]
    pub fn foreign_pass(_ctx: TcContext) -> i32 {
        aya_ebpf::bindings::TC_ACT_OK
    }

    /// Parses the same headers and does one hash lookup (the 5-tuple, a
    /// hit): the least any stateful enforcer can do.
    #[classifier]
    pub fn floor_one_lookup(ctx: TcContext) -> i32 {
        let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
            return TC_ACT_UNSPEC;
        };
        // SAFETY: this CPU's slot; programs do not nest on one CPU.
        let s = unsafe { &mut *scratch };
        if parse(&ctx, &mut s.pkt) == IP {
            // SAFETY: the context pointer is the kernel's __sk_buff for this run.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            fill_ct_key(
                &mut s.ct,
                ifindex,
                policy_common::direction::EGRESS,
                &s.pkt,
                policy_common::conntrack::CT_OPENER_EITHER,
            );
            if CONNTRACK.get_ptr(&s.ct).is_some() {
                return TC_ACT_UNSPEC;
            }
            // The first run records the flow, so the measured runs hit, as
            // an established flow does.
            let _ = CONNTRACK.insert(&s.ct, &CtEntry::default(), 0);
        }
        TC_ACT_UNSPEC
    }
}
