//! Reading a directory of YAML manifests (v1 Namespace, v1 Pod,
//! networking.k8s.io/v1 NetworkPolicy; `List` objects too) into a
//! [`ClusterState`]. Every problem names the file, the document and the
//! object; everything readable is still returned.
use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
};

use k8s_openapi::api::{core::v1::Namespace, core::v1::Pod, networking::v1::NetworkPolicy};
use serde::Deserialize;

use crate::cluster::{
    ClusterState, NamespaceInfo, ObjectRef, Problem, Subject, namespace_info, pod_info,
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
    #[error(
        "{origin}: unsupported object kind {kind:?} (apiVersion {api_version:?}); expected v1 Namespace, v1 Pod or networking.k8s.io/v1 NetworkPolicy"
    )]
    UnknownKind {
        origin: Origin,
        api_version: String,
        kind: String,
    },
    #[error("{origin}: {kind} {name}: {detail}")]
    Invalid {
        origin: Origin,
        kind: &'static str,
        name: String,
        detail: String,
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

impl ManifestError {
    /// Where the problem is: the file, and the document when known.
    fn origin(&self) -> (PathBuf, Option<usize>) {
        match self {
            Self::Read { path, .. } => (path.clone(), None),
            Self::Yaml { origin, .. }
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
            Self::UnknownKind {
                api_version, kind, ..
            } => format!(
                "unsupported object kind {kind:?} (apiVersion {api_version:?}); expected v1 Namespace, v1 Pod or networking.k8s.io/v1 NetworkPolicy"
            ),
            Self::Invalid {
                kind, name, detail, ..
            } => format!("{kind} {name}: {detail}"),
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
        match serde_yaml::Value::deserialize(doc) {
            Ok(serde_yaml::Value::Null) => {}
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

fn text_field(value: &serde_yaml::Value, key: &str) -> String {
    value
        .get(key)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned()
}

fn object_name(value: &serde_yaml::Value) -> String {
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

fn add_object(origin: Origin, value: serde_yaml::Value, out: &mut LoadedManifests) {
    let api_version = text_field(&value, "apiVersion");
    let kind = text_field(&value, "kind");
    let name = object_name(&value);
    macro_rules! parse {
        ($ty:ty, $label:literal, $list:ident) => {
            match serde_yaml::from_value::<$ty>(value) {
                Ok(obj) => out.$list.push((origin, obj)),
                Err(e) => out.errors.push(ManifestError::Invalid {
                    origin,
                    kind: $label,
                    name,
                    detail: e.to_string(),
                }),
            }
        };
    }
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Namespace") => parse!(Namespace, "Namespace", namespaces),
        ("v1", "Pod") => parse!(Pod, "Pod", pods),
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            parse!(NetworkPolicy, "NetworkPolicy", policies)
        }
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
    /// left out, everything else is kept.
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
                    detail: e.to_string(),
                }),
            }
        }
        for (origin, pod) in &self.pods {
            match pod_info(pod) {
                Ok((key, info)) => {
                    if !duplicate(&mut self.errors, "Pod", key.to_string(), origin) {
                        state.pods.insert(key, info);
                    }
                }
                Err(e) => self.errors.push(ManifestError::Invalid {
                    origin: origin.clone(),
                    kind: "Pod",
                    name: format!(
                        "{}/{}",
                        pod.metadata.namespace.as_deref().unwrap_or("default"),
                        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
                    ),
                    detail: e.to_string(),
                }),
            }
        }
        for (origin, policy) in &self.policies {
            let namespace = policy
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned());
            let Some(name) = policy.metadata.name.clone() else {
                self.errors.push(ManifestError::Invalid {
                    origin: origin.clone(),
                    kind: "NetworkPolicy",
                    name: format!("{namespace}/<unnamed>"),
                    detail: "metadata.name is missing".into(),
                });
                continue;
            };
            let key = ObjectRef::new(namespace.clone(), name);
            if !duplicate(&mut self.errors, "NetworkPolicy", key.to_string(), origin) {
                let mut policy = policy.clone();
                policy.metadata.namespace = Some(namespace);
                state.policies.insert(key, policy);
            }
        }
        // Objects in a namespace the manifests do not define: the
        // namespace exists implicitly, with only its name label.
        let implied: Vec<String> = state
            .pods
            .keys()
            .chain(state.policies.keys())
            .map(|k| k.namespace.clone())
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
mod tests {
    use super::*;

    #[test]
    fn multi_document_files_unknown_kinds_and_bad_objects_are_reported_by_name() {
        let text = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: x, ports: [{name: http, containerPort: 80}]}]}
status: {podIP: 10.0.0.5}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
---
apiVersion: v1
kind: Pod
metadata: {name: bad, namespace: shop}
spec: {containers: "not a list"}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny, namespace: other}
spec: {podSelector: {}}
"#;
        let mut out = LoadedManifests::default();
        load_text(Path::new("a.yaml"), text, &mut out);
        assert_eq!(out.namespaces.len(), 1);
        assert_eq!(out.pods.len(), 1);
        assert_eq!(out.policies.len(), 1);
        assert_eq!(out.errors.len(), 2, "{:?}", out.errors);
        let msgs: Vec<String> = out.errors.iter().map(ToString::to_string).collect();
        assert!(
            msgs[0].contains("a.yaml (document 3)") && msgs[0].contains("Deployment"),
            "{}",
            msgs[0]
        );
        assert!(
            msgs[1].contains("a.yaml (document 4)") && msgs[1].contains("Pod shop/bad"),
            "{}",
            msgs[1]
        );
        let state = out.cluster_state("n1", vec![]);
        assert_eq!(state.pods.len(), 1);
        let pod = &state.pods[&ObjectRef::new("shop", "web")];
        assert_eq!(
            pod.ips,
            vec!["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]
        );
        assert_eq!(pod.ports[0].name.as_deref(), Some("http"));
        // "other" is implied by the policy and gets its name label.
        assert_eq!(
            state.namespaces["other"].labels["kubernetes.io/metadata.name"],
            "other"
        );
        assert_eq!(
            state.namespaces["shop"].labels["kubernetes.io/metadata.name"],
            "shop"
        );
    }

    #[test]
    fn broken_yaml_names_the_file() {
        let mut out = LoadedManifests::default();
        load_text(Path::new("b.yml"), "kind: [unclosed\n", &mut out);
        assert!(
            matches!(&out.errors[0], ManifestError::Yaml { origin, .. } if origin.file == Path::new("b.yml"))
        );
    }

    #[test]
    fn duplicates_keep_the_first_and_are_reported() {
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: d}\nspec: {containers: []}\n";
        let mut out = LoadedManifests::default();
        load_text(Path::new("1.yaml"), pod, &mut out);
        load_text(Path::new("2.yaml"), pod, &mut out);
        let state = out.cluster_state("n", vec![]);
        assert_eq!(state.pods.len(), 1);
        assert!(
            out.errors
                .iter()
                .any(|e| matches!(e, ManifestError::Duplicate { .. }))
        );
    }
}
