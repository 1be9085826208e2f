//! Our CNI configuration: a copy of the node's primary network list with
//! this plugin appended last (Cilium's approach: our own file, sorted
//! before the primary, so containerd and CRI-O load it, and the primary's
//! writer — kindnet rewrites its file with temp + rename — never fights
//! us). Pure functions on file contents; `super` does the I/O.
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::plugin::config::Version;

/// The `type` of our plugin entry (the binary's name in the CNI bin dir).
pub const PLUGIN_TYPE: &str = "policy-cni";

/// The extensions the runtimes load (containerd: .conf, .conflist, .json).
const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

/// Why a file is not a usable network configuration.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("not JSON: {0}")]
    Json(String),
    #[error("{0}")]
    Shape(String),
}

/// Whether the runtime would consider `name` a configuration file.
pub fn is_config_name(name: &str) -> bool {
    !name.starts_with('.')
        && Path::new(name)
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e))
}

/// The file's network as a list, as libcni reads it: a `.conflist` must
/// have a name and a non-empty `plugins` list; a `.conf`/`.json` is one
/// plugin (it needs a `type`), wrapped into a list of its own name and
/// version (libcni `ConfListFromConf`).
pub fn load(path: &Path, text: &str) -> Result<Value, Invalid> {
    let value: Value = serde_json::from_str(text).map_err(|e| Invalid::Json(e.to_string()))?;
    let Value::Object(obj) = value else {
        return Err(Invalid::Shape("not a JSON object".into()));
    };
    let name = obj.get("name").and_then(Value::as_str).unwrap_or("");
    if name.is_empty() {
        return Err(Invalid::Shape("no network name".into()));
    }
    let list = if path.extension().and_then(|e| e.to_str()) == Some("conflist") {
        let plugins = obj.get("plugins").and_then(Value::as_array);
        if plugins.is_none_or(Vec::is_empty) {
            return Err(Invalid::Shape("no plugins".into()));
        }
        Value::Object(obj)
    } else {
        if obj
            .get("type")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err(Invalid::Shape(
                "a single plugin config without a type".into(),
            ));
        }
        let mut list = Map::new();
        list.insert(
            "cniVersion".into(),
            obj.get("cniVersion").cloned().unwrap_or(Value::from("")),
        );
        list.insert("name".into(), Value::from(name));
        let mut plugin = obj;
        plugin.remove("cniVersion");
        plugin.remove("name");
        list.insert("plugins".into(), Value::Array(vec![Value::Object(plugin)]));
        Value::Object(list)
    };
    let plugins = list
        .get("plugins")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if plugins.iter().any(|p| {
        p.get("type")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
    }) {
        return Err(Invalid::Shape("a plugin without a type".into()));
    }
    Ok(list)
}

/// The list with our entry appended last: same name, version and plugins
/// in their order; an entry of ours already in it (an older install, an
/// in-place edit) is dropped first, so it is never there twice. Lists
/// older than 0.3.0 have no chaining (no `prevResult`).
pub fn chained(list: &Value, entry: &Value) -> Result<Value, Invalid> {
    let version = list.get("cniVersion").and_then(Value::as_str).unwrap_or("");
    if Version::parse(version).is_none_or(|v| v < Version(0, 3, 0)) {
        return Err(Invalid::Shape(format!(
            "cniVersion {version:?} has no plugin chaining (0.3.0 or later needed)"
        )));
    }
    let mut out = list.clone();
    if let Some(plugins) = out.get_mut("plugins").and_then(Value::as_array_mut) {
        plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE));
        if plugins.is_empty() {
            return Err(Invalid::Shape("no plugin but ours".into()));
        }
        plugins.push(entry.clone());
    }
    Ok(out)
}

/// Our plugin's entry.
pub fn entry(socket: &str, timeout_seconds: f64) -> Value {
    serde_json::json!({
        "type": PLUGIN_TYPE,
        "socket": socket,
        "timeoutSeconds": timeout_seconds,
    })
}

/// The text written (stable, so an unchanged primary rewrites nothing).
pub fn render(list: &Value) -> String {
    let mut text = serde_json::to_string_pretty(list).unwrap_or_default();
    text.push('\n');
    text
}

/// The primary as the runtime picks it: the first file by name that
/// loads, ours excluded; the files skipped on the way and why.
#[derive(Debug, PartialEq)]
pub struct Primary {
    pub path: PathBuf,
    pub list: Value,
    pub skipped: Vec<(PathBuf, Invalid)>,
}

/// Picks the primary among `(file name, contents)` of the conf dir.
pub fn pick(
    dir: &Path,
    files: &[(String, String)],
    ours: &str,
) -> Result<Primary, Vec<(PathBuf, Invalid)>> {
    let mut names: Vec<&(String, String)> = files
        .iter()
        .filter(|(n, _)| n != ours && is_config_name(n))
        .collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let mut skipped = Vec::new();
    for (name, text) in names {
        let path = dir.join(name);
        match load(&path, text) {
            Ok(list) => {
                return Ok(Primary {
                    path,
                    list,
                    skipped,
                });
            }
            Err(e) => skipped.push((path, e)),
        }
    }
    Err(skipped)
}

#[cfg(test)]
mod tests;
