//! Reading a directory of YAML manifests (v1 Namespace, v1 Pod,
//! networking.k8s.io/v1 NetworkPolicy, v1 Service, discovery.k8s.io/v1
//! EndpointSlice; `List` objects too) into a
//! [`ClusterState`]. Every problem names the file, the document and the
//! object; everything readable is still returned.
//!
//! A NetworkPolicy document that names itself but does not decode is not
//! a deletion: it becomes a fail-closed stand-in (every pod of its
//! namespace isolated in the directions the raw document declares, nothing
//! allowed), so the pods it was written for never lose isolation because
//! of a typo. The watcher (`directory.rs`) prefers the last good version of
//! the object when it has one.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, Pod, Service},
        discovery::v1::EndpointSlice,
        networking::v1::{NetworkPolicy, NetworkPolicySpec},
    },
    apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta},
};
use serde::Deserialize;
use serde_yaml::Value;

use crate::cluster::{
    ClusterNetworkPolicy, ClusterState, NamespaceInfo, ObjectRef, Problem, Subject, cluster_policy,
    endpoint_slice_info, namespace_info, node_info, pod_info, service_info,
};

/// Where an object came from: file and 1-based document number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub file: PathBuf,
    pub document: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (document {})", self.file.display(), self.document)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: not valid YAML: {detail}")]
    Yaml { origin: Origin, detail: String },
    #[error("{origin}: not a Kubernetes object (no apiVersion and kind)")]
    NotAnObject { origin: Origin },
    #[error(
        "{origin}: unsupported object kind {kind:?} (apiVersion {api_version:?}); expected v1 Namespace, Pod, Node or Service, networking.k8s.io/v1 NetworkPolicy, discovery.k8s.io/v1 EndpointSlice or policy.networking.k8s.io/v1alpha2 ClusterNetworkPolicy"
    )]
    UnknownKind {
        origin: Origin,
        api_version: String,
        kind: String,
    },
    #[error("{origin}: {kind} {name}: {detail}; {fallback}")]
    Invalid {
        origin: Origin,
        kind: &'static str,
        name: String,
        /// The object the document names, when that much can be read
        /// (cluster-scoped: empty namespace).
        key: Option<ObjectRef>,
        detail: String,
        fallback: Fallback,
    },
    #[error(
        "{origin}: {kind} {name} is defined again (first in {first}); the first definition is used"
    )]
    Duplicate {
        origin: Origin,
        kind: &'static str,
        name: String,
        first: Origin,
    },
}

/// What is enforced in place of an object whose document does not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Nothing: the object is left out (no previous version, and not a
    /// NetworkPolicy).
    LeftOut,
    /// A NetworkPolicy seen for the first time: every pod of its namespace
    /// is isolated in these directions and nothing is allowed.
    FailClosed {
        namespace: String,
        policy_types: Vec<String>,
    },
    /// The last version that decoded stays enforced (the watcher).
    LastGood,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LeftOut => f.write_str("left out"),
            Self::FailClosed {
                namespace,
                policy_types,
            } => write!(
                f,
                "until it is fixed every pod of namespace {namespace} is isolated for {} and it allows nothing",
                policy_types.join(" and ")
            ),
            Self::LastGood => f.write_str("its last version that decoded stays enforced"),
        }
    }
}

impl ManifestError {
    /// Whether the file was not understood to its end: read failures,
    /// YAML syntax errors (later documents are lost), documents that are
    /// no object at all (a cut file can leave a bare scalar) and documents
    /// of a supported kind that do not decode. Until such a file reads
    /// cleanly, the watcher deletes nothing it held (a deletion in the same
    /// edit lands once the file is fixed). Objects of other kinds
    /// (a Deployment next to the policies) are someone else's: reported,
    /// and not in the way of deletions.
    pub fn unsettles_file(&self) -> bool {
        matches!(
            self,
            Self::Read { .. } | Self::Yaml { .. } | Self::NotAnObject { .. } | Self::Invalid { .. }
        )
    }

