//! A fake Kubernetes API server on loopback HTTP, enough for the agent's
//! watchers: list and watch of pods, namespaces, networkpolicies, services
//! and endpointslices (and get of nodes) with
//! the API server's resourceVersion semantics (a list returns the version
//! a watch resumes from; a watch without a version starts with the current
//! objects as ADDED; `410 Gone` only for versions older than the compacted
//! history, at the start of a watch or in the middle of an open stream;
//! BOOKMARK events only for watches that ask with allowWatchBookmarks),
//! dropped connections, an outage switch, slow responses, and Events.
//! It records what it served (lists, watches, each event) so tests can
//! tell which of them delivered a change.
//! It runs on a thread inside a network namespace (where the agent runs).
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use policy_agent::sim::NetNs;
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::broadcast,
};

#[derive(Default)]
struct Kind {
    objects: BTreeMap<(String, String), Value>,
    /// (resourceVersion, type, object)
    history: Vec<(u64, &'static str, Value)>,
}

#[derive(Default)]
struct State {
    rv: u64,
    kinds: BTreeMap<&'static str, Kind>,
    /// History before this version is gone: a watch from an older version
    /// gets 410 Gone (one from this version on resumes).
    compacted_before: u64,
    /// Every connection is refused while set.
    down: bool,
    /// Bumped to drop every open watch.
    generation: u64,
    /// Bumped to end every open watch with 410 Gone.
    expiry: u64,
    slow: Duration,
    events: Vec<Value>,
    /// Requests served, by path (for assertions).
    requests: Vec<String>,
    /// What was served, in order.
    served: Vec<Served>,
}

/// One thing the server sent, for assertions on how a change arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// A full list of a kind, at a version.
    List {
        kind: &'static str,
        rv: u64,
    },
    /// A watch of a kind started from a version (None: no version given).
    Watch {
        kind: &'static str,
        from: Option<u64>,
    },
    /// A watch refused (at its start) or ended (mid-stream) with 410 Gone.
    Gone {
        kind: &'static str,
        mid_stream: bool,
    },
    /// An event on a watch stream.
    Event {
        kind: &'static str,
        ty: &'static str,
        rv: u64,
    },
    Bookmark {
        kind: &'static str,
        rv: u64,
    },
}

pub struct FakeApi {
    pub port: u16,
    state: Arc<Mutex<State>>,
    notify: broadcast::Sender<()>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

fn kind_of(obj: &Value) -> Option<&'static str> {
    match obj.get("kind")?.as_str()? {
        "Pod" => Some("pods"),
        "Namespace" => Some("namespaces"),
        "NetworkPolicy" => Some("networkpolicies"),
        "Service" => Some("services"),
        "EndpointSlice" => Some("endpointslices"),
        "Node" => Some("nodes"),
        _ => None,
    }
}

fn key_of(obj: &Value) -> (String, String) {
    let meta = &obj["metadata"];
    (
        meta["namespace"].as_str().unwrap_or("").to_owned(),
        meta["name"].as_str().unwrap_or("").to_owned(),
    )
}

fn list_meta(kind: &str) -> (&'static str, &'static str) {
    match kind {
        "pods" => ("v1", "PodList"),
        "namespaces" => ("v1", "NamespaceList"),
        "services" => ("v1", "ServiceList"),
        "endpointslices" => ("discovery.k8s.io/v1", "EndpointSliceList"),
        _ => ("networking.k8s.io/v1", "NetworkPolicyList"),
    }
}

