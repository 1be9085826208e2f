//! A minimal HTTP/1.1 server for /metrics, /healthz and /readyz: GET only,
//! one request per connection.
use std::{net::SocketAddr, sync::Arc};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
};
use tracing::{debug, info};

use super::Metrics;

/// Serves until the task is dropped. Returns the bound address once
/// listening (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    info!(%bound, "serving /metrics, /healthz, /readyz");
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, peer)) = listener.accept().await else {
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
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
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((bound, task))
}