    /// Where the problem is: the file, and the document when known.
    fn origin(&self) -> (PathBuf, Option<usize>) {
        match self {
            Self::Read { path, .. } => (path.clone(), None),
            Self::Yaml { origin, .. }
            | Self::NotAnObject { origin }
            | Self::UnknownKind { origin, .. }
            | Self::Invalid { origin, .. }
            | Self::Duplicate { origin, .. } => (origin.file.clone(), Some(origin.document)),
        }
    }

    /// The same, as a problem report on the file (and document).
    pub fn problem(&self) -> Problem {
        let (file, document) = self.origin();
        let reason = match self {
            Self::Read { source, .. } => format!("cannot read: {source}"),
            Self::Yaml { detail, .. } => format!("not valid YAML: {detail}"),
            Self::NotAnObject { .. } => "not a Kubernetes object (no apiVersion and kind)".into(),
            Self::UnknownKind {
                api_version, kind, ..
            } => format!(
                "unsupported object kind {kind:?} (apiVersion {api_version:?}); expected v1 Namespace, Pod, Node or Service, networking.k8s.io/v1 NetworkPolicy, discovery.k8s.io/v1 EndpointSlice or policy.networking.k8s.io/v1alpha2 ClusterNetworkPolicy"
            ),
            Self::Invalid {
                kind,
                name,
                detail,
                fallback,
                ..
            } => format!("{kind} {name}: {detail}; {fallback}"),
            Self::Duplicate {
                kind, name, first, ..
            } => format!(
                "{kind} {name} is defined again (first in {first}); the first definition is used"
            ),
        };
        Problem::new(Subject::Document { file, document }, reason)
    }
}

/// What a directory held.
#[derive(Debug, Default)]
pub struct LoadedManifests {
    pub namespaces: Vec<(Origin, Namespace)>,
    pub pods: Vec<(Origin, Pod)>,
    pub policies: Vec<(Origin, NetworkPolicy)>,
    pub cluster_policies: Vec<(Origin, ClusterNetworkPolicy)>,
    pub nodes: Vec<(Origin, Node)>,
    pub services: Vec<(Origin, Service)>,
    pub slices: Vec<(Origin, EndpointSlice)>,
    /// Fail-closed stand-ins for NetworkPolicy documents that name
    /// themselves but do not decode (see [`stand_in`]).
    pub stand_ins: Vec<(Origin, NetworkPolicy)>,
    /// The policies of the last [`Self::cluster_state`] that are stand-ins.
    pub standing_in: BTreeSet<ObjectRef>,
    pub errors: Vec<ManifestError>,
}

/// Reads every `*.yaml` / `*.yml` in `dir` (sorted, not recursive).
pub fn load_dir(dir: &Path) -> LoadedManifests {
    let mut out = LoadedManifests::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(source) => {
            out.errors.push(ManifestError::Read {
                path: dir.to_path_buf(),
                source,
            });
            return out;
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && is_manifest(p))
        .collect();
    files.sort();
    for file in files {
        load_file(&file, &mut out);
    }
    out
}

/// Whether a directory entry is read as manifests (by its extension).
pub fn is_manifest(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    )
}

/// Reads and parses one file (a read failure is recorded like a parse error).
pub fn load_file(file: &Path, out: &mut LoadedManifests) {
    match std::fs::read_to_string(file) {
        Ok(text) => load_text(file, &text, out),
        Err(source) => out.errors.push(ManifestError::Read {
            path: file.to_path_buf(),
            source,
        }),
    }
}

/// Parses one file's text (multi-document YAML).
pub fn load_text(file: &Path, text: &str, out: &mut LoadedManifests) {
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let origin = Origin {
            file: file.to_path_buf(),
            document: i + 1,
        };
        match Value::deserialize(doc) {
            Ok(Value::Null) => {}
            Ok(value) => add_object(origin, value, out),
            Err(e) => {
                out.errors.push(ManifestError::Yaml {
                    origin,
                    detail: e.to_string(),
                });
                // The YAML stream cannot be resumed after a syntax error.
                break;
            }
        }
    }
}

fn text_field(value: &Value, key: &str) -> String {
    value
        .get(key)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned()
}

