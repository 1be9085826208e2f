//! The daemon's HTTP listener under a flood of idle connections (`run` on
//! a simulated node, needs root): thousands of connections that never send
//! a request neither starve `/healthz` nor stop the daemon from enforcing
//! a change, and the daemon keeps few descriptors.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use policy_testbed::fixtures::conformance::{Backend, Conformance, ns_of};

/// The probes' address (and 19433 for the second test, 19432 its metrics).
const PORT: u16 = 19431;
const IDLE: usize = 3000;
/// The daemon's descriptor limit here: the soft limit most init systems
/// give a process. The agent's own needs (maps, netlink, inotify, the
/// manifests it reads) share it with whoever connects.
const AGENT_NOFILE: u64 = 1024;

/// Sets the descriptor limit of `pid` (0: this process), soft and hard.
fn set_nofile(pid: libc::pid_t, n: u64) {
    let lim = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: prlimit with a valid rlimit and no old-value pointer.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// Raises this process's soft descriptor limit towards `n` (up to its
/// hard limit: raising that needs CAP_SYS_RESOURCE).
fn raise_own_nofile(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_cur.max(n.min(lim.rlim_max));
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_cur >= n,
        "this process may open only {} descriptors",
        lim.rlim_cur
    );
}

/// Connections to the daemon from the node namespace that send nothing;
/// stops at the first few that cannot connect (a listener that no longer
/// accepts fills its backlog).
fn idle_connections(c: &Conformance, n: usize) -> Vec<TcpStream> {
    let to = SocketAddr::from(([127, 0, 0, 1], PORT));
    c.node()
        .node
        .spawn(move || {
            let mut out = Vec::new();
            let mut failures = 0;
            while out.len() < n && failures < 20 {
                match TcpStream::connect_timeout(&to, Duration::from_millis(200)) {
                    Ok(s) => out.push(s),
                    Err(_) => failures += 1,
                }
            }
            out
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

/// GET `path` from the node namespace within `within`: the status line,
/// or why not.
fn get_within(
    c: &Conformance,
    port: u16,
    path: &'static str,
    within: Duration,
) -> Result<String, String> {
    let to = SocketAddr::from(([127, 0, 0, 1], port));
    c.node()
        .node
        .spawn(move || {
            let deadline = Instant::now() + within;
            let mut s =
                TcpStream::connect_timeout(&to, within).map_err(|e| format!("connect: {e}"))?;
            let left = deadline.saturating_duration_since(Instant::now());
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(|e| e.to_string())?;
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .map_err(|e| format!("send: {e}"))?;
            let mut out = String::new();
            s.read_to_string(&mut out)
                .map_err(|e| format!("no answer within {within:?}: {e}"))?;
            Ok(out.lines().next().unwrap_or("").to_owned())
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn idle_connections_neither_starve_the_probes_nor_stop_enforcement() {
    // This process holds the clients' ends.
    raise_own_nofile(2 * IDLE as u64);
    let mut c = Conformance::new("httpflood", Backend::Bpf);
    c.start_daemon(PORT);
    let pid = c.daemon.as_ref().unwrap().id();
    set_nofile(pid as libc::pid_t, AGENT_NOFILE);
    let before = open_fds(pid);

    let idle = idle_connections(&c, IDLE);
    let held = open_fds(pid);
    eprintln!(
        "{} idle connections opened; the daemon holds {held} descriptors ({before} before)",
        idle.len()
    );
    let health = get_within(&c, PORT, "/healthz", Duration::from_secs(1));
    assert!(
        health
            .as_deref()
            .is_ok_and(|l| l.starts_with("HTTP/1.1 200")),
        "/healthz with {} idle connections open: {health:?}; the daemon holds {} descriptors",
        idle.len(),
        open_fds(pid)
    );
    // 64 connections, and as many closed ones being let go at most.
    assert!(
        held <= before + 2 * 64,
        "the daemon holds {held} descriptors ({before} before the flood)"
    );

    // A policy change still lands: alpha isolated for ingress.
    c.write_policies(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: alpha}\nspec:\n  podSelector: {}\n  policyTypes: [Ingress]\n",
    );
    c.eventually("alpha isolated", Duration::from_secs(10), |f, t, _, _| {
        f == t || f == "(node)" || ns_of(t) != "alpha"
    });
    drop(idle);
}

#[test]
fn metrics_listen_serves_a_second_address_with_its_own_cap() {
    const METRICS: u16 = 19432;
    let mut c = Conformance::new("httpsecnd", Backend::Bpf);
    let dir = c.dir.to_str().unwrap().to_owned();
    let second = format!("127.0.0.1:{METRICS}");
    c.start_daemon_with(
        PORT + 2,
        &["--manifests", &dir, "--metrics-listen", &second],
        &[],
    );
    let metrics = c.http_get(METRICS, "/metrics");
    assert!(
        metrics.starts_with("HTTP/1.1 200") && metrics.contains("policy_agent_syncs_total"),
        "{metrics}"
    );
    // Filling the second address leaves the probes' one alone.
    let to = SocketAddr::from(([127, 0, 0, 1], METRICS));
    let idle = c
        .node()
        .node
        .spawn(move || {
            (0..200)
                .filter_map(|_| TcpStream::connect_timeout(&to, Duration::from_millis(200)).ok())
                .collect::<Vec<_>>()
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap();
    let health = get_within(&c, PORT + 2, "/healthz", Duration::from_secs(1));
    assert!(
        health
            .as_deref()
            .is_ok_and(|l| l.starts_with("HTTP/1.1 200")),
        "{health:?}"
    );
    let dropped = c.http_get(METRICS, "/metrics");
    assert!(
        dropped.contains("policy_agent_http_dropped_total{reason=\"evicted\"}"),
        "{} idle connections to the second address, none evicted:\n{dropped}",
        idle.len()
    );
}
