//! Where cluster state comes from: a directory of manifests (no cluster
//! needed) or, in cluster mode, the Kubernetes API.
pub mod cluster;
pub mod manifests;

pub use self::manifests::{LoadedManifests, ManifestError, load_dir};