fn object_name(value: &Value) -> String {
    let meta = value.get("metadata");
    let name = meta
        .and_then(|m| m.get("name"))
        .and_then(|v| v.as_str())
        .unwrap_or("<unnamed>");
    match meta
        .and_then(|m| m.get("namespace"))
        .and_then(|v| v.as_str())
    {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

/// The object a raw document names, if its metadata can be read:
/// namespaced objects default to namespace `default`, cluster-scoped ones
/// have none.
fn object_key(value: &Value, namespaced: bool) -> Option<ObjectRef> {
    let meta = value.get("metadata")?;
    let name = meta.get("name")?.as_str()?;
    if !namespaced {
        return Some(ObjectRef::new("", name));
    }
    let namespace = match meta.get("namespace") {
        None | Some(Value::Null) => "default",
        Some(ns) => ns.as_str()?,
    };
    Some(ObjectRef::new(namespace, name))
}

/// The directions a raw NetworkPolicy document declares, read as the API
/// defaults them (`policyTypes` absent or empty: Ingress, and Egress when
/// `egress` is a non-empty list). Whatever cannot be read counts as both.
fn declared_policy_types(value: &Value) -> Vec<String> {
    let both = || vec!["Ingress".to_owned(), "Egress".to_owned()];
    let spec = match value.get("spec") {
        None | Some(Value::Null) => return vec!["Ingress".to_owned()],
        Some(spec @ Value::Mapping(_)) => spec,
        Some(_) => return both(),
    };
    match spec.get("policyTypes") {
        Some(Value::Sequence(types)) if !types.is_empty() => {
            let read: Option<Vec<String>> = types
                .iter()
                .map(|t| {
                    t.as_str()
                        .filter(|t| matches!(*t, "Ingress" | "Egress"))
                        .map(str::to_owned)
                })
                .collect();
            read.unwrap_or_else(both)
        }
        None | Some(Value::Null) | Some(Value::Sequence(_)) => {
            let egress = match spec.get("egress") {
                None | Some(Value::Null) => false,
                Some(Value::Sequence(rules)) => !rules.is_empty(),
                Some(_) => true,
            };
            if egress {
                both()
            } else {
                vec!["Ingress".to_owned()]
            }
        }
        Some(_) => both(),
    }
}

/// The fail-closed stand-in for a NetworkPolicy document that does not
/// decode: `podSelector: {}` (every pod it could select, and more), the
/// `policyTypes` the raw document declares, no rules. The compiler reads
/// that as "isolate, allow nothing"; no sentinel is needed.
pub fn stand_in(key: &ObjectRef, value: &Value) -> NetworkPolicy {
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(key.name.to_string()),
            namespace: Some(key.namespace.to_string()),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector::default()),
            policy_types: Some(declared_policy_types(value)),
            ..Default::default()
        }),
    }
}

fn add_object(origin: Origin, value: Value, out: &mut LoadedManifests) {
    let api_version = text_field(&value, "apiVersion");
    let kind = text_field(&value, "kind");
    if api_version.is_empty() || kind.is_empty() {
        out.errors.push(ManifestError::NotAnObject { origin });
        return;
    }
    let name = object_name(&value);
    macro_rules! parse {
        ($ty:ty, $label:literal, $list:ident, $namespaced:literal) => {
            match <$ty>::deserialize(&value) {
                Ok(obj) => out.$list.push((origin, obj)),
                Err(e) => out.errors.push(ManifestError::Invalid {
                    origin,
                    kind: $label,
                    name,
                    key: object_key(&value, $namespaced),
                    detail: e.to_string(),
                    fallback: Fallback::LeftOut,
                }),
            }
        };
    }
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Namespace") => parse!(Namespace, "Namespace", namespaces, false),
        ("v1", "Pod") => parse!(Pod, "Pod", pods, true),
        ("v1", "Node") => parse!(Node, "Node", nodes, false),
        ("v1", "Service") => parse!(Service, "Service", services, true),
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            parse!(EndpointSlice, "EndpointSlice", slices, true)
        }
        // A ClusterNetworkPolicy that does not decode has no fail-closed
        // stand-in (its subject and rules are unknown): a new one is left
        // out and reported, an edited one keeps its last version (the
        // watcher).
        (cluster_policy::API_VERSION, cluster_policy::KIND) => parse!(
            ClusterNetworkPolicy,
            "ClusterNetworkPolicy",
            cluster_policies,
            false
        ),
        ("networking.k8s.io/v1", "NetworkPolicy") => match NetworkPolicy::deserialize(&value) {
            Ok(obj) => out.policies.push((origin, obj)),
            Err(e) => {
                // Not a deletion: the pods it was written for stay
                // isolated (in the directions it declares) until it is
                // fixed. Without a readable name there is no object to
                // stand in for.
                let key = object_key(&value, true);
                let fallback = match &key {
                    Some(key) => {
                        let policy = stand_in(key, &value);
                        let policy_types = policy
                            .spec
                            .as_ref()
                            .and_then(|s| s.policy_types.clone())
                            .unwrap_or_default();
                        out.stand_ins.push((origin.clone(), policy));
                        Fallback::FailClosed {
                            namespace: key.namespace.to_string(),
                            policy_types,
                        }
                    }
                    None => Fallback::LeftOut,
                };
                out.errors.push(ManifestError::Invalid {
                    origin,
                    kind: "NetworkPolicy",
                    name,
                    key,
                    detail: e.to_string(),
                    fallback,
                });
            }
        },
        ("v1", "List") => {
            let items = value
                .get("items")
                .and_then(|v| v.as_sequence())
                .cloned()
                .unwrap_or_default();
            for item in items {
                add_object(origin.clone(), item, out);
            }
        }
        _ => out.errors.push(ManifestError::UnknownKind {
            origin,
            api_version,
            kind,
        }),
    }
}

