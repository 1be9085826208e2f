//! The subscribers' socket: an abstract unix socket in the agent's
//! network namespace, named from the pin directory, so `flows` finds the
//! daemon that reads those pins (and a second agent with other pins does
//! not collide). Only root may subscribe: flows name every pod's peers.
use std::{
    io::{self, Read as _, Write as _},
    os::{
        fd::AsRawFd as _,
        linux::net::SocketAddrExt as _,
        unix::net::{SocketAddr, UnixListener, UnixStream},
    },
    sync::Arc,
    time::Duration,
};

use tracing::{debug, info, warn};

use super::{Error, hub::Hub, stats::FlowStats};
use crate::datapath::bpf::pins::PinLayout;

/// The abstract name (without its leading NUL) for the pins of `layout`.
pub fn socket_name(layout: &PinLayout) -> String {
    format!("policy-agent-flows:{}", layout.root().display())
}

fn address(layout: &PinLayout) -> Result<SocketAddr, Error> {
    let name = socket_name(layout);
    SocketAddr::from_abstract_name(name.as_bytes()).map_err(|source| Error::Socket { name, source })
}

/// The uid of the process at the other end.
fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket, and a ucred-sized buffer with its length.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Whether the peer has hung up (a subscriber that stopped reading is
/// found when a write fails; one that left while no flow came, here).
fn hung_up(stream: &UnixStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: a one-byte buffer; MSG_PEEK | MSG_DONTWAIT neither consumes
    // nor blocks.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            (&raw mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n == 0
}

/// What a client asks for, in its first line.
pub const SUBSCRIBE: &str = "flows";
pub const STAGED_REPORT: &str = "staged-report";

/// Listens for subscribers of the flows of `layout`'s pins, from a thread
/// of its own, each served by a thread writing its queue; and answers
/// requests for the staged report from `stats`.
pub fn serve(layout: &PinLayout, hub: Arc<Hub>, stats: Arc<FlowStats>) -> Result<(), Error> {
    let name = socket_name(layout);
    let listener = UnixListener::bind_addr(&address(layout)?).map_err(|source| Error::Socket {
        name: name.clone(),
        source,
    })?;
    info!(socket = %format!("@{name}"), "serving flows");
    std::thread::Builder::new()
        .name("flow-subscribers".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => accept(s, &hub, &stats),
                    Err(e) => warn!(error = %e, "accepting a flow subscriber"),
                }
            }
        })
        .map_err(|source| Error::Socket { name, source })?;
    Ok(())
}

/// The client's request: its first line, read within a second.
fn request(stream: &UnixStream) -> io::Result<String> {
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    let mut reader = stream;
    while line.len() < 64 {
        if reader.read(&mut byte)? == 0 || byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&line).trim().to_owned())
}

fn accept(stream: UnixStream, hub: &Arc<Hub>, stats: &Arc<FlowStats>) {
    match peer_uid(&stream) {
        Ok(0) => {}
        Ok(uid) => {
            debug!(uid, "flow subscriber refused: not root");
            return;
        }
        Err(e) => {
            warn!(error = %e, "flow subscriber refused: no credentials");
            return;
        }
    }
    // The request is read on the client's own thread: a client slow to
    // send it holds up no other.
    let (hub, stats) = (hub.clone(), stats.clone());
    let spawned = std::thread::Builder::new()
        .name("flow-subscriber".into())
        .spawn(move || serve_client(stream, &hub, &stats));
    if let Err(e) = spawned {
        warn!(error = %e, "starting a flow subscriber's thread");
    }
}

/// Answers one client: the staged report, or its subscription.
fn serve_client(mut stream: UnixStream, hub: &Hub, stats: &FlowStats) {
    match request(&stream).as_deref() {
        Ok(SUBSCRIBE) => {}
        Ok(STAGED_REPORT) => {
            let report = stats.staged.report();
            if let Ok(line) = serde_json::to_string(&report) {
                let _ = writeln!(stream, "{line}");
            }
            return;
        }
        Ok(other) => {
            let _ = writeln!(stream, "{{\"error\":\"unknown request {other:?}\"}}");
            return;
        }
        // A client that says nothing (an older `flows`) subscribes.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) => {}
        Err(e) => {
            debug!(error = %e, "flow client sent no request");
            return;
        }
    }
    let Some(queue) = hub.subscribe() else {
        let _ = writeln!(stream, "{{\"error\":\"too many flow subscribers\"}}");
        return;
    };
    // A subscriber stopped for this long is let go, freeing its place.
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    loop {
        match queue.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => {
                let mut buf = Vec::with_capacity(line.len() + 1);
                buf.extend_from_slice(line.as_bytes());
                buf.push(b'\n');
                if stream.write_all(&buf).is_err() {
                    return;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if hung_up(&stream) {
                    return;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Connects to the daemon serving the flows of `layout`'s pins and sends
/// `request` (None: none listens).
pub fn connect(layout: &PinLayout, request: &str) -> Result<Option<UnixStream>, Error> {
    match UnixStream::connect_addr(&address(layout)?) {
        Ok(mut s) => {
            writeln!(s, "{request}").map_err(|source| Error::Socket {
                name: socket_name(layout),
                source,
            })?;
            Ok(Some(s))
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
            ) =>
        {
            Ok(None)
        }
        Err(source) => Err(Error::Socket {
            name: socket_name(layout),
            source,
        }),
    }
}
