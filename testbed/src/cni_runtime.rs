//! A container runtime's CNI side, for tests: what libcni and containerd
//! do with a network list (SPEC §3, `libcni/api.go`).
//!
//! ADD runs the loopback network (containerd's `WithLoNetwork`) and then
//! every plugin of the list in order, each with the derived config on
//! stdin (the list's `cniVersion` and `name` injected, `prevResult` the
//! previous plugin's result, none for the first, `runtimeConfig` for the
//! capabilities a plugin declares) and the exact `CNI_*` environment; the
//! final result is cached. DEL runs the plugins in reverse order, each
//! with the cached result as `prevResult` (from 0.4.0 on), CHECK in order.
//! Plugins run in the node's network namespace through `nsenter --net`
//! (not `ip netns exec`, which remounts /sys), as a runtime runs them in
//! the host's; each pod gets a network namespace of its own, removed with
//! its [`Sandbox`].
use std::{
    io::{Read as _, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use serde_json::{Map, Value, json};

use crate::NetNs;

/// How long one plugin may run before it is killed.
const PLUGIN_DEADLINE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum CniError {
    /// The plugin failed with an error object on stdout.
    #[error("{0}")]
    Plugin(Box<PluginError>),
    /// The plugin failed without an error object, or succeeded with an
    /// unusable result.
    #[error("{command} {plugin}: exit {status:?}, stdout {stdout:?}, stderr {stderr:?}")]
    Failed {
        plugin: String,
        command: String,
        status: Option<i32>,
        stdout: String,
        stderr: String,
    },
    #[error("no plugin {0:?} in CNI_PATH")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("running {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Sim(#[from] crate::Error),
}

/// A plugin's error object (SPEC §5) and its log.
#[derive(Debug, thiserror::Error)]
#[error("{command} {plugin}: CNI error {code}: {msg}: {details} (stderr: {stderr})")]
pub struct PluginError {
    pub plugin: String,
    pub command: String,
    pub code: u64,
    pub msg: String,
    pub details: String,
    pub stderr: String,
}

impl CniError {
    /// The CNI error code, when the plugin printed an error object.
    pub fn code(&self) -> Option<u64> {
        match self {
            Self::Plugin(e) => Some(e.code),
            _ => None,
        }
    }
}

/// One plugin run, as seen from outside.
#[derive(Clone, Debug)]
pub struct Invocation {
    pub plugin: String,
    pub command: String,
    pub stdin: Value,
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// A pod sandbox: its network namespace (deleted on drop), container id,
/// interface, `CNI_ARGS`, and the cached final ADD result.
#[derive(Debug)]
pub struct Sandbox {
    pub container_id: String,
    pub ifname: String,
    pub args: String,
    pub result: Option<Value>,
    pub netns: NetNs,
}

impl Sandbox {
    pub fn netns_path(&self) -> String {
        self.netns.path().display().to_string()
    }
}

/// The network list, where plugins are found, and the node they run in.
#[derive(Debug)]
pub struct CniRuntime {
    list: Value,
    cni_path: Vec<PathBuf>,
    node: String,
    /// Capability arguments (`portMappings`...), given to the plugins
    /// that declare the capability.
    pub capability_args: Map<String, Value>,
    log: Mutex<Vec<Invocation>>,
}

/// containerd's loopback network (go-cni `loNetwork`).
fn loopback_list() -> Value {
    json!({"cniVersion": "0.3.1", "name": "cni-loopback", "plugins": [{"type": "loopback"}]})
}

fn version_at_least(list: &Value, major: u32, minor: u32) -> bool {
    let v = list["cniVersion"].as_str().unwrap_or("");
    let mut it = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0)) >= (major, minor)
}

impl CniRuntime {
    /// A runtime for `list` (a `.conflist` object) running plugins found
    /// in `cni_path` inside `node`'s namespace.
    pub fn new(node: &NetNs, list: Value, cni_path: Vec<PathBuf>) -> Result<Self, CniError> {
        let plugins = list["plugins"].as_array().map_or(0, Vec::len);
        if list["name"].as_str().is_none_or(str::is_empty)
            || list["cniVersion"].as_str().is_none()
            || plugins == 0
        {
            return Err(CniError::Invalid(format!(
                "not a network list (name, cniVersion, plugins): {list}"
            )));
        }
        Ok(Self {
            list,
            cni_path,
            node: node.name.clone(),
            capability_args: Map::new(),
            log: Mutex::new(Vec::new()),
        })
    }

    pub fn list(&self) -> &Value {
        &self.list
    }

    /// A new pod sandbox: a network namespace `<prefix>-c<n>` and a
    /// containerd-like 64-hex container id. `args` as containerd builds
    /// them (`K8S_POD_*`, `IgnoreUnknown=1`).
    pub fn sandbox(
        &self,
        prefix: &str,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<Sandbox, CniError> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let netns = NetNs::create(&format!("{prefix}-c{n}"))?;
        // No duplicate address detection: addresses are usable at once
        // (ptp waits for them to settle).
        netns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        netns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let container_id = format!("{:08x}{n:08x}{nanos:048x}", std::process::id());
        let args = format!(
            "K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID={uid};IgnoreUnknown=1;\
             K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}"
        );
        Ok(Sandbox {
            container_id,
            ifname: "eth0".into(),
            args,
            result: None,
            netns,
        })
    }

    /// Every invocation since the last call.
    pub fn take_log(&self) -> Vec<Invocation> {
        self.log
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default()
    }

    fn find(&self, plugin: &str) -> Result<PathBuf, CniError> {
        self.cni_path
            .iter()
            .map(|d| d.join(plugin))
            .find(|p| p.is_file())
            .ok_or_else(|| CniError::NotFound(plugin.to_owned()))
    }

    /// The config one plugin gets (SPEC "Deriving request configuration").
    pub fn derive(&self, list: &Value, plugin: &Value, prev: Option<&Value>) -> Value {
        let mut conf = plugin.as_object().cloned().unwrap_or_default();
        conf.insert("cniVersion".into(), list["cniVersion"].clone());
        conf.insert("name".into(), list["name"].clone());
        if let Some(prev) = prev {
            conf.insert("prevResult".into(), prev.clone());
        }
        let mut runtime_config = Map::new();
        if let Some(caps) = plugin["capabilities"].as_object() {
            for (cap, on) in caps {
                if let (Some(true), Some(arg)) = (on.as_bool(), self.capability_args.get(cap)) {
                    runtime_config.insert(cap.clone(), arg.clone());
                }
            }
        }
        if !runtime_config.is_empty() {
            conf.insert("runtimeConfig".into(), Value::Object(runtime_config));
        }
        Value::Object(conf)
    }

    /// Runs one plugin with `command` for `sb`, `conf` on stdin.
    pub fn invoke(
        &self,
        command: &str,
        sb: &Sandbox,
        conf: &Value,
    ) -> Result<Invocation, CniError> {
        let plugin = conf["type"].as_str().unwrap_or("").to_owned();
        let path = self.find(&plugin)?;
        let ifname = if conf["type"] == "loopback" {
            "lo"
        } else {
            sb.ifname.as_str()
        };
        let cni_path =
            std::env::join_paths(&self.cni_path).map_err(|e| CniError::Invalid(e.to_string()))?;
        let stdin = conf.to_string();
        let mut attempt = 0;
        loop {
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--net=/run/netns/{}", self.node))
                .arg(&path)
                .env_clear()
                .env(
                    "PATH",
                    std::env::var_os("PATH")
                        .unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
                )
                .env("CNI_COMMAND", command)
                .env("CNI_CONTAINERID", &sb.container_id)
                .env("CNI_NETNS", sb.netns_path())
                .env("CNI_IFNAME", ifname)
                .env("CNI_ARGS", &sb.args)
                .env("CNI_PATH", &cni_path);
            let inv = run_bounded(cmd, &stdin, &plugin, command)?;
            // A binary written a moment ago may still be open for writing
            // (libcni's RawExec retries "text file busy" too).
            if inv.status != Some(0) && inv.stderr.contains("Text file busy") && attempt < 5 {
                attempt += 1;
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            let inv = Invocation {
                stdin: conf.clone(),
                ..inv
            };
            if let Ok(mut log) = self.log.lock() {
                log.push(inv.clone());
            }
            return Ok(inv);
        }
    }

    /// Runs `command` and turns a failure into its error.
    fn call(&self, command: &str, sb: &Sandbox, conf: &Value) -> Result<Invocation, CniError> {
        let inv = self.invoke(command, sb, conf)?;
        if inv.status == Some(0) {
            return Ok(inv);
        }
        let error: Option<Value> = serde_json::from_str(inv.stdout.trim()).ok();
        match error
            .as_ref()
            .and_then(|e| e["code"].as_u64().map(|c| (c, e)))
        {
            Some((code, e)) => Err(CniError::Plugin(Box::new(PluginError {
                plugin: inv.plugin,
                command: inv.command,
                code,
                msg: e["msg"].as_str().unwrap_or("").to_owned(),
                details: e["details"].as_str().unwrap_or("").to_owned(),
                stderr: inv.stderr,
            }))),
            None => Err(CniError::Failed {
                plugin: inv.plugin,
                command: inv.command,
                status: inv.status,
                stdout: inv.stdout,
                stderr: inv.stderr,
            }),
        }
    }

    fn add_list(&self, list: &Value, sb: &Sandbox) -> Result<Value, CniError> {
        let mut prev: Option<Value> = None;
        for plugin in list["plugins"].as_array().map_or(&[][..], Vec::as_slice) {
            let conf = self.derive(list, plugin, prev.as_ref());
            let inv = self.call("ADD", sb, &conf)?;
            let result: Value =
                serde_json::from_str(inv.stdout.trim()).map_err(|_| CniError::Failed {
                    plugin: inv.plugin.clone(),
                    command: "ADD".into(),
                    status: inv.status,
                    stdout: inv.stdout.clone(),
                    stderr: inv.stderr.clone(),
                })?;
            prev = Some(result);
        }
        prev.ok_or_else(|| CniError::Invalid("an empty list".into()))
    }

    /// ADD: loopback, then the list; the final result is cached in `sb`
    /// and returned. On failure nothing is cached: call [`Self::del`]
    /// anyway, as a runtime must.
    pub fn add(&self, sb: &mut Sandbox) -> Result<Value, CniError> {
        self.add_list(&loopback_list(), sb)?;
        let result = self.add_list(&self.list, sb)?;
        sb.result = Some(result.clone());
        Ok(result)
    }

    fn del_list(&self, list: &Value, sb: &Sandbox, cached: Option<&Value>) -> Result<(), CniError> {
        // prevResult on DEL only from 0.4.0 on, and only when cached.
        let prev = cached.filter(|_| version_at_least(list, 0, 4));
        for plugin in list["plugins"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .rev()
        {
            let conf = self.derive(list, plugin, prev);
            self.call("DEL", sb, &conf)?;
        }
        Ok(())
    }

    /// DEL: loopback, then the list in reverse order; the cache is
    /// dropped once every plugin succeeded.
    pub fn del(&self, sb: &mut Sandbox) -> Result<(), CniError> {
        self.del_list(&loopback_list(), sb, None)?;
        self.del_list(&self.list, sb, sb.result.as_ref())?;
        sb.result = None;
        Ok(())
    }

    /// CHECK: every plugin in order with the cached result (libcni
    /// refuses lists older than 0.4.0 and sandboxes without a cache).
    pub fn check(&self, sb: &Sandbox) -> Result<(), CniError> {
        if !version_at_least(&self.list, 0, 4) {
            return Err(CniError::Invalid(format!(
                "CHECK needs cniVersion 0.4.0 or later, the list is {}",
                self.list["cniVersion"]
            )));
        }
        let cached = sb
            .result
            .as_ref()
            .ok_or_else(|| CniError::Invalid("no cached result to CHECK".into()))?;
        for plugin in self.list["plugins"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
        {
            let conf = self.derive(&self.list, plugin, Some(cached));
            self.call("CHECK", sb, &conf)?;
        }
        Ok(())
    }

    /// VERSION of one plugin (stdin: the list's version only).
    pub fn version(&self, plugin: &str) -> Result<Value, CniError> {
        let path = self.find(plugin)?;
        let mut cmd = Command::new(path);
        cmd.env_clear().env("CNI_COMMAND", "VERSION");
        let stdin = json!({"cniVersion": self.list["cniVersion"]}).to_string();
        let inv = run_bounded(cmd, &stdin, plugin, "VERSION")?;
        serde_json::from_str(inv.stdout.trim()).map_err(|_| CniError::Failed {
            plugin: plugin.to_owned(),
            command: "VERSION".into(),
            status: inv.status,
            stdout: inv.stdout,
            stderr: inv.stderr,
        })
    }
}

/// Spawns, feeds stdin, and waits at most [`PLUGIN_DEADLINE`] (killing
/// the plugin then).
fn run_bounded(
    mut cmd: Command,
    stdin: &str,
    plugin: &str,
    command: &str,
) -> Result<Invocation, CniError> {
    let io = |what: &str| {
        let what = format!("{what} {plugin} ({command})");
        move |source| CniError::Io { what, source }
    };
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io("spawning"))?;
    if let Some(mut pipe) = child.stdin.take() {
        // A plugin that exits without reading (VERSION) closes the pipe.
        let _ = pipe.write_all(stdin.as_bytes());
    }
    // Drain both pipes on threads so a chatty plugin never blocks.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let status = loop {
        if let Some(s) = child.try_wait().map_err(io("waiting for"))? {
            break s;
        }
        if start.elapsed() > PLUGIN_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CniError::Invalid(format!(
                "{command} {plugin} did not finish within {PLUGIN_DEADLINE:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let elapsed = start.elapsed();
    Ok(Invocation {
        plugin: plugin.to_owned(),
        command: command.to_owned(),
        stdin: Value::Null,
        status: status.code(),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed,
    })
}

/// Debian's plugins (`containernetworking-plugins`).
pub const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";

/// `CNI_PATH` for tests: Debian's plugins, then ours.
pub fn test_cni_path() -> Result<Vec<PathBuf>, CniError> {
    if !Path::new(DEBIAN_CNI_DIR).join("ptp").is_file() {
        return Err(CniError::Invalid(format!(
            "no ptp in {DEBIAN_CNI_DIR}: install containernetworking-plugins (scripts/setup.sh)"
        )));
    }
    let ours =
        crate::workspace_bins::dir(crate::workspace_bins::Bin::Cni).map_err(CniError::Invalid)?;
    Ok(vec![PathBuf::from(DEBIAN_CNI_DIR), ours])
}
