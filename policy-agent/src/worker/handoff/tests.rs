use std::collections::BTreeMap;

use policy_cni::protocol::{HostInterface, PROTOCOL_VERSION};

use super::*;
use crate::{
    cluster::PodFields,
    datapath::{self, Desired, SyncReport},
    mapstate::MapOp,
};

/// A datapath that enforces what it is told to.
#[derive(Default)]
struct Fake {
    enforced: BTreeMap<PodRef, u32>,
}

impl Datapath for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn sync(
        &mut self,
        _: &Desired<'_>,
        _: &[MapOp<PodRef>],
    ) -> Result<SyncReport, datapath::Error> {
        Ok(SyncReport::default())
    }
    fn forget_cache(&mut self) {}
    fn links_changed(&mut self) {}
    fn enforced(&self, pod: &PodRef) -> Option<u32> {
        self.enforced.get(pod).copied()
    }
}

fn add(name: &str, uid: Option<&str>, ips: &[&str], ifindex: u32) -> Request {
    Request {
        version: PROTOCOL_VERSION,
        container_id: format!("c-{name}"),
        command: Command::Add {
            pod: PodId {
                namespace: "a".into(),
                name: name.into(),
                uid: uid.map(str::to_owned),
            },
            interface: HostInterface {
                name: format!("veth{ifindex}"),
                ifindex,
            },
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        },
    }
}

fn pod(uid: Option<&str>, ips: &[&str]) -> PodInfo {
    PodFields {
        uid: uid.map(str::to_owned),
        ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        ..PodFields::default()
    }
    .into()
}

fn key(name: &str) -> PodRef {
    PodRef::new("a", name)
}

fn handoffs() -> Handoffs {
    Handoffs::new("n1".into(), Duration::from_secs(60))
}

#[test]
fn a_pod_without_addresses_gets_the_sandboxs_and_this_node() {
    let mut h = handoffs();
    let (tx, _rx) = oneshot::channel();
    h.receive(add("p", Some("u1"), &["10.0.0.5"], 7), tx, true);
    let mut changes = vec![Change::UpsertPod(key("p"), pod(Some("u1"), &[]))];
    h.rewrite(&mut changes, |_| None);
    let [Change::UpsertPod(_, info)] = &changes[..] else {
        panic!("{changes:?}")
    };
    assert_eq!(info.ips[..], ["10.0.0.5".parse::<IpAddr>().unwrap()]);
    assert_eq!(info.node_name.as_deref(), Some("n1"));
}

#[test]
fn the_apis_addresses_win_and_a_mismatch_is_reported() {
    let mut h = handoffs();
    let (tx, _rx) = oneshot::channel();
    h.receive(add("p", None, &["10.0.0.5"], 7), tx, true);
    let mut changes = vec![Change::UpsertPod(key("p"), pod(None, &["10.0.0.9"]))];
    h.rewrite(&mut changes, |_| None);
    let [Change::UpsertPod(_, info)] = &changes[..] else {
        panic!("{changes:?}")
    };
    assert_eq!(info.ips[..], ["10.0.0.9".parse::<IpAddr>().unwrap()]);
    assert_eq!(h.problems().count(), 1);
    // They agree later: the problem goes.
    let mut changes = vec![Change::UpsertPod(key("p"), pod(None, &["10.0.0.5"]))];
    h.rewrite(&mut changes, |_| None);
    assert_eq!(h.problems().count(), 0);
}

#[test]
fn another_pod_of_the_same_name_is_not_the_sandboxs() {
    let mut h = handoffs();
    let (tx, _rx) = oneshot::channel();
    h.receive(add("p", Some("new"), &["10.0.0.5"], 7), tx, true);
    let mut changes = vec![Change::UpsertPod(key("p"), pod(Some("old"), &[]))];
    h.rewrite(&mut changes, |_| None);
    let [Change::UpsertPod(_, info)] = &changes[..] else {
        panic!("{changes:?}")
    };
    assert!(
        info.ips.is_empty(),
        "the old pod does not get the new sandbox's address"
    );
}

#[test]
fn a_pod_known_before_the_handoff_is_rederived_and_a_del_reverts_it() {
    let mut h = handoffs();
    let known = pod(Some("u1"), &[]);
    let (tx, _rx) = oneshot::channel();
    h.receive(add("p", Some("u1"), &["10.0.0.5"], 7), tx, true);
    let mut changes = Vec::new();
    h.rewrite(&mut changes, |_| Some(known.clone()));
    assert!(
        matches!(&changes[..], [Change::UpsertPod(_, i)] if i.ips.len() == 1),
        "{changes:?}"
    );
    let (tx, rx) = oneshot::channel();
    let del = Request {
        version: PROTOCOL_VERSION,
        container_id: "c-p".into(),
        command: Command::Del { pod: None },
    };
    h.receive(del, tx, true);
    assert_eq!(rx.blocking_recv().unwrap(), Response::ok());
    let mut changes = Vec::new();
    h.rewrite(&mut changes, |_| panic!("the sources' view is kept"));
    assert!(
        matches!(&changes[..], [Change::UpsertPod(_, i)] if i.ips.is_empty()),
        "back to the sources' view: {changes:?}"
    );
}

#[test]
fn an_unknown_pod_waits_and_the_del_of_an_unknown_sandbox_succeeds() {
    let mut h = handoffs();
    let (tx, _rx) = oneshot::channel();
    h.receive(add("p", None, &["10.0.0.5"], 7), tx, true);
    let mut changes = Vec::new();
    h.rewrite(&mut changes, |_| None);
    assert!(
        changes.is_empty(),
        "nothing to compile before the pod is known"
    );
    let (tx, rx) = oneshot::channel();
    let del = Request {
        version: PROTOCOL_VERSION,
        container_id: "never-added".into(),
        command: Command::Del { pod: None },
    };
    h.receive(del, tx, true);
    assert_eq!(rx.blocking_recv().unwrap(), Response::ok());
}

#[test]
fn add_is_answered_only_once_enforced_on_the_interface_handed_over() {
    let mut h = Handoffs::new("n1".into(), Duration::from_millis(50));
    let (tx, mut rx) = oneshot::channel();
    h.receive(add("p", None, &["10.0.0.5"], 7), tx, true);
    let mut dp = Fake::default();
    h.confirm(Some(&dp));
    assert!(rx.try_recv().is_err(), "not enforced: no answer yet");
    dp.enforced.insert(key("p"), 8);
    h.confirm(Some(&dp));
    assert!(rx.try_recv().is_err(), "enforced elsewhere is not enforced");
    dp.enforced.insert(key("p"), 7);
    h.confirm(Some(&dp));
    assert_eq!(rx.try_recv().unwrap(), Response::ok());
    assert!(h.next_deadline().is_none(), "nothing waits any more");
}

#[test]
fn add_fails_when_the_deadline_passes() {
    let mut h = Handoffs::new("n1".into(), Duration::from_millis(10));
    let (tx, mut rx) = oneshot::channel();
    h.receive(add("p", None, &["10.0.0.5"], 7), tx, true);
    std::thread::sleep(Duration::from_millis(20));
    h.confirm(None);
    let r = rx.try_recv().unwrap();
    assert!(!r.ok && r.code == Some(code::TRY_AGAIN), "{r:?}");
}
