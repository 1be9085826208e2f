//! The unix socket the chained CNI plugin talks to: one request line and
//! one answer line per connection (`policy_cni::protocol`). Requests go to
//! the sync worker, which answers an ADD once the pod is enforced.
use std::{path::Path, time::Duration};

use policy_cni::protocol::{PROTOCOL_VERSION, Request, Response, code};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    sync::oneshot,
};
use tracing::{debug, warn};

use super::super::inbox::{Sink, Trigger};

/// Longest request line read.
const MAX_REQUEST: u64 = 64 * 1024;
/// How long a client has to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds `path` (replacing a stale socket; only root may connect).
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serves connections until the task is aborted.
pub async fn serve(listener: UnixListener, sink: Sink) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let sink = sink.clone();
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, sink).await {
                        debug!(error = %e, "CNI hand-off connection");
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, "accepting a CNI hand-off");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer(stream: UnixStream, sink: Sink) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST));
    let read = tokio::time::timeout(READ_TIMEOUT, reader.read_line(&mut line)).await;
    let response = match read {
        Ok(Ok(_)) => match serde_json::from_str::<Request>(&line) {
            Ok(req) if req.version == PROTOCOL_VERSION => {
                let (reply, wait) = oneshot::channel();
                if !sink.send(Trigger::Handoff(Box::new(req), reply)) {
                    Response::error(code::TRY_AGAIN, "the agent is shutting down")
                } else {
                    wait.await.unwrap_or_else(|_| {
                        Response::error(code::TRY_AGAIN, "the agent dropped the request")
                    })
                }
            }
            Ok(req) => Response::error(
                code::BAD_REQUEST,
                format!(
                    "protocol version {} (the agent speaks {PROTOCOL_VERSION})",
                    req.version
                ),
            ),
            Err(e) => Response::error(code::BAD_REQUEST, format!("malformed request: {e}")),
        },
        Ok(Err(e)) => return Err(e),
        Err(_) => Response::error(code::BAD_REQUEST, "no request within 5 s"),
    };
    let mut out = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
    out.push(b'\n');
    write.write_all(&out).await?;
    write.shutdown().await
}
