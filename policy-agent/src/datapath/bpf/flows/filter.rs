//! Which flows `policy-agent flows` prints.
use super::record::{Flow, Verdict};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowFilter {
    /// "namespace/name": the local pod or the peer pod.
    pub pod: Option<String>,
    /// The local pod's or the peer pod's namespace.
    pub namespace: Option<String>,
    pub verdict: Option<Verdict>,
    /// `[namespace/]name` of a policy the flow's policies (or staged
    /// policies) include.
    pub policy: Option<String>,
    /// Only flows whose verdict the staged policies would change.
    pub staged: bool,
}

fn namespace_of(pod: &str) -> Option<&str> {
    pod.split_once('/').map(|(ns, _)| ns)
}

impl FlowFilter {
    pub fn matches(&self, flow: &Flow) -> bool {
        let pods = || std::iter::once(flow.pod.as_str()).chain(flow.peer_pod());
        if let Some(pod) = &self.pod
            && !pods().any(|p| p == pod)
        {
            return false;
        }
        if let Some(ns) = &self.namespace
            && !pods().any(|p| namespace_of(p) == Some(ns.as_str()))
        {
            return false;
        }
        if self.staged && flow.staged.is_none() {
            return false;
        }
        if self.verdict.is_some_and(|v| v != flow.verdict) {
            return false;
        }
        if let Some(policy) = &self.policy {
            let (ns, name) = match policy.split_once('/') {
                Some((ns, name)) => (Some(ns), name),
                None => (None, policy.as_str()),
            };
            if !flow.names_policy(ns, name) {
                return false;
            }
        }
        true
    }
}
