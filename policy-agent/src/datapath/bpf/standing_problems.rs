//! The datapath's problems that stand until something fixes them. A full
//! pass looks at every pod and reports all of them; an incremental sync
//! looks only at the pods its writes touch, so what it does not look at
//! again must not read as settled (a pod left without its interface is
//! still not enforced after an unrelated policy change).
use std::collections::{BTreeMap, BTreeSet};

use crate::cluster::{ObjectKind, PodRef, Problem, Subject};

#[derive(Debug, Default)]
pub struct StandingProblems {
    problems: BTreeSet<Problem>,
}

/// The pod a problem is about (None: the node's).
fn pod_of(problem: &Problem) -> Option<&PodRef> {
    match &problem.subject {
        Subject::Object {
            kind: ObjectKind::Pod,
            name,
        }
        | Subject::Field {
            kind: ObjectKind::Pod,
            name,
            ..
        } => Some(name),
        _ => None,
    }
}

impl StandingProblems {
    /// After a full pass: exactly what it found.
    pub fn replace(&mut self, found: &[Problem]) -> Vec<Problem> {
        self.problems = found.iter().cloned().collect();
        self.problems.iter().cloned().collect()
    }

    /// After an incremental sync that looked again at the pods in
    /// `looked_at`: their problems are what it found; the other pods'
    /// problems stand, unless the pod is no longer local (in
    /// `local_pods`); the node's stand until the next full pass.
    pub fn update<V>(
        &mut self,
        found: &[Problem],
        looked_at: &BTreeSet<PodRef>,
        local_pods: &BTreeMap<PodRef, V>,
    ) -> Vec<Problem> {
        self.problems.retain(|p| match pod_of(p) {
            Some(pod) => !looked_at.contains(pod) && local_pods.contains_key(pod),
            None => true,
        });
        self.problems.extend(found.iter().cloned());
        self.problems.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> PodRef {
        PodRef::new("default", name)
    }

    fn about(name: &str, reason: &str) -> Problem {
        Problem::object(ObjectKind::Pod, pod(name), reason)
    }

    #[test]
    fn what_an_incremental_sync_did_not_look_at_stands() {
        let mut s = StandingProblems::default();
        let local: BTreeMap<PodRef, ()> = [pod("a"), pod("b"), pod("c")]
            .into_iter()
            .map(|p| (p, ()))
            .collect();
        let node = Problem::node("uplink classifier not attached to eth0");
        s.replace(&[about("a", "no route"), about("b", "no route"), node.clone()]);
        // A sync that looked at b only (its interface came): a stands,
        // b is settled, the node's problem stands.
        let looked: BTreeSet<PodRef> = [pod("b")].into();
        let now = s.update(&[], &looked, &local);
        assert_eq!(now, vec![about("a", "no route"), node.clone()]);
        // A sync that looked at c and found a new problem.
        let looked: BTreeSet<PodRef> = [pod("c")].into();
        let now = s.update(&[about("c", "attach failed")], &looked, &local);
        let c = about("c", "attach failed");
        assert_eq!(now, vec![about("a", "no route"), c.clone(), node.clone()]);
        // a is no longer local: its problem goes with it.
        let local: BTreeMap<PodRef, ()> = [(pod("c"), ())].into();
        let now = s.update(&[], &BTreeSet::new(), &local);
        assert_eq!(now, vec![c, node]);
        // A full pass says what is true now.
        assert!(s.replace(&[]).is_empty());
    }
}
