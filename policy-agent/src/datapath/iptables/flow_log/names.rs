//! What names the iptables datapath's flow records without pins: the
//! driver writes the compiled rule names, the identities and the local
//! pods to a file on every sync that changes them (written whole to a
//! temporary file, then renamed over it; mode 0600), and a reader takes
//! it back with [`read_names`].
use std::{
    collections::BTreeMap,
    io::Write as _,
    net::IpAddr,
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
};

use policy_common::{
    identity::{IDENTITY_NAME_LEN, IdentityName},
    rule_name::{RULE_TEXT_LEN, RuleKey, RuleName},
};
use serde::{Deserialize, Serialize};

use super::Error;

/// Where the daemon keeps the names file unless told otherwise.
pub const DEFAULT_NAMES_FILE: &str = "/run/policy-agent/iptables-names.json";

/// The names file of the enforcement a pin root stands for (the agent's
/// handle on an installation, whichever datapath it runs): two agents on
/// one node (tests, side by side) keep theirs apart.
pub fn names_path(pin_root: &Path) -> std::path::PathBuf {
    let hash = crate::mapstate::fnv1a64(pin_root.as_os_str().as_encoded_bytes());
    Path::new("/run/policy-agent").join(format!("iptables-names-{hash:016x}.json"))
}

/// The version of the file's layout; a reader refuses another.
const VERSION: u32 = 1;

/// The names a flow record's numbers stand for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IptablesNames {
    /// The NFLOG group the records go to (None: records are off).
    pub group: Option<u16>,
    /// The compiled `MapState::rule_names`.
    pub rules: BTreeMap<RuleKey, RuleName>,
    /// The compiled `MapState::identities`.
    pub identities: BTreeMap<u32, std::sync::Arc<IdentityName>>,
    /// Each local pod's host interface (ifindex) → "namespace/name".
    pub pods: BTreeMap<u32, String>,
    /// The addresses of the pod on each interface.
    pub pod_addresses: BTreeMap<u32, Vec<IpAddr>>,
}

impl IptablesNames {
    /// These names with `newer`'s added (and `newer`'s where both name a
    /// number): what the rules in place and the rules about to replace
    /// them can both record.
    pub fn union(&self, newer: &Self) -> Self {
        let mut out = self.clone();
        out.group = newer.group;
        out.rules.extend(newer.rules.iter().map(|(k, v)| (*k, *v)));
        out.identities
            .extend(newer.identities.iter().map(|(k, v)| (*k, v.clone())));
        out.pods
            .extend(newer.pods.iter().map(|(k, v)| (*k, v.clone())));
        out.pod_addresses
            .extend(newer.pod_addresses.iter().map(|(k, v)| (*k, v.clone())));
        out
    }
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    group: Option<u16>,
    rules: Vec<Rule>,
    identities: Vec<Identity>,
    pods: Vec<Pod>,
}

#[derive(Serialize, Deserialize)]
struct Rule {
    kind: u8,
    direction: u8,
    index: u16,
    id: u32,
    rule_index: u16,
    priority: u32,
    /// The full byte length of namespace, policy and rule name.
    full_len: [u16; 3],
    /// The texts as stored (each cut at a character boundary).
    namespace: String,
    policy: String,
    rule: String,
}

#[derive(Serialize, Deserialize)]
struct Identity {
    id: u32,
    kind: u32,
    /// The hash of the whole canonical name, hex.
    name_hash: String,
    name_len: u32,
    /// The stored name; `name_hex` instead where it was cut inside a
    /// character.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name_hex: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Pod {
    ifindex: u32,
    pod: String,
    addresses: Vec<IpAddr>,
}