impl FakeApi {
    /// Starts serving `objects` from inside `netns`.
    pub fn start(netns: &NetNs, objects: Vec<Value>) -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let (notify, _) = broadcast::channel(1024);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let this_state = state.clone();
        let this_notify = notify.clone();
        let this_stop = stop.clone();
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        netns
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                    port_tx.send(listener.local_addr().unwrap().port()).unwrap();
                    while !this_stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let accepted =
                            tokio::time::timeout(Duration::from_millis(200), listener.accept())
                                .await;
                        let Ok(Ok((stream, _))) = accepted else {
                            continue;
                        };
                        if this_state.lock().unwrap().down {
                            drop(stream); // outage: connections reset at once
                            continue;
                        }
                        let (st, n, s) =
                            (this_state.clone(), this_notify.clone(), this_stop.clone());
                        tokio::spawn(async move {
                            let _ = serve(stream, st, n, s).await;
                        });
                    }
                });
            })
            .unwrap();
        let port = port_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let api = Self {
            port,
            state,
            notify,
            stop,
        };
        for obj in objects {
            api.apply(obj);
        }
        api
    }

    /// Creates or replaces an object (ADDED or MODIFIED on the watches);
    /// returns its new resourceVersion.
    pub fn apply(&self, mut obj: Value) -> u64 {
        let kind = kind_of(&obj).expect("a Pod, Namespace or NetworkPolicy");
        let mut st = self.state.lock().unwrap();
        st.rv += 1;
        let rv = st.rv;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        if obj["metadata"].get("uid").is_none() {
            obj["metadata"]["uid"] = json!(format!("uid-{rv}"));
        }
        let k = st.kinds.entry(kind).or_default();
        let key = key_of(&obj);
        let ty = if k.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        k.objects.insert(key, obj.clone());
        k.history.push((rv, ty, obj));
        drop(st);
        let _ = self.notify.send(());
        rv
    }

    /// Deletes an object (DELETED on the watches); returns the version.
    pub fn delete(&self, kind: &'static str, namespace: &str, name: &str) -> u64 {
        let mut st = self.state.lock().unwrap();
        st.rv += 1;
        let rv = st.rv;
        let k = st.kinds.entry(kind).or_default();
        if let Some(mut obj) = k.objects.remove(&(namespace.to_owned(), name.to_owned())) {
            obj["metadata"]["resourceVersion"] = json!(rv.to_string());
            k.history.push((rv, "DELETED", obj));
        }
        drop(st);
        let _ = self.notify.send(());
        rv
    }

    /// Outage: drops every open watch and refuses new connections.
    pub fn set_down(&self, down: bool) {
        let mut st = self.state.lock().unwrap();
        st.down = down;
        st.generation += 1;
        drop(st);
        let _ = self.notify.send(());
    }

    /// Forgets the history before the current version: a watch resuming
    /// from an earlier version gets `410 Gone` (and must re-list); the
    /// current version (what a list returns now) stays a valid start.
    pub fn compact(&self) {
        let mut st = self.state.lock().unwrap();
        st.compacted_before = st.rv;
        drop(st);
        let _ = self.notify.send(());
    }

    /// The watch cache lost its window: every open watch ends with a
    /// `410 Gone` ERROR event in its stream, and the history before now
    /// is gone.
    pub fn expire_watches(&self) {
        let mut st = self.state.lock().unwrap();
        st.compacted_before = st.rv;
        st.expiry += 1;
        drop(st);
        let _ = self.notify.send(());
    }

    /// Everything served so far, in order.
    pub fn served(&self) -> Vec<Served> {
        self.state.lock().unwrap().served.clone()
    }

    /// Asserts that the change of `kind` at version `rv` reached the agent
    /// through a watch event, with no list of that kind served since
    /// `since` (an index into [`Self::served`]).
    pub fn assert_watched(&self, since: usize, kind: &str, rv: u64, what: &str) {
        let served = self.served();
        let later = &served[since.min(served.len())..];
        let lists: Vec<&Served> = later
            .iter()
            .filter(|s| matches!(s, Served::List { kind: k, .. } if *k == kind))
            .collect();
        assert!(
            lists.is_empty(),
            "{what}: {kind} were re-listed ({lists:?}) instead of watched; served since: {later:#?}"
        );
        assert!(
            later.iter().any(
                |s| matches!(s, Served::Event { kind: k, rv: r, .. } if *k == kind && *r == rv)
            ),
            "{what}: no watch event of {kind} at version {rv}; served since: {later:#?}"
        );
    }

    pub fn set_slow(&self, delay: Duration) {
        self.state.lock().unwrap().slow = delay;
    }

    pub fn events(&self) -> Vec<Value> {
        self.state.lock().unwrap().events.clone()
    }

    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }

    /// A kubeconfig pointing at this server.
    pub fn kubeconfig(&self, path: &std::path::Path) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"http://127.0.0.1:{}\"}}}}]\nusers: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\ncurrent-context: fake\n",
            self.port
        );
        std::fs::write(path, text).unwrap();
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.set_down(true);
    }
}

