//! Running external programs (iptables, ipset, conntrack, tc, ip): one
//! way to spawn, feed and check them, and one error that names the
//! command line and carries its stderr.
use std::{
    io::Write as _,
    process::{Command, Stdio},
};

/// A command that could not run or did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{program} is not installed")]
    Missing { program: String },
    #[error("running {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        command: String,
        /// The exit code (None: killed by a signal).
        code: Option<i32>,
        status: String,
        stderr: String,
    },
}

impl CommandError {
    /// The exit code of a command that ran and failed.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            Self::Failed { code, .. } => *code,
            _ => None,
        }
    }
}

/// Runs `program` with `args` and returns its stdout.
pub fn run(program: &str, args: &[&str]) -> Result<String, CommandError> {
    run_with_input(program, args, None)
}

/// Runs `program` with `args`, writes `stdin` to it when given, and
/// returns its stdout; a non-zero exit is an error with its stderr.
pub fn run_with_input(
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, CommandError> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    output(&mut cmd, stdin)
}

/// Runs a prepared command (e.g. one entering a network namespace).
pub fn output(cmd: &mut Command, stdin: Option<&str>) -> Result<String, CommandError> {
    let command = command_line(cmd);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => CommandError::Missing { program },
            _ => CommandError::Spawn {
                command: command.clone(),
                source,
            },
        })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // The pipe is closed when `pipe` drops, so the child sees EOF.
        pipe.write_all(text.as_bytes())
            .map_err(|source| CommandError::Spawn {
                command: command.clone(),
                source,
            })?;
    }
    let out = child
        .wait_with_output()
        .map_err(|source| CommandError::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(CommandError::Failed {
            command,
            code: out.status.code(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `program arg1 arg2 ...`, for messages.
fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_stdin_and_failures_are_reported() {
        assert_eq!(
            run_with_input("cat", &[], Some("hello")).expect("cat"),
            "hello"
        );
        let err = run("sh", &["-c", "echo oops >&2; exit 3"]).expect_err("exit 3");
        assert_eq!(err.exit_code(), Some(3));
        assert!(err.to_string().contains("oops"), "{err}");
        assert!(matches!(
            run("/nonexistent/program", &[]),
            Err(CommandError::Missing { .. })
        ));
    }
}