fn rule_texts(n: &RuleName) -> [String; 3] {
    let mut at = 0;
    n.stored_len.map(|len| {
        let len = usize::from(len).min(RULE_TEXT_LEN - at);
        let text = String::from_utf8_lossy(&n.text[at..at + len]).into_owned();
        at += len;
        text
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl IptablesNames {
    fn to_file(&self) -> File {
        File {
            version: VERSION,
            group: self.group,
            rules: self
                .rules
                .iter()
                .map(|(k, n)| {
                    let [namespace, policy, rule] = rule_texts(n);
                    Rule {
                        kind: k.kind,
                        direction: k.direction,
                        index: k.index,
                        id: k.id,
                        rule_index: n.rule_index,
                        priority: n.priority,
                        full_len: n.full_len,
                        namespace,
                        policy,
                        rule,
                    }
                })
                .collect(),
            identities: self
                .identities
                .iter()
                .map(|(id, n)| {
                    let stored = &n.name[..(n.name_len as usize).min(IDENTITY_NAME_LEN)];
                    let text = std::str::from_utf8(stored).ok().map(str::to_owned);
                    Identity {
                        id: *id,
                        kind: n.kind,
                        name_hash: format!("{:016x}", n.name_hash),
                        name_len: n.name_len,
                        name_hex: text.is_none().then(|| hex(stored)),
                        name: text,
                    }
                })
                .collect(),
            pods: self
                .pods
                .iter()
                .map(|(ifindex, pod)| Pod {
                    ifindex: *ifindex,
                    pod: pod.clone(),
                    addresses: self.pod_addresses.get(ifindex).cloned().unwrap_or_default(),
                })
                .collect(),
        }
    }

    fn from_file(f: File) -> Result<Self, String> {
        if f.version != VERSION {
            return Err(format!(
                "layout version {} (this agent reads {VERSION})",
                f.version
            ));
        }
        let mut out = Self {
            group: f.group,
            ..Self::default()
        };
        for r in f.rules {
            let texts = [&r.namespace, &r.policy, &r.rule];
            let total: usize = texts.iter().map(|t| t.len()).sum();
            if total > RULE_TEXT_LEN {
                return Err(format!(
                    "rule {}: its texts exceed {RULE_TEXT_LEN} bytes",
                    r.id
                ));
            }
            let mut name = RuleName {
                direction: r.direction,
                _pad: 0,
                rule_index: r.rule_index,
                priority: r.priority,
                full_len: r.full_len,
                stored_len: texts.map(|t| t.len() as u16),
                text: [0; RULE_TEXT_LEN],
            };
            let mut at = 0;
            for t in texts {
                name.text[at..at + t.len()].copy_from_slice(t.as_bytes());
                at += t.len();
            }
            let key = RuleKey {
                kind: r.kind,
                direction: r.direction,
                index: r.index,
                id: r.id,
            };
            out.rules.insert(key, name);
        }
        for i in f.identities {
            let stored = match (&i.name, &i.name_hex) {
                (Some(text), _) => text.as_bytes().to_vec(),
                (None, Some(h)) => {
                    unhex(h).ok_or_else(|| format!("identity {}: bad name_hex", i.id))?
                }
                (None, None) => Vec::new(),
            };
            if stored.len() > IDENTITY_NAME_LEN {
                return Err(format!(
                    "identity {}: name longer than {IDENTITY_NAME_LEN} bytes",
                    i.id
                ));
            }
            let mut name = [0u8; IDENTITY_NAME_LEN];
            name[..stored.len()].copy_from_slice(&stored);
            let name_hash = u64::from_str_radix(&i.name_hash, 16)
                .map_err(|e| format!("identity {}: name_hash: {e}", i.id))?;
            out.identities.insert(
                i.id,
                std::sync::Arc::new(IdentityName {
                    name_hash,
                    kind: i.kind,
                    name_len: i.name_len,
                    name,
                }),
            );
        }
        for p in f.pods {
            out.pod_addresses.insert(p.ifindex, p.addresses);
            out.pods.insert(p.ifindex, p.pod);
        }
        Ok(out)
    }

    /// The file's text.
    pub fn to_json(&self) -> String {
        // Plain data of strings and numbers: it always serializes.
        serde_json::to_string_pretty(&self.to_file()).unwrap_or_default()
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::NamesIo {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `names` to `path` atomically: a reader sees the old file or the
/// new one, never a part. Mode 0600 (the names of every pod and policy).
pub fn write_names(path: &Path, names: &IptablesNames) -> Result<(), Error> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let mut tmp = PathBuf::from(path);
    tmp.as_mut_os_string()
        .push(format!(".tmp.{}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(names.to_json().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io(path))
}

/// The names the driver last wrote to `path`.
pub fn read_names(path: &Path) -> Result<IptablesNames, Error> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let file: File = serde_json::from_str(&text).map_err(|e| Error::NamesFormat {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    IptablesNames::from_file(file).map_err(|detail| Error::NamesFormat {
        path: path.to_path_buf(),
        detail,
    })
}

/// Removes the names file (`reset`); false when there was none.
pub fn remove_names(path: &Path) -> Result<bool, Error> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use policy_common::{direction, rule_name::kind};

    use super::*;
    use crate::mapstate::{identity_name, rule_name};

    fn sample() -> IptablesNames {
        let mut n = IptablesNames {
            group: Some(10410),
            ..IptablesNames::default()
        };
        n.rules.insert(
            RuleKey::new(kind::NETWORK_POLICY, direction::INGRESS, 0x2a),
            rule_name(direction::INGRESS, 1, 0, "alpha", "allow-web", ""),
        );
        n.rules.insert(
            RuleKey::isolating(direction::INGRESS, 7, 0),
            rule_name(
                direction::INGRESS,
                usize::from(u16::MAX),
                0,
                "alpha",
                "allow-web",
                "",
            ),
        );
        // A name cut mid-character (stored as hex) and a long rule text.
        let long = "é".repeat(200);
        n.rules.insert(
            RuleKey::new(kind::ADMIN, direction::EGRESS, 3),
            rule_name(direction::EGRESS, 0, 50, "", &long, "named"),
        );
        n.identities.insert(
            7,
            std::sync::Arc::new(identity_name(1, "k8s:app=db;ns=alpha")),
        );
        n.identities
            .insert(8, std::sync::Arc::new(identity_name(1, &"ü".repeat(200))));
        n.pods.insert(12, "alpha/db".into());
        n.pod_addresses.insert(
            12,
            vec!["10.244.1.12".parse().unwrap(), "fd00::c".parse().unwrap()],
        );
        n
    }

    #[test]
    fn the_union_keeps_the_old_names_and_takes_the_new() {
        let old = sample();
        let mut new = IptablesNames {
            group: Some(10411),
            ..IptablesNames::default()
        };
        new.identities.insert(
            9,
            std::sync::Arc::new(identity_name(1, "k8s:app=web;ns=gamma")),
        );
        new.identities.insert(
            7,
            std::sync::Arc::new(identity_name(1, "k8s:app=db;ns=beta")),
        );
        let both = old.union(&new);
        assert_eq!(both.group, Some(10411));
        assert_eq!(both.identities.len(), 3, "7 and 8 kept, 9 added");
        assert_eq!(
            both.identities[&7], new.identities[&7],
            "the newer name wins"
        );
        assert_eq!(both.identities[&8], old.identities[&8]);
        assert_eq!(both.rules, old.rules);
        assert_eq!(both.pods, old.pods);
    }

    #[test]
    fn the_names_round_trip_exactly_through_a_private_file() {
        let dir = std::env::temp_dir().join(format!("pa-names-{}", std::process::id()));
        let path = dir.join("sub").join("names.json");
        let names = sample();
        write_names(&path, &names).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(read_names(&path).unwrap(), names);
        // Written again over itself; nothing left beside it.
        write_names(&path, &IptablesNames::default()).unwrap();
        assert_eq!(read_names(&path).unwrap(), IptablesNames::default());
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1);
        assert!(remove_names(&path).unwrap());
        assert!(!remove_names(&path).unwrap());
        assert!(matches!(read_names(&path), Err(Error::NamesIo { .. })));
        std::fs::write(
            &path,
            "{\"version\": 2, \"group\": null, \"rules\": [], \"identities\": [], \"pods\": []}",
        )
        .unwrap();
        assert!(matches!(read_names(&path), Err(Error::NamesFormat { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
