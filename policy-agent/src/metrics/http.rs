//! A minimal HTTP/1.1 server for /metrics, /healthz and /readyz: GET only,
//! one request per connection.
//!
//! Whoever can reach the address can hold connections open, so each
//! listener is bounded (see [`Limits`]): a request head must arrive within
//! a deadline, a response must be written within one, and past a cap of
//! connections the oldest one still sending its request is closed to make
//! room (a flood of idle connections cannot starve a probe). Descriptors
//! held stay below twice the cap. Accept errors (out of descriptors) back
//! off instead of spinning.
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    task::AbortHandle,
};
use tracing::{debug, info, warn};

use super::Metrics;

/// Bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once. A new one past it closes the oldest
    /// connection still sending its request; if every one is being
    /// answered, the new one is closed.
    pub max_connections: usize,
    /// From accept to the end of the request head (slow senders included).
    pub read_timeout: Duration,
    /// To write the whole response.
    pub write_timeout: Duration,
}

impl Default for Limits {
    /// A probe or a scrape is one short request: 64 connections, 5 s to
    /// send it, 10 s to take the answer.
    fn default() -> Self {
        Self {
            max_connections: 64,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// Longest pause after an accept error; the first is 10 ms, doubled each time.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The request head is read into this much at most.
const HEAD_MAX: usize = 8192;

/// Serves until the task is dropped. Returns the bound address once
/// listening (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    limits: Limits,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    info!(%bound, max_connections = limits.max_connections, "serving /metrics, /healthz, /readyz");
    let task = tokio::spawn(accept_loop(listener, metrics, limits));
    Ok((bound, task))
}

async fn accept_loop(listener: TcpListener, metrics: Arc<Metrics>, limits: Limits) {
    let open = Arc::new(Open::default());
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        // Closed connections let go of their descriptor when their task
        // is dropped, on another thread: never hold more than twice the cap.
        while open.held() >= 2 * limits.max_connections.max(1) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => {
                backoff = ACCEPT_BACKOFF_MIN;
                accepted
            }
            Err(e) => {
                // EMFILE and the like persist until something closes: a
                // retry at once would spin.
                metrics.http_dropped("accept_error");
                warn!(error = %e, pause_ms = backoff.as_millis() as u64, "accepting an HTTP connection");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let Some(id) = open.admit(limits.max_connections, &metrics) else {
            metrics.http_dropped("full");
            debug!(%peer, "HTTP connections at the cap, all answering: closed");
            continue;
        };
        let guard = Guard {
            open: open.clone(),
            id,
        };
        let task = tokio::spawn(connection(stream, peer, metrics.clone(), limits, guard));
        open.started(id, task.abort_handle());
    }
}

#[derive(Debug)]
enum Phase {
    /// Sending its request: may be closed for a newer connection.
    Reading(Option<AbortHandle>),
    Answering,
}

/// The connections of one listener, oldest first.
#[derive(Debug, Default)]
struct Open {
    inner: Mutex<OpenInner>,
    /// Connections whose task still holds the socket (closed ones
    /// included until their task is dropped).
    held: AtomicUsize,
}

#[derive(Debug, Default)]
struct OpenInner {
    next: u64,
    live: BTreeMap<u64, Phase>,
}

impl Open {
    /// Room for one more connection (closing the oldest one still reading
    /// if at the cap), or None when every one is being answered.
    fn admit(&self, max: usize, metrics: &Metrics) -> Option<u64> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.live.len() >= max.max(1) {
            let oldest = inner
                .live
                .iter()
                .find(|(_, p)| matches!(p, Phase::Reading(_)))
                .map(|(id, _)| *id)?;
            if let Some(Phase::Reading(Some(task))) = inner.live.remove(&oldest) {
                task.abort();
            }
            metrics.http_dropped("evicted");
        }
        let id = inner.next;
        inner.next += 1;
        self.held.fetch_add(1, Ordering::Relaxed);
        inner.live.insert(id, Phase::Reading(None));
        Some(id)
    }

    fn started(&self, id: u64, task: AbortHandle) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Absent if the connection is already over.
        if let Some(phase) = inner.live.get_mut(&id) {
            *phase = Phase::Reading(Some(task));
        }
    }

