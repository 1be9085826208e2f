//! A directory of YAML manifests as a source: the loader (`apply`,
//! `explain`, `render` read a directory once) and the watcher (`run`).
mod directory;
mod load;
mod watch;

pub use self::{
    directory::Directory,
    load::{
        Fallback, LoadedManifests, ManifestError, Origin, is_manifest, load_dir, load_file,
        load_text, stand_in,
    },
    watch::watch,
};
