//! TCP and UDP servers inside the pods: TCP greets with "ok\n" and then
//! echoes; UDP echoes each datagram.
use std::{
    collections::HashMap,
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::Duration,
};

use super::{Error, NetNs, node::SimNode};

pub const GREETING: &[u8] = b"ok\n";

/// Servers of every pod, stopped and joined on drop.
pub struct Servers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<(), Error>>>,
}

impl Servers {
    /// Starts one server thread per pod and waits until all are bound.
    pub fn start(node: &SimNode) -> Result<Self, Error> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Error>>();
        let mut threads = Vec::new();
        for p in &node.pods {
            let stop = stop.clone();
            let ready = ready_tx.clone();
            let pod = p.pod.clone();
            let ns_name = p.netns.name.clone();
            let handle = p
                .netns
                .spawn(move || serve_pod(&ns_name, &pod, &stop, &ready))?;
            threads.push(handle);
        }
        drop(ready_tx);
        let this = Self { stop, threads };
        for _ in 0..node.pods.len() {
            match ready_rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::Invalid("pod servers did not start".into())),
            }
        }
        Ok(this)
    }

    /// Starts the servers of one pod (a pod added later).
    pub fn add(&mut self, netns: &NetNs, pod: &super::SimPod) -> Result<(), Error> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let stop = self.stop.clone();
        let pod = pod.clone();
        let ns_name = netns.name.clone();
        self.threads
            .push(netns.spawn(move || serve_pod(&ns_name, &pod, &stop, &ready_tx))?);
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| Error::Invalid("pod server did not start".into()))?
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_pod(
    netns: &str,
    pod: &super::SimPod,
    stop: &AtomicBool,
    ready: &mpsc::Sender<Result<(), Error>>,
) {
    let sock_err = |source| Error::Socket {
        netns: netns.to_owned(),
        source,
    };
    let mut listeners = Vec::new();
    let mut udp = Vec::new();
    let bound = (|| -> Result<(), Error> {
        for ip in &pod.ips {
            for port in &pod.tcp_ports {
                let l = TcpListener::bind(SocketAddr::new(*ip, *port)).map_err(sock_err)?;
                l.set_nonblocking(true).map_err(sock_err)?;
                listeners.push(l);
            }
            for port in &pod.udp_ports {
                let s = UdpSocket::bind(SocketAddr::new(*ip, *port)).map_err(sock_err)?;
                s.set_nonblocking(true).map_err(sock_err)?;
                udp.push(s);
            }
        }
        Ok(())
    })();
    let failed = bound.is_err();
    let _ = ready.send(bound);
    if failed {
        return;
    }
    let mut conns: HashMap<RawFd, TcpStream> = HashMap::new();
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        let mut fds: Vec<libc::pollfd> = listeners
            .iter()
            .map(|l| l.as_raw_fd())
            .chain(udp.iter().map(|u| u.as_raw_fd()))
            .chain(conns.keys().copied())
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: fds is a valid array of pollfd for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if n <= 0 {
            continue;
        }
        for pfd in fds.iter().filter(|p| p.revents != 0) {
            if let Some(l) = listeners.iter().find(|l| l.as_raw_fd() == pfd.fd) {
                while let Ok((mut s, _)) = l.accept() {
                    let _ = s.set_nonblocking(true);
                    let _ = s.write_all(GREETING);
                    conns.insert(s.as_raw_fd(), s);
                }
            } else if let Some(u) = udp.iter().find(|u| u.as_raw_fd() == pfd.fd) {
                while let Ok((len, from)) = u.recv_from(&mut buf) {
                    let _ = u.send_to(&buf[..len], from);
                }
            } else if let Some(s) = conns.get_mut(&pfd.fd) {
                match s.read(&mut buf) {
                    Ok(0) => {
                        conns.remove(&pfd.fd);
                    }
                    Ok(len) => {
                        let _ = s.write_all(&buf[..len]);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(_) => {
                        conns.remove(&pfd.fd);
                    }
                }
            }
        }
    }
}