    fn answering(&self, id: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(phase) = inner.live.get_mut(&id) {
            *phase = Phase::Answering;
        }
    }

    fn close(&self, id: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.live.remove(&id);
        self.held.fetch_sub(1, Ordering::Relaxed);
    }

    fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// A connection's place among the open ones, given up when its task ends
/// (or is aborted).
struct Guard {
    open: Arc<Open>,
    id: u64,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.open.close(self.id);
    }
}

async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    metrics: Arc<Metrics>,
    limits: Limits,
    guard: Guard,
) {
    let mut buf = vec![0u8; HEAD_MAX];
    let len =
        match tokio::time::timeout(limits.read_timeout, read_head(&mut stream, &mut buf)).await {
            Ok(len) => len,
            Err(_) => {
                metrics.http_dropped("read_timeout");
                debug!(%peer, "HTTP request head not sent in time: closed");
                return;
            }
        };
    guard.open.answering(guard.id);
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    debug!(%peer, method, path, "http");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => {
            let m = metrics.clone();
            let body = tokio::task::spawn_blocking(move || m.render())
                .await
                .unwrap_or_default();
            ("200 OK", "text/plain; version=0.0.4", body)
        }
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".to_owned()),
        ("GET", "/readyz") => match metrics.not_ready() {
            None => ("200 OK", "text/plain", "ready\n".to_owned()),
            Some(why) => (
                "503 Service Unavailable",
                "text/plain",
                format!("not ready: {why}\n"),
            ),
        },
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".to_owned()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_owned(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    if tokio::time::timeout(limits.write_timeout, write)
        .await
        .is_err()
    {
        metrics.http_dropped("write_timeout");
        debug!(%peer, "HTTP response not taken in time: closed");
    }
}

/// Reads until the end of the request head, the buffer is full or the
/// peer stops sending; returns how much was read.
async fn read_head(stream: &mut TcpStream, buf: &mut [u8]) -> usize {
    let mut len = 0;
    while len < buf.len() {
        match stream.read(&mut buf[len..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    len
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpStream;

    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    fn limits(max_connections: usize, read_timeout: Duration) -> Limits {
        Limits {
            max_connections,
            read_timeout,
            write_timeout: Duration::from_secs(5),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_past_the_cap_do_not_starve_a_probe() {
        let metrics = Arc::new(Metrics::new());
        let (addr, _task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            metrics.clone(),
            limits(8, Duration::from_secs(60)),
        )
        .await
        .unwrap();
        let mut idle = Vec::new();
        for _ in 0..50 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let answer = tokio::time::timeout(Duration::from_secs(5), get(addr, "/healthz"))
            .await
            .expect("/healthz answers with 50 idle connections open");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // The server kept 7 of them (the probe took the 8th place); it
        // closed the others, oldest first.
        let mut closed = 0;
        for s in &mut idle {
            let mut buf = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await;
            if let Ok(Ok(0) | Err(_)) = read {
                closed += 1;
            }
        }
        assert_eq!(closed, 43, "idle connections the server closed");
        assert!(
            metrics
                .render()
                .contains("policy_agent_http_dropped_total{reason=\"evicted\"} 43")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_that_sends_nothing_is_closed_after_the_read_timeout() {
        let metrics = Arc::new(Metrics::new());
        let (addr, _task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            metrics.clone(),
            limits(8, Duration::from_millis(200)),
        )
        .await
        .unwrap();
        let mut s = TcpStream::connect(addr).await.unwrap();
        // A slow sender: a byte, then nothing.
        s.write_all(b"G").await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("closed by the server")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without an answer");
        assert!(
            metrics
                .render()
                .contains("policy_agent_http_dropped_total{reason=\"read_timeout\"} 1")
        );
    }
}
