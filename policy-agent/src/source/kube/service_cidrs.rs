//! The cluster's Service ranges, from its `networking.k8s.io/v1`
//! ServiceCIDR objects (Kubernetes 1.33 and later), as one
//! [`Change::ServiceRanges`] whenever their union changes.
//!
//! The API text: `spec.cidrs` "defines the IP blocks in CIDR notation
//! (e.g. "192.168.0.0/24" or "2001:db8::/64") from which to assign service
//! cluster IPs. Max of two CIDRs is allowed, one of each IP family."
//! `status.conditions` "holds an array of metav1.Condition that describe
//! the state of the ServiceCIDR". A ServiceCIDR whose `Ready` condition is
//! False (being deleted while addresses are still allocated from it)
//! hands out no new ClusterIP; the ones it did are frontends of their own.
//! One without the condition yet is new: covering it early is safe (a
//! flow deferred to a frontend that is none is judged by its address
//! after all).
//!
//! A cluster without the API (older Kubernetes) answers 404: that is
//! normal, said once, and the watch ends (a control plane upgraded later
//! is seen at the agent's next start). A 403 (RBAC without
//! servicecidrs) is reported and retried; neither holds the other kinds
//! back.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::{ResourceExt as _, runtime::watcher::Event};
use tracing::{info, warn};

use crate::cluster::{
    Change, ObjectKind, ObjectRef, Problem, Subject, normalized_ranges, parse_cidr_sloppy,
};

/// One ServiceCIDR, as far as the ranges go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ServiceCidrInfo {
    pub cidrs: Vec<IpNet>,
    /// `Ready` is not False.
    pub ready: bool,
    /// `spec.cidrs` entries that do not read: (field, reason).
    pub unreadable: Vec<(String, String)>,
}

/// A ServiceCIDR's name and what it adds to the ranges.
pub(super) fn service_cidr_info(obj: &ServiceCIDR) -> (String, ServiceCidrInfo) {
    let mut info = ServiceCidrInfo {
        ready: !obj
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "False"),
        ..Default::default()
    };
    let cidrs = obj.spec.as_ref().and_then(|s| s.cidrs.as_ref());
    for (i, text) in cidrs.into_iter().flatten().enumerate() {
        match parse_cidr_sloppy(text) {
            Some(net) => info.cidrs.push(net),
            None => info.unreadable.push((
                format!("spec.cidrs[{i}]"),
                format!("{text:?} is not a CIDR: not a Service range"),
            )),
        }
    }
    (obj.name_any(), info)
}

/// The HTTP status of an API server's answer behind `error`.
pub(super) fn status_code(error: &kube::runtime::watcher::Error) -> Option<u16> {
    use kube::runtime::watcher::Error as E;
    match error {
        E::InitialListFailed(kube::Error::Api(s))
        | E::WatchStartFailed(kube::Error::Api(s))
        | E::WatchFailed(kube::Error::Api(s)) => Some(s.code),
        E::WatchError(s) => Some(s.code),
        _ => None,
    }
}

/// Whether `error` says the cluster does not serve the API (the watch
/// then ends).
pub(super) fn not_served(error: &kube::runtime::watcher::Error) -> bool {
    status_code(error) == Some(404)
}

/// Whether an optional API (ServiceCIDRs, a CRD) can be read here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Availability {
    /// Not heard of yet.
    Unknown,
    Served,
    /// 404: the cluster does not serve it.
    Absent,
    /// 403: not allowed to read it (retried).
    Forbidden,
}

/// What the ServiceCIDR watch knows.
pub(super) struct ServiceCidrs {
    live: BTreeMap<String, ServiceCidrInfo>,
    relist: Option<BTreeMap<String, ServiceCidrInfo>>,
    availability: Availability,
    /// The ranges last published (the compiler starts without any).
    published: Vec<IpNet>,
}

impl Default for ServiceCidrs {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            relist: None,
            availability: Availability::Unknown,
            published: Vec::new(),
        }
    }
}

impl ServiceCidrs {
    /// Not watched (`--service-cidr` gives the ranges): nothing to wait
    /// for, nothing to publish.
    pub fn not_watched(&mut self) {
        self.availability = Availability::Absent;
    }

    /// Whether the other kinds may be published: listed, or known not to
    /// be readable.
    pub fn settled(&self) -> bool {
        self.availability != Availability::Unknown
    }

    /// Applies one watch event; true when a (re-)list completed.
    pub fn apply(&mut self, event: Event<ServiceCIDR>) -> bool {
        match event {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(obj) => {
                if let Some(buf) = self.relist.as_mut() {
                    let (name, info) = service_cidr_info(&obj);
                    buf.insert(name, info);
                }
                false
            }
            Event::InitDone => {
                if let Some(buf) = self.relist.take() {
                    self.live = buf;
                }
                if self.availability == Availability::Forbidden {
                    info!("ServiceCIDRs readable again");
                }
                self.availability = Availability::Served;
                true
            }
            Event::Apply(obj) => {
                let (name, info) = service_cidr_info(&obj);
                self.live.insert(name, info);
                false
            }
            Event::Delete(obj) => {
                self.live.remove(&obj.name_any());
                false
            }
        }
    }