impl LoadedManifests {
    /// The cluster state for `node` (whose own addresses are `node_ips`).
    /// Problems are appended to `self.errors`; the objects concerned are
    /// left out, everything else is kept. The objects other than
    /// namespaces move into the state (or are dropped once converted): a
    /// start holds the parsed cluster once, not twice.
    pub fn cluster_state(&mut self, node: &str, node_ips: Vec<std::net::IpAddr>) -> ClusterState {
        let mut state = ClusterState {
            node_name: node.to_owned(),
            node_ips,
            ..Default::default()
        };
        let mut seen: BTreeMap<(&'static str, String), Origin> = BTreeMap::new();
        let mut duplicate = |errors: &mut Vec<ManifestError>,
                             kind: &'static str,
                             name: String,
                             origin: &Origin|
         -> bool {
            if let Some(first) = seen.get(&(kind, name.clone())) {
                errors.push(ManifestError::Duplicate {
                    origin: origin.clone(),
                    kind,
                    name,
                    first: first.clone(),
                });
                return true;
            }
            seen.insert((kind, name), origin.clone());
            false
        };
        for (origin, ns) in &self.namespaces {
            match namespace_info(ns) {
                Ok((name, info)) => {
                    if !duplicate(&mut self.errors, "Namespace", name.clone(), origin) {
                        state.namespaces.insert(name, info);
                    }
                }
                Err(e) => self.errors.push(ManifestError::Invalid {
                    origin: origin.clone(),
                    kind: "Namespace",
                    name: ns.metadata.name.clone().unwrap_or_default(),
                    key: ns.metadata.name.as_ref().map(|n| ObjectRef::new("", n)),
                    detail: e.to_string(),
                    fallback: Fallback::LeftOut,
                }),
            }
        }
        for (origin, pod) in std::mem::take(&mut self.pods) {
            match pod_info(&pod) {
                Ok((key, info)) => {
                    if !duplicate(&mut self.errors, "Pod", key.to_string(), &origin) {
                        state.pods.insert(key, info);
                    }
                }
                Err(e) => self.errors.push(ManifestError::Invalid {
                    origin,
                    kind: "Pod",
                    name: format!(
                        "{}/{}",
                        pod.metadata.namespace.as_deref().unwrap_or("default"),
                        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
                    ),
                    key: pod.metadata.name.as_ref().map(|n| {
                        ObjectRef::new(pod.metadata.namespace.as_deref().unwrap_or("default"), n)
                    }),
                    detail: e.to_string(),
                    fallback: Fallback::LeftOut,
                }),
            }
        }
        for (origin, mut policy) in std::mem::take(&mut self.policies) {
            let namespace = policy
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned());
            let Some(name) = policy.metadata.name.clone() else {
                self.errors.push(ManifestError::Invalid {
                    origin,
                    kind: "NetworkPolicy",
                    name: format!("{namespace}/<unnamed>"),
                    key: None,
                    detail: "metadata.name is missing".into(),
                    fallback: Fallback::LeftOut,
                });
                continue;
            };
            let key = ObjectRef::new(namespace.clone(), name);
            if !duplicate(&mut self.errors, "NetworkPolicy", key.to_string(), &origin) {
                policy.metadata.namespace = Some(namespace);
                state.policies.insert(key, Arc::new(policy));
            }
        }
        macro_rules! convert {
            ($list:ident, $convert:ident, $label:literal, $field:ident) => {
                for (origin, obj) in std::mem::take(&mut self.$list) {
                    let namespace = obj.metadata.namespace.as_deref().unwrap_or("default");
                    let raw_name = obj.metadata.name.clone();
                    match $convert(&obj) {
                        Ok((key, info)) => {
                            if !duplicate(&mut self.errors, $label, key.to_string(), &origin) {
                                state.$field.insert(key, info);
                            }
                        }
                        Err(e) => self.errors.push(ManifestError::Invalid {
                            origin,
                            kind: $label,
                            name: format!(
                                "{namespace}/{}",
                                raw_name.as_deref().unwrap_or("<unnamed>")
                            ),
                            key: raw_name.as_ref().map(|n| ObjectRef::new(namespace, n)),
                            detail: e.to_string(),
                            fallback: Fallback::LeftOut,
                        }),
                    }
                }
            };
        }
        for (origin, node) in std::mem::take(&mut self.nodes) {
            match node_info(&node) {
                Ok((name, info)) => {
                    if !duplicate(&mut self.errors, "Node", name.clone(), &origin) {
                        state.nodes.insert(name, info);
                    }
                }
                Err(e) => self.errors.push(ManifestError::Invalid {
                    origin,
                    kind: "Node",
                    name: "<unnamed>".into(),
                    key: None,
                    detail: e.to_string(),
                    fallback: Fallback::LeftOut,
                }),
            }
        }
        for (origin, cnp) in std::mem::take(&mut self.cluster_policies) {
            let Some(name) = cnp.metadata.name.clone() else {
                self.errors.push(ManifestError::Invalid {
                    origin,
                    kind: "ClusterNetworkPolicy",
                    name: "<unnamed>".into(),
                    key: None,
                    detail: "metadata.name is missing".into(),
                    fallback: Fallback::LeftOut,
                });
                continue;
            };
            if !duplicate(
                &mut self.errors,
                "ClusterNetworkPolicy",
                name.clone(),
                &origin,
            ) {
                state.cluster_policies.insert(name, Arc::new(cnp));
            }
        }
        convert!(services, service_info, "Service", services);
        convert!(
            slices,
            endpoint_slice_info,
            "EndpointSlice",
            endpoint_slices
        );
        // Stand-ins after every policy that decoded: one of those with the
        // same name is the object (and the stand-in a duplicate of it).
        self.standing_in.clear();
        for (origin, policy) in std::mem::take(&mut self.stand_ins) {
            let key = ObjectRef::new(
                policy.metadata.namespace.clone().unwrap_or_default(),
                policy.metadata.name.clone().unwrap_or_default(),
            );
            if !duplicate(&mut self.errors, "NetworkPolicy", key.to_string(), &origin) {
                self.standing_in.insert(key.clone());
                state.policies.insert(key, Arc::new(policy));
            }
        }
        // Objects in a namespace the manifests do not define: the
        // namespace exists implicitly, with only its name label.
        let implied: Vec<String> = state
            .pods
            .keys()
            .chain(state.policies.keys())
            .map(|k| k.namespace.to_string())
            .filter(|ns| !state.namespaces.contains_key(ns))
            .collect();
        for ns in implied {
            let mut labels = BTreeMap::new();
            labels.insert("kubernetes.io/metadata.name".to_owned(), ns.clone());
            state.namespaces.insert(ns, NamespaceInfo { labels });
        }
        state
    }
}

#[cfg(test)]
mod tests;
