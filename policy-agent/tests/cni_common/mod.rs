//! For the CNI plugin tests: a stand-in agent (the real one serves the
//! same protocol), temporary directories, and a simulated node with a
//! runtime driving Debian's ptp + host-local and our plugin.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod agent;
pub mod traffic;

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixListener,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use policy_agent::sim::{
    SimNode, cleanup_prefix,
    cni::{CniRuntime, Sandbox, test_cni_path},
};
use policy_cni::protocol::{Request, Response};
use serde_json::{Value, json};

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("policy-cni-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the stand-in answers.
#[derive(Clone, Debug)]
pub enum Answer {
    /// ok after a delay (the time enforcing takes).
    Confirm(Duration),
    /// ok: false with this code.
    Refuse(u32, &'static str),
    /// Accepts and never answers.
    Silent,
}

/// A request as the stand-in saw it, and when.
#[derive(Clone, Debug)]
pub struct Seen {
    pub request: Request,
    pub received: Instant,
    pub answered: Option<Instant>,
}

/// A tiny agent on a unix socket: one JSON line in, one out, per
/// connection, answering as `decide` says.
pub struct StandIn {
    pub path: PathBuf,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StandIn {
    pub fn start(
        path: PathBuf,
        decide: impl Fn(&Request) -> Answer + Send + Sync + 'static,
    ) -> Self {
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let decide = Arc::new(decide);
        let thread = {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((conn, _)) = listener.accept() else {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    };
                    let (seen, stop, decide) =
                        (Arc::clone(&seen), Arc::clone(&stop), Arc::clone(&decide));
                    std::thread::spawn(move || serve(conn, &seen, &stop, &*decide));
                }
            })
        };
        Self {
            path,
            seen,
            stop,
            thread: Some(thread),
        }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve(
    mut conn: std::os::unix::net::UnixStream,
    seen: &Mutex<Vec<Seen>>,
    stop: &AtomicBool,
    decide: &(dyn Fn(&Request) -> Answer + Send + Sync),
) {
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut line = String::new();
    if BufReader::new(&conn).read_line(&mut line).is_err() {
        return;
    }
    let request: Request =
        serde_json::from_str(&line).expect("the plugin sends a protocol request");
    let received = Instant::now();
    let index = {
        let mut s = seen.lock().unwrap();
        s.push(Seen {
            request: request.clone(),
            received,
            answered: None,
        });
        s.len() - 1
    };
    let response = match decide(&request) {
        Answer::Confirm(delay) => {
            std::thread::sleep(delay);
            Response::ok()
        }
        Answer::Refuse(code, message) => Response::error(code, message),
        Answer::Silent => {
            let until = Instant::now() + Duration::from_secs(30);
            while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            return;
        }
    };
    let mut text = serde_json::to_string(&response).unwrap();
    text.push('\n');
    if conn.write_all(text.as_bytes()).is_ok() {
        seen.lock().unwrap()[index].answered = Some(Instant::now());
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A ptp + host-local list (ipMasq off: no iptables rules to clean up;
/// host-local's state in `data_dir`) with our plugin last; kindnet's
/// portmap in between for 0.3.1, as kind's list has it.
pub fn ptp_list(
    version: &str,
    data_dir: &Path,
    socket: &Path,
    timeout_seconds: f64,
    dual_stack: bool,
) -> Value {
    let mut ranges = vec![json!([{"subnet": "10.99.0.0/24"}])];
    let mut routes = vec![json!({"dst": "0.0.0.0/0"})];
    if dual_stack {
        ranges.push(json!([{"subnet": "fd00:99::/64"}]));
        routes.push(json!({"dst": "::/0"}));
    }
    let mut plugins = vec![json!({
        "type": "ptp",
        "ipMasq": false,
        "mtu": 1500,
        "ipam": {"type": "host-local", "dataDir": data_dir, "ranges": ranges, "routes": routes}
    })];
    if version == "0.3.1" {
        plugins.push(json!({"type": "portmap", "capabilities": {"portMappings": true}}));
    }
    plugins
        .push(json!({"type": "policy-cni", "socket": socket, "timeoutSeconds": timeout_seconds}));
    json!({"cniVersion": version, "name": "podnet", "plugins": plugins})
}

/// A node namespace, a temp dir (host-local state, the socket) and
/// whatever sandboxes the test makes; everything with the prefix goes on
/// drop, also after a failed assertion.
pub struct Fixture {
    pub prefix: &'static str,
    pub dir: TempDir,
    pub node: SimNode,
}

impl Fixture {
    pub fn new(prefix: &'static str) -> Self {
        cleanup_prefix(prefix);
        let dir = TempDir::new(prefix);
        let node = SimNode::create(prefix, &[]).unwrap();
        Self { prefix, dir, node }
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("cni.sock")
    }

    /// The real agent's manifests directory.
    pub fn manifests(&self) -> PathBuf {
        self.dir.path().join("manifests")
    }

    pub fn ipam_dir(&self) -> PathBuf {
        self.dir.path().join("ipam")
    }

    pub fn runtime(&self, version: &str, timeout_seconds: f64, dual_stack: bool) -> CniRuntime {
        let list = ptp_list(
            version,
            &self.ipam_dir(),
            &self.socket(),
            timeout_seconds,
            dual_stack,
        );
        CniRuntime::new(&self.node.node, list, test_cni_path().unwrap()).unwrap()
    }

    pub fn sandbox(&self, rt: &CniRuntime, name: &str) -> Sandbox {
        rt.sandbox(self.prefix, "default", name, &format!("uid-{name}"))
            .unwrap()
    }

    /// The addresses host-local holds (one file per address).
    pub fn reserved(&self) -> Vec<String> {
        let dir = self.ipam_dir().join("podnet");
        let mut out: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
            .collect();
        out.sort();
        out
    }

    /// `(name, ifindex, kind)` of a link in the node namespace.
    pub fn node_link(&self, name: &str) -> Option<(String, u32, String)> {
        let out = self
            .node
            .node
            .ip(&["-d", "-j", "link", "show", "dev", name])
            .ok()?;
        let v: Value = serde_json::from_str(&out).ok()?;
        let l = &v[0];
        Some((
            l["ifname"].as_str()?.to_owned(),
            u32::try_from(l["ifindex"].as_u64()?).ok()?,
            l["linkinfo"]["info_kind"].as_str().unwrap_or("").to_owned(),
        ))
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        cleanup_prefix(self.prefix);
    }
}
