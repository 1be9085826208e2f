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

/// `program` attached through TCX from inside `netns` (a thread that holds
/// the links), for as long as this value lives.
pub struct Foreign {
    done: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), policy_agent::sim::Error>>>,
}

impl Foreign {
    pub fn attach(
        netns: &policy_agent::sim::NetNs,
        program: &'static str,
        ifaces: Vec<String>,
        order: fn() -> LinkOrder,
    ) -> Self {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = netns
            .spawn(move || {
                let mut dp = Unpinned::load().unwrap();
                attach_foreign(&mut dp, program, &ifaces, &BOTH, order);
                ready_tx.send(()).unwrap();
                let _ = done_rx.recv();
            })
            .unwrap();
        ready_rx.recv().expect("the foreign programs are attached");
        Self {
            done: Some(done_tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
