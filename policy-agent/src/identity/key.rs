//! What a label identity stands for, and its canonical name.
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    sync::{Arc, LazyLock},
};

use policy_common::proto;

use crate::cluster::{Interner, Labels, PodInfo, PodLabels, label_set, namespace_name};

/// The named-port sets handed out (the pods of one workload have one).
static NAMED_PORTS: LazyLock<Interner<BTreeSet<NamedPort>>> = LazyLock::new(Interner::default);

/// The shared set equal to `ports`.
fn named_ports_shared(ports: BTreeSet<NamedPort>) -> Arc<BTreeSet<NamedPort>> {
    NAMED_PORTS.share(&ports, || Arc::new(ports.clone()))
}

/// A named container port: the part of a pod a named policy port resolves on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamedPort {
    pub name: String,
    /// IP protocol number (TCP, UDP or SCTP).
    pub protocol: u8,
    pub port: u16,
}

/// Everything policy can observe about a pod, so that pods with equal keys
/// are indistinguishable to every selector and every named port.
///
/// - the namespace name: a peer with only `podSelector` means "in the
///   policy's own namespace", so two namespaces with equal labels differ;
/// - the namespace labels (`namespaceSelector`);
/// - the pod labels (`podSelector`);
/// - the named container ports: the policy map is keyed by identity and
///   "the same name may mean different numbers on different pods", so pods
///   whose names resolve differently must not share an identity.
///
/// Its parts are shared (the namespace's name and labels, the label set,
/// the named ports of a workload's pods): a key is made for every pod a
/// change touches (every pod at a start), and those of one workload are
/// the same values.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelKey {
    pub namespace: Arc<str>,
    pub namespace_labels: Arc<Labels>,
    /// Shared with the pods that carry them.
    pub labels: PodLabels,
    pub named_ports: Arc<BTreeSet<NamedPort>>,
}

/// The label the API server puts on every namespace (1.21+).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Labels of a namespace the state does not know: only the name label,
/// which the API server would have set.
pub fn default_namespace_labels(namespace: &str) -> Labels {
    Labels::from([(NAMESPACE_NAME_LABEL.to_owned(), namespace.to_owned())])
}

impl LabelKey {
    /// The key of `pod` in `namespace` whose labels are `namespace_labels`.
    pub fn of_pod(namespace: &str, namespace_labels: &Labels, pod: &PodInfo) -> Self {
        let named_ports: BTreeSet<NamedPort> = pod
            .ports
            .iter()
            .filter_map(|p| {
                p.name
                    .as_ref()
                    .filter(|n| !n.is_empty())
                    .map(|name| NamedPort {
                        name: name.to_string(),
                        protocol: p.protocol,
                        port: p.port,
                    })
            })
            .collect();
        Self {
            namespace: namespace_name(namespace),
            namespace_labels: label_set(namespace_labels),
            labels: pod.labels.clone(),
            named_ports: named_ports_shared(named_ports),
        }
    }

    /// The port numbers `name` resolves to for `protocol` on pods with this
    /// key (none when no container port has that name and protocol).
    pub fn resolve<'a>(&'a self, name: &'a str, protocol: u8) -> impl Iterator<Item = u16> + 'a {
        self.named_ports
            .iter()
            .filter(move |p| p.name == name && p.protocol == protocol)
            .map(|p| p.port)
    }

    /// Deterministic, human-readable and injective name, e.g.
    /// `ns=default;nsl:kubernetes.io/metadata.name=default;app=web;port:http=TCP/80`.
    ///
    /// `\`, `;`, `=` and `:` inside names and values are escaped with `\`,
    /// so no two keys share a name (valid Kubernetes labels never contain
    /// them, garbage input might).
    pub fn canonical(&self) -> String {
        let mut out = String::with_capacity(64);
        out.push_str("ns=");
        escape_into(&mut out, &self.namespace);
        for (k, v) in self.namespace_labels.iter() {
            out.push_str(";nsl:");
            escape_into(&mut out, k);
            out.push('=');
            escape_into(&mut out, v);
        }
        for (k, v) in self.labels.iter() {
            out.push(';');
            escape_into(&mut out, k);
            out.push('=');
            escape_into(&mut out, v);
        }
        for p in self.named_ports.iter() {
            out.push_str(";port:");
            escape_into(&mut out, &p.name);
            out.push('=');
            out.push_str(protocol_name(p.protocol));
            // Writing to a String cannot fail.
            let _ = write!(out, "/{}", p.port);
        }
        out
    }
}

fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        if matches!(c, '\\' | ';' | '=' | ':') {
            out.push('\\');
        }
        out.push(c);
    }
}

/// The Kubernetes name of an IP protocol number.
pub fn protocol_name(p: u8) -> &'static str {
    match p {
        proto::TCP => "TCP",
        proto::UDP => "UDP",
        proto::SCTP => "SCTP",
        proto::ICMP => "ICMP",
        proto::ICMPV6 => "ICMPv6",
        proto::ANY => "ANY",
        _ => "OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ContainerPort, PodFields};

    fn pod(labels: &[(&str, &str)], ports: &[(&str, u8, u16)]) -> PodInfo {
        PodFields {
            labels: std::sync::Arc::new(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ports: ports
                .iter()
                .map(|(n, p, port)| ContainerPort {
                    name: Some((*n).into()),
                    protocol: *p,
                    port: *port,
                })
                .collect(),
            ..Default::default()
        }
        .into()
    }

    #[test]
    fn canonical_name_is_readable_and_sorted() {
        let key = LabelKey::of_pod(
            "default",
            &default_namespace_labels("default"),
            &pod(
                &[("tier", "x"), ("app", "web")],
                &[("http", proto::TCP, 80)],
            ),
        );
        assert_eq!(
            key.canonical(),
            "ns=default;nsl:kubernetes.io/metadata.name=default;app=web;tier=x;port:http=TCP/80"
        );
    }

    #[test]
    fn separators_inside_values_cannot_forge_another_key() {
        let ns = default_namespace_labels("a");
        let forged = LabelKey::of_pod("a", &ns, &pod(&[("x", "1;y=2")], &[]));
        let honest = LabelKey::of_pod("a", &ns, &pod(&[("x", "1"), ("y", "2")], &[]));
        assert_ne!(forged.canonical(), honest.canonical());
        let colon = LabelKey::of_pod("a", &Labels::new(), &pod(&[("nsl:k", "v")], &[]));
        let nsl = LabelKey::of_pod(
            "a",
            &Labels::from([("k".into(), "v".into())]),
            &pod(&[], &[]),
        );
        assert_ne!(colon.canonical(), nsl.canonical());
    }

    #[test]
    fn named_ports_resolve_by_name_and_protocol() {
        let key = LabelKey::of_pod(
            "a",
            &Labels::new(),
            &pod(
                &[],
                &[
                    ("dns", proto::UDP, 53),
                    ("dns", proto::TCP, 5353),
                    ("web", proto::TCP, 80),
                ],
            ),
        );
        assert_eq!(key.resolve("dns", proto::UDP).collect::<Vec<_>>(), vec![53]);
        assert_eq!(
            key.resolve("dns", proto::TCP).collect::<Vec<_>>(),
            vec![5353]
        );
        assert_eq!(key.resolve("web", proto::SCTP).count(), 0);
    }
}