    /// A failed list or watch. A 404 means the cluster has no such API
    /// (true: the watch may end); a 403, that the agent may not read it.
    pub fn failed(&mut self, error: &kube::runtime::watcher::Error) -> bool {
        match status_code(error) {
            Some(404) if self.availability != Availability::Served => {
                info!(
                    "the cluster serves no ServiceCIDR API (Kubernetes before 1.33): Service ranges come from --service-cidr only"
                );
                self.availability = Availability::Absent;
                true
            }
            Some(403) => {
                if self.availability != Availability::Forbidden {
                    warn!(error = %error, "may not list ServiceCIDRs: running without the cluster's Service ranges (grant list and watch on servicecidrs, or pass --service-cidr)");
                }
                self.availability = Availability::Forbidden;
                false
            }
            _ => {
                if self.availability != Availability::Served {
                    warn!(error = %error, "cannot list ServiceCIDRs yet; retrying");
                }
                false
            }
        }
    }

    /// The ranges of every ServiceCIDR whose `Ready` is not False.
    pub fn ranges(&self) -> Vec<IpNet> {
        let nets: BTreeSet<IpNet> = self
            .live
            .values()
            .filter(|i| i.ready)
            .flat_map(|i| i.cidrs.iter().copied())
            .collect();
        normalized_ranges(nets)
    }

    /// Appends the change of the ranges since the last call, if any.
    pub fn changes(&mut self, out: &mut Vec<Change>) {
        let now = self.ranges();
        if now != self.published {
            info!(ranges = ?now, "Service ranges from the cluster's ServiceCIDRs");
            out.push(Change::ServiceRanges(now.clone()));
            self.published = now;
        }
    }

    /// What cannot be read: each unreadable CIDR, and a 403.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out: Vec<Problem> = self
            .live
            .iter()
            .flat_map(|(name, info)| {
                info.unreadable.iter().map(move |(field, reason)| {
                    Problem::new(
                        Subject::Field {
                            kind: ObjectKind::ServiceCidr,
                            name: ObjectRef::new("", name.clone()),
                            field: field.clone(),
                        },
                        reason.clone(),
                    )
                })
            })
            .collect();
        if self.availability == Availability::Forbidden {
            out.push(Problem::node(
                "ServiceCIDRs may not be listed (RBAC): the cluster's Service ranges are not known; a Service not seen yet is judged by its address at the client",
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(name: &str, cidrs: &[&str], ready: Option<&str>) -> ServiceCIDR {
        let mut v = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": name},
            "spec": {"cidrs": cidrs},
        });
        if let Some(status) = ready {
            v["status"] = serde_json::json!({"conditions": [{
                "type": "Ready", "status": status, "reason": "", "message": "",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
            }]});
        }
        serde_json::from_value(v).unwrap()
    }

    fn ranges(c: &ServiceCidrs) -> Vec<String> {
        c.ranges().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn ready_or_new_service_cidrs_are_the_ranges_and_a_change_is_published_once() {
        let mut c = ServiceCidrs::default();
        assert!(!c.settled());
        for e in [
            Event::Init,
            Event::InitApply(cidr(
                "kubernetes",
                &["10.96.0.0/12", "fd00:96::/108"],
                Some("True"),
            )),
            Event::InitApply(cidr("extra", &["10.100.0.0/16"], None)),
            Event::InitApply(cidr("going", &["10.200.0.0/16"], Some("False"))),
        ] {
            c.apply(e);
        }
        assert!(!c.settled(), "not before the list is complete");
        assert!(c.apply(Event::InitDone));
        assert!(c.settled());
        assert_eq!(
            ranges(&c),
            ["10.96.0.0/12", "10.100.0.0/16", "fd00:96::/108"]
        );
        let mut out = Vec::new();
        c.changes(&mut out);
        c.changes(&mut out);
        assert_eq!(out.len(), 1, "{out:?}");
        c.apply(Event::Delete(cidr("extra", &[], None)));
        c.apply(Event::Apply(cidr("bad", &["10.0.0.0/33"], None)));
        c.changes(&mut out);
        assert!(
            matches!(&out[1], Change::ServiceRanges(r) if r.len() == 2),
            "{out:?}"
        );
        let problems: Vec<String> = c.problems().iter().map(ToString::to_string).collect();
        assert_eq!(
            problems,
            ["servicecidr bad: spec.cidrs[0]: \"10.0.0.0/33\" is not a CIDR: not a Service range"]
        );
    }

    #[test]
    fn a_cluster_without_the_api_settles_without_ranges() {
        let mut c = ServiceCidrs::default();
        let not_found = kube::runtime::watcher::Error::InitialListFailed(kube::Error::Api(
            kube::core::Status::failure(
                "the server could not find the requested resource",
                "NotFound",
            )
            .with_code(404)
            .boxed(),
        ));
        assert!(c.failed(&not_found), "the watch may end");
        assert!(c.settled());
        assert!(c.ranges().is_empty() && c.problems().is_empty());
        let forbidden = kube::runtime::watcher::Error::InitialListFailed(kube::Error::Api(
            kube::core::Status::failure("forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        ));
        let mut c = ServiceCidrs::default();
        assert!(!c.failed(&forbidden), "retried");
        assert!(c.settled());
        assert_eq!(c.problems().len(), 1);
    }
}
