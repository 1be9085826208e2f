//! `peak-rss OUT CMD [ARGS...]`: runs CMD, waits for it, and writes
//! "<peak RSS in KiB> <raw wait status>" to OUT.
//!
//! A test measures a command's peak memory through this small process,
//! not by forking it itself: a forked child starts with its parent's RSS
//! high-water mark, which the kernel carries across exec into the
//! child's `ru_maxrss`, so a test binary running many tests at once would
//! report its own size. Forked from here, the figure is the command's.
//! The command dies with this process (PR_SET_PDEATHSIG), so a test that
//! kills this one on a timeout kills the command too.
use std::{os::unix::process::CommandExt as _, process::Command};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [out, cmd, rest @ ..] = args.as_slice() else {
        eprintln!("usage: peak-rss OUT CMD [ARGS...]");
        std::process::exit(2);
    };
    let mut command = Command::new(cmd);
    command.args(rest);
    // SAFETY: prctl only, between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("peak-rss: {cmd}: {e}");
            std::process::exit(2);
        }
    };
    let pid = child.id() as libc::pid_t;
    let mut raw = 0;
    // SAFETY: a zeroed rusage is a valid out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child, with valid out-pointers.
    let rc = unsafe { libc::wait4(pid, &mut raw, 0, &mut usage) };
    if rc != pid {
        eprintln!("peak-rss: wait4: {}", std::io::Error::last_os_error());
        std::process::exit(2);
    }
    if let Err(e) = std::fs::write(out, format!("{} {raw}\n", usage.ru_maxrss)) {
        eprintln!("peak-rss: {out}: {e}");
        std::process::exit(2);
    }
}
