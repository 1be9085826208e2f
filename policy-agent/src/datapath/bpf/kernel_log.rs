//! The classifier's aya-log debug lines (emitted only while the CONFIG
//! debug flag is on), forwarded into the agent's log.
use std::os::fd::AsRawFd as _;

use tracing::{info, warn};

/// A `log::Log` that re-emits kernel records through tracing.
pub struct KernelLog;

impl log::Log for KernelLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        info!(target: "kernel", "{}", record.args());
    }

    fn flush(&self) {}
}

/// Follows the log ring of the program with `program_id` from a thread.
pub fn follow_kernel_log(program_id: u32) -> Result<std::thread::JoinHandle<()>, aya_log::Error> {
    let mut logger = aya_log::EbpfLogger::init_from_id_with_logger(program_id, KernelLog)?;
    std::thread::Builder::new()
        .name("kernel-log".into())
        .spawn(move || {
            loop {
                let mut fds = [libc::pollfd {
                    fd: logger.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }];
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(fds.as_mut_ptr(), 1, 1000) };
                logger.flush();
            }
        })
        .map_err(|e| {
            warn!(error = %e, "cannot start the kernel log thread");
            aya_log::Error::MapNotFound
        })
}
