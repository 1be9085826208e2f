//! Pods handed over by the chained CNI plugin (`policy-cni`): their
//! addresses are known here before the API server publishes them, and
//! the plugin's ADD waits until the pod is enforced.
//!
//! The hand-off is an overlay on what the sources say about a pod: a pod
//! the sources know without addresses gets the sandbox's (and this node as
//! its node); once the sources give addresses they win, and a mismatch is
//! reported. A hand-off for a pod the sources do not know yet waits for
//! it (the pod object exists before its sandbox; the watch may lag).
mod server;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use policy_cni::protocol::{Command, PodId, Request, Response, code};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

pub use self::server::{bind, serve};
use crate::{
    cluster::{Change, ObjectKind, PodInfo, PodRef, Problem},
    datapath::Datapath,
};

/// What a sandbox told about its pod.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Handoff {
    container_id: String,
    uid: Option<String>,
    ips: Vec<IpAddr>,
    ifindex: u32,
    interface: String,
}

/// A request answered once the datapath shows the pod enforced.
struct Waiting {
    pod: PodRef,
    ifindex: u32,
    add: bool,
    reply: oneshot::Sender<Response>,
    deadline: Instant,
}

/// The hand-offs the worker holds.
pub struct Handoffs {
    node: String,
    max_wait: Duration,
    overlay: BTreeMap<PodRef, Handoff>,
    waiting: Vec<Waiting>,
    /// Pods whose compiled view must be re-derived (hand-off came or went).
    refresh: BTreeSet<PodRef>,
    /// The sources' last word on each pod with a hand-off: what the
    /// compiler gets back when the hand-off goes.
    source_view: BTreeMap<PodRef, PodInfo>,
    /// Addresses the plugin and the sources disagree on.
    mismatches: BTreeMap<PodRef, Problem>,
}

fn pod_ref(id: &PodId) -> PodRef {
    PodRef::new(id.namespace.clone(), id.name.clone())
}

impl Handoffs {
    pub fn new(node: String, max_wait: Duration) -> Self {
        Self {
            node,
            max_wait,
            overlay: BTreeMap::new(),
            waiting: Vec::new(),
            refresh: BTreeSet::new(),
            source_view: BTreeMap::new(),
            mismatches: BTreeMap::new(),
        }
    }

    /// Takes one request. `ready`: the first sync has run (a STATUS
    /// question).
    pub fn receive(&mut self, req: Request, reply: oneshot::Sender<Response>, ready: bool) {
        let now = Instant::now();
        match req.command {
            Command::Add {
                pod,
                interface,
                ips,
            } => {
                let key = pod_ref(&pod);
                info!(pod = %key, interface = %interface.name, ?ips, container = %req.container_id, "CNI ADD");
                self.overlay.insert(
                    key.clone(),
                    Handoff {
                        container_id: req.container_id,
                        uid: pod.uid,
                        ips,
                        ifindex: interface.ifindex,
                        interface: interface.name,
                    },
                );
                self.refresh.insert(key.clone());
                self.waiting.push(Waiting {
                    pod: key,
                    ifindex: interface.ifindex,
                    add: true,
                    reply,
                    deadline: now + self.max_wait,
                });
            }
            Command::Check { pod, interface } => self.waiting.push(Waiting {
                pod: pod_ref(&pod),
                ifindex: interface.ifindex,
                add: false,
                reply,
                deadline: now,
            }),
            Command::Del { pod } => {
                // By container first: a DEL may come without the pod, and
                // a newer sandbox of the same pod must keep its hand-off.
                let key = self
                    .overlay
                    .iter()
                    .find(|(_, h)| h.container_id == req.container_id)
                    .map(|(k, _)| k.clone());
                if let Some(key) = key {
                    info!(pod = %key, container = %req.container_id, "CNI DEL");
                    self.overlay.remove(&key);
                    self.mismatches.remove(&key);
                    self.refresh.insert(key);
                } else {
                    debug!(container = %req.container_id, pod = ?pod, "CNI DEL of a sandbox not handed over");
                }
                let _ = reply.send(Response::ok());
            }
            Command::Status => {
                let _ = reply.send(if ready {
                    Response::ok()
                } else {
                    Response::error(code::TRY_AGAIN, "the agent has not synced yet")
                });
            }
        }
    }

