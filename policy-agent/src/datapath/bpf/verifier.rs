//! A program the verifier rejects: the whole log is kept (a file, and the
//! debug log), the error carries one line that says why.
use std::path::PathBuf;

use tracing::{debug, error};

use super::error::Error;

/// The line that says why: the last one before the verifier's statistics
/// ("processed N insns ..."), which is where it states the violation.
pub fn summary(log: &str) -> String {
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let stats = lines
        .iter()
        .rposition(|l| l.starts_with("processed ") || l.starts_with("verification time"));
    let before = match stats {
        Some(i) => &lines[..i],
        None => &lines[..],
    };
    before
        .iter()
        .rev()
        .find(|l| !l.starts_with("verification time") && !l.starts_with("stack depth"))
        .map_or_else(|| "no verifier output".to_owned(), |l| (*l).to_owned())
}

/// Where the log of a rejected `program` is kept.
fn log_path(program: &str) -> PathBuf {
    let dir = std::env::var_os("POLICY_AGENT_LOG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("policy-agent-verifier-{program}.log"))
}

/// The error for `program` rejected with `log` (the load failing with
/// `errno`, said beside the summary); the log is written to a file (and
/// to the debug log), never dropped.
pub fn rejected(program: &'static str, log: &str, errno: &std::io::Error) -> Error {
    let path = log_path(program);
    if let Err(e) = std::fs::write(&path, log) {
        error!(program, error = %e, path = %path.display(), "cannot keep the verifier log");
    }
    debug!(program, "verifier log:\n{log}");
    Error::Verifier {
        program,
        summary: format!("{} ({errno})", summary(log)),
        log: path,
        lines: log.lines().count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_is_the_violation_not_the_statistics() {
        let log = "0: (bf) r6 = r1\n1: (61) r0 = *(u32 *)(r6 +80)\ninvalid access to packet, off=0 size=4\nprocessed 12 insns (limit 1000000) max_states_per_insn 0\n";
        assert_eq!(summary(log), "invalid access to packet, off=0 size=4");
        assert_eq!(summary(""), "no verifier output");
    }
}