fn query(target: &str) -> BTreeMap<String, String> {
    target
        .split_once('?')
        .map(|(_, q)| {
            q.split('&')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

async fn respond(stream: &mut TcpStream, status: &str, body: &Value) -> std::io::Result<()> {
    let text = body.to_string();
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        text.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(text.as_bytes()).await?;
    stream.shutdown().await
}

async fn serve(
    mut stream: TcpStream,
    state: Arc<Mutex<State>>,
    notify: broadcast::Sender<()>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let content_length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap_or(0))
        })
        .unwrap_or(0);
    while buf.len() < head_end + content_length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body: Value = serde_json::from_slice(&buf[head_end..]).unwrap_or(Value::Null);
    let mut first = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let q = query(target);
    let (slow, generation) = {
        let mut st = state.lock().unwrap();
        st.requests.push(format!("{method} {target}"));
        (st.slow, st.generation)
    };
    if !slow.is_zero() {
        tokio::time::sleep(slow).await;
    }
    let kind = match path {
        "/api/v1/pods" => Some("pods"),
        "/api/v1/namespaces" => Some("namespaces"),
        "/apis/networking.k8s.io/v1/networkpolicies" => Some("networkpolicies"),
        "/api/v1/services" => Some("services"),
        "/apis/discovery.k8s.io/v1/endpointslices" => Some("endpointslices"),
        _ => None,
    };
    if method == "POST" && path.starts_with("/apis/events.k8s.io/v1/namespaces/") {
        state.lock().unwrap().events.push(body.clone());
        return respond(&mut stream, "201 Created", &body).await;
    }
    if method == "PATCH" && path.starts_with("/apis/events.k8s.io/v1/namespaces/") {
        return respond(&mut stream, "200 OK", &body).await;
    }
    // Nodes: get by name only (the agent reads its own, once).
    if let Some(name) = path.strip_prefix("/api/v1/nodes/")
        && method == "GET"
    {
        let node = state
            .lock()
            .unwrap()
            .kinds
            .get("nodes")
            .and_then(|k| k.objects.get(&(String::new(), name.to_owned())).cloned());
        if let Some(node) = node {
            return respond(&mut stream, "200 OK", &node).await;
        }
    }
    let Some(kind) = kind.filter(|_| method == "GET") else {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404});
        return respond(&mut stream, "404 Not Found", &status).await;
    };
    let (api_version, list_kind) = list_meta(kind);
    if q.get("watch").is_none_or(|w| w != "true" && w != "1") {
        let list = {
            let mut st = state.lock().unwrap();
            let items: Vec<Value> = st
                .kinds
                .get(kind)
                .map(|k| k.objects.values().cloned().collect())
                .unwrap_or_default();
            let rv = st.rv;
            st.served.push(Served::List { kind, rv });
            json!({"apiVersion": api_version, "kind": list_kind, "metadata": {"resourceVersion": rv.to_string()}, "items": items})
        };
        return respond(&mut stream, "200 OK", &list).await;
    }

    // A watch: close-delimited stream of JSON events. No version (or "0"):
    // the current objects as ADDED, then changes from now.
    let from: Option<u64> = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .filter(|v| *v != 0);
    let bookmarks = q
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true" || v == "1");
    let timeout = Duration::from_secs(
        q.get("timeoutSeconds")
            .and_then(|v| v.parse().ok())
            .unwrap_or(290),
    );
    stream
        .write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n",
        )
        .await?;
    let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410}});
    let start = {
        let mut st = state.lock().unwrap();
        st.served.push(Served::Watch { kind, from });
        if from.is_some_and(|f| f < st.compacted_before) {
            st.served.push(Served::Gone {
                kind,
                mid_stream: false,
            });
            None
        } else {
            let initial: Vec<(u64, String)> = if from.is_some() {
                Vec::new()
            } else {
                st.kinds
                    .get(kind)
                    .map(|k| {
                        k.objects
                            .values()
                            .map(|o| {
                                let rv = o["metadata"]["resourceVersion"]
                                    .as_str()
                                    .and_then(|v| v.parse().ok())
                                    .unwrap_or(0);
                                (rv, json!({"type": "ADDED", "object": o}).to_string())
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            };
            for (rv, _) in &initial {
                st.served.push(Served::Event {
                    kind,
                    ty: "ADDED",
                    rv: *rv,
                });
            }
            Some((from.unwrap_or(st.rv), st.expiry, initial))
        }
    };
    let Some((mut sent, expiry, initial)) = start else {
        stream.write_all(format!("{gone}\n").as_bytes()).await?;
        return stream.shutdown().await;
    };
    for (_, line) in initial {
        stream.write_all(format!("{line}\n").as_bytes()).await?;
    }
    let mut rx = notify.subscribe();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let (lines, now_rv, dropped, expired) = {
            let mut st = state.lock().unwrap();
            let lines: Vec<(u64, &'static str, String)> = st
                .kinds
                .get(kind)
                .map(|k| {
                    k.history
                        .iter()
                        .filter(|(rv, _, _)| *rv > sent)
                        .map(|(rv, ty, obj)| {
                            (*rv, *ty, json!({"type": ty, "object": obj}).to_string())
                        })
                        .collect()
                })
                .unwrap_or_default();
            let dropped = st.generation != generation || st.down;
            let expired = st.expiry != expiry;
            if !dropped {
                if expired {
                    st.served.push(Served::Gone {
                        kind,
                        mid_stream: true,
                    });
                } else {
                    for (rv, ty, _) in &lines {
                        st.served.push(Served::Event { kind, ty, rv: *rv });
                    }
                }
            }
            (lines, st.rv, dropped, expired)
        };
        if dropped || stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(()); // dropped connection, without a goodbye
        }
        if expired {
            stream.write_all(format!("{gone}\n").as_bytes()).await?;
            return stream.shutdown().await;
        }
        for (rv, _, line) in lines {
            stream.write_all(format!("{line}\n").as_bytes()).await?;
            sent = rv;
        }
        let bookmark = json!({"type": "BOOKMARK", "object": {"apiVersion": api_version, "kind": list_kind.trim_end_matches("List"), "metadata": {"resourceVersion": now_rv.to_string()}}});
        tokio::select! {
            _ = rx.recv() => {}
            _ = tokio::time::sleep(Duration::from_millis(700)), if bookmarks => {
                state.lock().unwrap().served.push(Served::Bookmark { kind, rv: now_rv });
                stream.write_all(format!("{bookmark}\n").as_bytes()).await?;
                sent = sent.max(now_rv);
            }
            _ = tokio::time::sleep_until(deadline) => return stream.shutdown().await,
        }
    }
}