    /// The sources' view of `pod` with its hand-off laid over it.
    fn overlay_on(&mut self, pod: &PodRef, mut info: PodInfo) -> PodInfo {
        let Some(h) = self.overlay.get(pod) else {
            self.mismatches.remove(pod);
            return info;
        };
        if let (Some(a), Some(b)) = (&h.uid, &info.uid)
            && a != b
        {
            // Another pod of that name (an older one): not the sandbox's.
            return info;
        }
        if info.node_name.is_none() {
            info.node_name = Some(crate::cluster::interned::short_name(&self.node));
        }
        if info.ips.is_empty() {
            info.ips = h.ips.clone().into();
            self.mismatches.remove(pod);
        } else {
            let (mut api, mut cni) = (info.ips.to_vec(), h.ips.clone());
            api.sort();
            cni.sort();
            if api != cni {
                warn!(pod = %pod, ?api, ?cni, "the API and the CNI plugin disagree on the pod's addresses; the API's are enforced");
                self.mismatches.insert(
                    pod.clone(),
                    Problem::object(
                        ObjectKind::Pod,
                        pod.clone(),
                        format!(
                            "the CNI plugin handed over addresses {cni:?} on {} but the API says {api:?}; the API's are enforced",
                            h.interface
                        ),
                    ),
                );
            } else {
                self.mismatches.remove(pod);
            }
        }
        info
    }

    /// Lays the hand-offs over the sources' changes, and re-derives the
    /// pods whose hand-off came or went (from `current`, the compiler's
    /// view, when the sources said nothing new).
    pub fn rewrite(
        &mut self,
        changes: &mut Vec<Change>,
        current: impl Fn(&PodRef) -> Option<PodInfo>,
    ) {
        let mut touched = BTreeSet::new();
        for change in changes.iter_mut() {
            match change {
                Change::UpsertPod(pod, info) => {
                    touched.insert(pod.clone());
                    if self.overlay.contains_key(pod) {
                        self.source_view.insert(pod.clone(), info.clone());
                    } else {
                        self.source_view.remove(pod);
                    }
                    *info = self.overlay_on(pod, info.clone());
                }
                Change::DeletePod(pod) => {
                    touched.insert(pod.clone());
                    self.source_view.remove(pod);
                    self.mismatches.remove(pod);
                }
                _ => {}
            }
        }
        for pod in std::mem::take(&mut self.refresh) {
            if touched.contains(&pod) {
                continue;
            }
            let base = match self.source_view.get(&pod) {
                Some(info) => Some(info.clone()),
                // The compiler's view is the sources' (no hand-off was laid
                // over it yet).
                None => current(&pod),
            };
            let Some(base) = base else {
                continue; // Not known yet: the ADD waits for the pod.
            };
            if self.overlay.contains_key(&pod) {
                self.source_view.insert(pod.clone(), base.clone());
            } else {
                self.source_view.remove(&pod);
            }
            let info = self.overlay_on(&pod, base);
            changes.push(Change::UpsertPod(pod, info));
        }
    }

    /// Answers the requests the datapath now settles: enforced on the
    /// interface handed over → ok; past the deadline → an error (the
    /// kubelet retries the sandbox: never a pod started unenforced).
    pub fn confirm(&mut self, datapath: Option<&dyn Datapath>) {
        let now = Instant::now();
        let waiting = std::mem::take(&mut self.waiting);
        for w in waiting {
            if w.reply.is_closed() {
                debug!(pod = %w.pod, "the CNI plugin gave up waiting");
                continue;
            }
            let enforced = datapath.and_then(|d| d.enforced(&w.pod));
            if enforced == Some(w.ifindex) {
                let _ = w.reply.send(Response::ok());
                continue;
            }
            if now < w.deadline {
                self.waiting.push(w);
                continue;
            }
            let why = match enforced {
                Some(other) => format!(
                    "pod {} is enforced on ifindex {other}, not on the interface handed over (ifindex {})",
                    w.pod, w.ifindex
                ),
                None if w.add => format!(
                    "pod {} is not enforced yet (unknown to the agent, not on this node, or its interface not attached)",
                    w.pod
                ),
                None => format!("pod {} is not enforced", w.pod),
            };
            if w.add {
                warn!(pod = %w.pod, "{why}");
            }
            let code = if w.add {
                code::TRY_AGAIN
            } else {
                code::NOT_ENFORCED
            };
            let _ = w.reply.send(Response::error(code, why));
        }
    }

    /// When the earliest waiting request runs out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.iter().map(|w| w.deadline).min()
    }

    /// The hand-off problems (address mismatches).
    pub fn problems(&self) -> impl Iterator<Item = &Problem> {
        self.mismatches.values()
    }
}

#[cfg(test)]
mod tests;
