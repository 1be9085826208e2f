//! The runtime's parameters: the `CNI_*` environment (SPEC "Parameters")
//! and the pod identity in `CNI_ARGS` (`K=V;K=V`, parsed by key like
//! libcni's `LoadArgs`: containerd passes its pairs in random order).
use super::error::CniError;
use crate::protocol::PodId;

/// `CNI_COMMAND`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Status,
    Gc,
}

impl Command {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "VERSION" => Self::Version,
            "STATUS" => Self::Status,
            "GC" => Self::Gc,
            _ => return None,
        })
    }
}

/// The environment of one invocation. Empty variables count as absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Env {
    pub container_id: String,
    pub netns: Option<String>,
    pub ifname: String,
    pub args: String,
}

/// Reads `CNI_COMMAND` alone (VERSION needs nothing else).
pub fn command(get: &dyn Fn(&str) -> Option<String>) -> Result<Command, CniError> {
    let raw = get("CNI_COMMAND").unwrap_or_default();
    if raw.is_empty() {
        return Err(CniError::env("CNI_COMMAND is not set"));
    }
    Command::parse(&raw).ok_or_else(|| CniError::env(format!("unknown CNI_COMMAND {raw:?}")))
}

/// Reads and checks what `command` requires (skel's table: ADD and CHECK
/// need the netns, DEL may come without it).
pub fn read(get: &dyn Fn(&str) -> Option<String>, command: Command) -> Result<Env, CniError> {
    let var = |name: &str| get(name).filter(|v| !v.is_empty());
    let needs_sandbox = matches!(command, Command::Add | Command::Del | Command::Check);
    let container_id = var("CNI_CONTAINERID").unwrap_or_default();
    let ifname = var("CNI_IFNAME").unwrap_or_default();
    let netns = var("CNI_NETNS");
    if needs_sandbox {
        if container_id.is_empty() {
            return Err(CniError::env("CNI_CONTAINERID is not set"));
        }
        valid_container_id(&container_id)?;
        if ifname.is_empty() {
            return Err(CniError::env("CNI_IFNAME is not set"));
        }
        valid_ifname(&ifname)?;
    }
    if matches!(command, Command::Add | Command::Check) && netns.is_none() {
        return Err(CniError::env("CNI_NETNS is not set"));
    }
    Ok(Env {
        container_id,
        netns,
        ifname,
        args: var("CNI_ARGS").unwrap_or_default(),
    })
}

/// `[A-Za-z0-9][A-Za-z0-9_.-]*` (SPEC "Parameters").
fn valid_container_id(id: &str) -> Result<(), CniError> {
    let mut chars = id.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
        Ok(())
    } else {
        Err(CniError::env(format!("invalid CNI_CONTAINERID {id:?}")))
    }
}

/// A Linux interface name: at most 15 bytes, no '/', ':' or whitespace.
fn valid_ifname(name: &str) -> Result<(), CniError> {
    let ok = name.len() <= 15
        && name != "."
        && name != ".."
        && !name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace());
    if ok {
        Ok(())
    } else {
        Err(CniError::env(format!("invalid CNI_IFNAME {name:?}")))
    }
}

/// What `CNI_ARGS` says about the pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct K8sArgs {
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: Option<String>,
    pub infra_container_id: Option<String>,
}

impl K8sArgs {
    /// The pod, when both namespace and name are known.
    pub fn pod(&self) -> Option<PodId> {
        Some(PodId {
            namespace: self.namespace.clone()?,
            name: self.name.clone()?,
            uid: self.uid.clone(),
        })
    }
}

