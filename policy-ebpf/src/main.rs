//! The kernel classifier: judges every packet on a local pod's host-side
//! veth against the policy maps the agent writes.
//!
//! `from_pod` runs at host-veth ingress (what the pod sends: its egress
//! policy); `to_pod` at host-veth egress (what reaches the pod: its ingress
//! policy). See `docs/ARCHITECTURE.md` for the maps and the lookup order.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod classify;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod parse;

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
        classify(&ctx, direction::INGRESS)
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
