//! One exchange with the agent: connect to its unix socket, write one JSON
//! line, read one JSON line, all within one deadline. A slow agent hits
//! the socket's read timeout; an agent that is not there yet (restarting)
//! is retried until the deadline when asked to.
use std::{
    io::{self, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, net::UnixStream},
    },
    path::Path,
    time::{Duration, Instant},
};

use crate::protocol::{Request, Response};

/// The longest answer read (an answer is a few hundred bytes).
const MAX_REPLY: usize = 64 * 1024;
/// Pause between connection attempts while the agent is away.
const RETRY_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the agent does not listen on {path}: {source}")]
    Unreachable {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("the agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("talking to the agent: {0}")]
    Io(#[source] io::Error),
    #[error("the agent's answer is not a response: {0}")]
    BadReply(String),
}

/// Sends `request`, returns the agent's answer. With `retry_connect`, a
/// missing or refusing socket is tried again until `timeout` has passed.
pub fn exchange(
    socket: &Path,
    request: &Request,
    timeout: Duration,
    retry_connect: bool,
) -> Result<Response, ClientError> {
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        match connect(socket) {
            Ok(s) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // The listener's backlog is full: the agent is busy.
            }
            Err(source) if !retry_connect => {
                return Err(ClientError::Unreachable {
                    path: socket.display().to_string(),
                    source,
                });
            }
            Err(source) => {
                if Instant::now() + RETRY_EVERY >= deadline {
                    return Err(ClientError::Unreachable {
                        path: socket.display().to_string(),
                        source,
                    });
                }
            }
        }
        if Instant::now() + RETRY_EVERY >= deadline {
            return Err(ClientError::Timeout(timeout));
        }
        std::thread::sleep(RETRY_EVERY);
    };
    let left = |deadline: Instant| {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(ClientError::Timeout(timeout))
    };
    let timed_out = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout(timeout),
        _ => ClientError::Io(e),
    };
    let mut line = serde_json::to_vec(request).map_err(|e| ClientError::BadReply(e.to_string()))?;
    line.push(b'\n');
    stream
        .set_write_timeout(Some(left(deadline)?))
        .map_err(ClientError::Io)?;
    stream.write_all(&line).map_err(timed_out)?;
    let mut reply = Vec::new();
    let mut chunk = [0u8; 4096];
    while !reply.contains(&b'\n') {
        stream
            .set_read_timeout(Some(left(deadline)?))
            .map_err(ClientError::Io)?;
        let n = stream.read(&mut chunk).map_err(timed_out)?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&chunk[..n]);
        if reply.len() > MAX_REPLY {
            return Err(ClientError::BadReply(format!(
                "longer than {MAX_REPLY} bytes"
            )));
        }
    }
    let text = reply.split(|&b| b == b'\n').next().unwrap_or_default();
    if text.is_empty() {
        return Err(ClientError::BadReply(
            "the connection closed without an answer".into(),
        ));
    }
    serde_json::from_slice(text)
        .map_err(|e| ClientError::BadReply(format!("{e}: {}", String::from_utf8_lossy(text))))
}

/// A non-blocking connect (a blocking one waits without bound on a full
/// backlog), then a blocking stream with timeouts.
fn connect(path: &Path) -> io::Result<UnixStream> {
    // SAFETY: a zeroed sockaddr_un is valid; the path is copied in below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un and `len` is within it.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            libc::socklen_t::try_from(len).unwrap_or(0),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;
    use crate::protocol::{Command, PROTOCOL_VERSION};

    fn socket_path(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!(
            "policy-cni-client-{tag}-{}.sock",
            std::process::id()
        ))
    }

    fn status() -> Request {
        Request {
            version: PROTOCOL_VERSION,
            container_id: String::new(),
            command: Command::Status,
        }
    }

    #[test]
    fn an_answer_is_read_back() {
        let path = socket_path("ok");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap_or_else(|e| panic!("{e}"));
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
            let mut buf = [0u8; 512];
            let n = s.read(&mut buf).unwrap_or(0);
            let req: Request = serde_json::from_slice(&buf[..n]).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(req.command, Command::Status);
            s.write_all(b"{\"ok\":true}\n").unwrap_or_default();
        });
        let r = exchange(&path, &status(), Duration::from_secs(2), false);
        let _ = server.join();
        let _ = std::fs::remove_file(&path);
        assert_eq!(r.ok(), Some(Response::ok()));
    }

    #[test]
    fn a_silent_agent_times_out_on_the_deadline() {
        let path = socket_path("slow");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap_or_else(|e| panic!("{e}"));
        let start = Instant::now();
        let r = exchange(&path, &status(), Duration::from_millis(300), false);
        let took = start.elapsed();
        drop(listener);
        let _ = std::fs::remove_file(&path);
        assert!(matches!(r, Err(ClientError::Timeout(_))), "{r:?}");
        assert!(
            took >= Duration::from_millis(290) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[test]
    fn an_absent_agent_is_retried_until_the_deadline_when_asked() {
        let path = socket_path("absent");
        let _ = std::fs::remove_file(&path);
        let start = Instant::now();
        let once = exchange(&path, &status(), Duration::from_secs(5), false);
        assert!(
            matches!(once, Err(ClientError::Unreachable { .. })),
            "{once:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(1));
        let start = Instant::now();
        let retried = exchange(&path, &status(), Duration::from_millis(400), true);
        assert!(retried.is_err());
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }
}