/// libcni's rules: pairs split on ';', each exactly `K=V`; a key this
/// plugin does not know is an error unless `IgnoreUnknown` is true (`1` or
/// `true`), wherever it stands. A repeated key: the last one wins.
pub fn parse_args(text: &str) -> Result<K8sArgs, CniError> {
    let mut out = K8sArgs::default();
    let mut unknown = Vec::new();
    let mut ignore_unknown = false;
    for pair in text.split(';').filter(|p| !p.is_empty()) {
        let mut parts = pair.split('=');
        let (Some(key), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(CniError::env(format!("CNI_ARGS: invalid pair {pair:?}")));
        };
        let value = (!value.is_empty()).then(|| value.to_owned());
        match key {
            "IgnoreUnknown" => {
                ignore_unknown = match value.as_deref().map(str::to_ascii_lowercase).as_deref() {
                    Some("1" | "true") => true,
                    Some("0" | "false") | None => false,
                    Some(other) => {
                        return Err(CniError::env(format!(
                            "CNI_ARGS: IgnoreUnknown={other:?} is not a boolean"
                        )));
                    }
                }
            }
            "K8S_POD_NAMESPACE" => out.namespace = value,
            "K8S_POD_NAME" => out.name = value,
            "K8S_POD_UID" => out.uid = value,
            "K8S_POD_INFRA_CONTAINER_ID" => out.infra_container_id = value,
            other => unknown.push(other.to_owned()),
        }
    }
    if !unknown.is_empty() && !ignore_unknown {
        return Err(CniError::env(format!(
            "CNI_ARGS: unknown keys {} (and no IgnoreUnknown=1)",
            unknown.join(", ")
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const PAIRS: [&str; 5] = [
        "K8S_POD_NAMESPACE=default",
        "K8S_POD_NAME=web-0",
        "K8S_POD_INFRA_CONTAINER_ID=c0ffee",
        "K8S_POD_UID=6f1c2d7e-0000-4000-8000-000000000001",
        "IgnoreUnknown=1",
    ];

    fn expected() -> K8sArgs {
        K8sArgs {
            namespace: Some("default".into()),
            name: Some("web-0".into()),
            uid: Some("6f1c2d7e-0000-4000-8000-000000000001".into()),
            infra_container_id: Some("c0ffee".into()),
        }
    }

    /// Every order of containerd's five pairs (go-cni copies a map, so the
    /// order changes from call to call) gives the same pod.
    #[test]
    fn cni_args_in_every_order_give_the_same_pod() {
        let mut order: Vec<usize> = (0..PAIRS.len()).collect();
        let mut seen = 0;
        // Heap's algorithm, iteratively: all 120 permutations.
        let mut c = vec![0usize; order.len()];
        let mut check = |order: &[usize]| {
            let text: Vec<&str> = order.iter().map(|&i| PAIRS[i]).collect();
            let text = text.join(";");
            assert_eq!(parse_args(&text), Ok(expected()), "{text}");
            seen += 1;
        };
        check(&order);
        let mut i = 0;
        while i < order.len() {
            if c[i] < i {
                if i % 2 == 0 {
                    order.swap(0, i);
                } else {
                    order.swap(c[i], i);
                }
                check(&order);
                c[i] += 1;
                i = 0;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
        assert_eq!(seen, 120);
    }

    #[test]
    fn cri_o_order_with_extra_requests_parses() {
        let text = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;\
                    K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID=6f1c2d7e-0000-4000-8000-000000000001;\
                    IP=10.0.0.9;MAC=aa:bb:cc:dd:ee:ff";
        assert_eq!(parse_args(text), Ok(expected()));
    }

    #[test]
    fn unknown_keys_need_ignore_unknown_wherever_it_stands() {
        let e = parse_args("K8S_POD_NAME=a;FOO=bar").unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.details.contains("FOO"), "{e}");
        assert!(parse_args("FOO=bar;K8S_POD_NAME=a;IgnoreUnknown=true").is_ok());
        assert!(parse_args("IgnoreUnknown=0;FOO=bar").is_err());
        assert!(parse_args("IgnoreUnknown=maybe").is_err());
    }

    #[test]
    fn malformed_pairs_are_refused() {
        for bad in ["K8S_POD_NAME", "K8S_POD_NAME=a=b", "=;"] {
            let e = parse_args(bad).unwrap_err();
            assert_eq!(e.code, 4, "{bad}");
        }
        assert_eq!(parse_args(""), Ok(K8sArgs::default()));
        assert_eq!(
            parse_args("K8S_POD_NAME=a;").map(|a| a.name),
            Ok(Some("a".into()))
        );
    }

    #[test]
    fn the_pod_needs_namespace_and_name_the_uid_is_optional() {
        let a = parse_args("K8S_POD_NAMESPACE=n;K8S_POD_NAME=p").unwrap_or_default();
        let pod = a.pod().unwrap_or_else(|| panic!("no pod"));
        assert_eq!(
            (pod.namespace.as_str(), pod.name.as_str(), pod.uid),
            ("n", "p", None)
        );
        assert!(
            parse_args("K8S_POD_NAME=p")
                .unwrap_or_default()
                .pod()
                .is_none()
        );
        assert!(
            parse_args("K8S_POD_NAMESPACE=n;K8S_POD_NAME=")
                .unwrap_or_default()
                .pod()
                .is_none()
        );
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn each_command_requires_its_variables() {
        let full = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c0ffee"),
            ("CNI_NETNS", "/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
        ];
        assert!(read(&vars(&full), Command::Add).is_ok());
        for missing in ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"] {
            let some: Vec<_> = full
                .iter()
                .copied()
                .filter(|(k, _)| *k != missing)
                .collect();
            let e = read(&vars(&some), Command::Add).unwrap_err();
            assert_eq!(e.code, 4, "{missing}");
            assert!(e.details.contains(missing), "{e}");
        }
        let no_netns: Vec<_> = full
            .iter()
            .copied()
            .filter(|(k, _)| *k != "CNI_NETNS")
            .collect();
        assert!(
            read(&vars(&no_netns), Command::Del).is_ok(),
            "DEL may lack the netns"
        );
        assert!(read(&vars(&[]), Command::Version).is_ok());
        assert!(read(&vars(&[]), Command::Status).is_ok());
        assert_eq!(command(&vars(&[])).unwrap_err().code, 4);
        assert_eq!(
            command(&vars(&[("CNI_COMMAND", "FROB")])).unwrap_err().code,
            4
        );
        assert_eq!(
            command(&vars(&[("CNI_COMMAND", "CHECK")])),
            Ok(Command::Check)
        );
    }

    #[test]
    fn container_ids_and_interface_names_are_checked() {
        let with = |id: &str, ifname: &str| {
            read(
                &vars(&[
                    ("CNI_CONTAINERID", id),
                    ("CNI_NETNS", "/run/netns/x"),
                    ("CNI_IFNAME", ifname),
                ]),
                Command::Add,
            )
        };
        assert!(with("a1_b.c-d", "eth0").is_ok());
        for (id, ifname) in [
            ("-x", "eth0"),
            ("a b", "eth0"),
            ("a/b", "eth0"),
            ("c0ffee", "eth0/1"),
            ("c0ffee", "averyveryverylongname"),
            ("c0ffee", ".."),
        ] {
            assert_eq!(
                with(id, ifname).map_err(|e| e.code),
                Err(4),
                "{id} {ifname}"
            );
        }
    }
}
