//! Foreign TCX programs for the order tests, and whether the kernel has
//! TCX at all.

use aya::programs::{LinkOrder, TcAttachType, tc::TcAttachOptions};
use policy_agent::datapath::bpf::Unpinned;

/// TCX came with Linux 6.6.
pub fn kernel_has_tcx() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(['.', '-']);
    let major: u32 = parts.next().unwrap().parse().unwrap();
    let minor: u32 = parts.next().unwrap().parse().unwrap();
    (major, minor) >= (6, 6)
}

/// Attaches the test program `program` of `dp` through TCX at `hooks` of
/// every interface in `ifaces`, each placed by `order` (the links live as
/// long as `dp`).
pub fn attach_foreign(
    dp: &mut Unpinned,
    program: &'static str,
    ifaces: &[String],
    hooks: &[TcAttachType],
    order: fn() -> LinkOrder,
) {
    let prog = dp.extra_program(program).unwrap();
    for i in ifaces {
        for t in hooks {
            prog.attach_with_options(i, *t, TcAttachOptions::TcxOrder(order()))
                .unwrap();
        }
    }
}

pub const BOTH: [TcAttachType; 2] = [TcAttachType::Ingress, TcAttachType::Egress];
