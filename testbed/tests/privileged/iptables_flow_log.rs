//! Flow records on the iptables fallback, on a simulated node: the record
//! rules log each new flow's verdict to NFLOG, the reader makes them
//! `FlowRecord`s, and the names file names them. One allowed and one
//! denied TCP connection give one record each, with the rule (or the
//! isolating policy) that decided; the allowed flow's later packets give
//! none. Everything the test makes goes with the `Conformance` fixture
//! (its namespaces, the agent's chains and sets by `reset`, the names file
//! in its directory), on failure too.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

use policy_agent::{
    datapath::{
        Datapath, Desired,
        iptables::{
            self, FlowLogOptions, IptablesDriver,
            flow_log::{Error, IptablesFlowReader, IptablesNames, limited_records, read_names},
        },
    },
    identity::IdentityAllocator,
    mapstate::{identity_name_str, rule_name_text},
    netlink,
    policy::{CompileOptions, Compiler},
    source::manifests::load_dir,
};
use policy_common::{
    direction,
    event::{FlowRecord, RECORD_NEW_FLOW},
    family, proto,
    rule_name::{RuleKey, kind},
    verdict::Reason,
};
use policy_testbed::{
    Outcome, connect, echo,
    fixtures::conformance::{Backend, Conformance, NODE},
};

/// Not the default group: a record reader on the host binds that one in
/// its own namespace, never here, but a distinct number says which is
/// which in a listing.
const GROUP: u16 = 10419;

const ALLOW_WEB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: allow-web, namespace: alpha}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  policyTypes: [Ingress]\n  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}], ports: [{port: 80, protocol: TCP}]}]\n";

/// Enforces the manifests with records on (`opts`, names to `names`) in
/// the node's namespace and binds the group there: the reader, and the
/// error of a second reader of the same group.
fn enforce_with_records(
    c: &Conformance,
    opts: FlowLogOptions,
    names: PathBuf,
) -> (IptablesFlowReader, Error) {
    let dir = c.dir.clone();
    c.node()
        .node
        .spawn(move || {
            let mut loaded = load_dir(&dir);
            assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
            let state = loaded.cluster_state(NODE, netlink::local_addresses().unwrap());
            let compiler = Compiler::build(
                &state,
                &mut IdentityAllocator::new(),
                CompileOptions::default(),
            );
            let rules = compiler.rules();
            let desired = Desired {
                maps: compiler.maps(),
                local_pods: compiler.local_pods(),
                rules: &rules,
                pod_ranges: compiler.pod_ranges(),
                staged: None,
            };
            let mut driver = IptablesDriver::open(iptables::Backend::Auto).unwrap();
            driver.flow_log = Some(opts);
            driver.names_file = Some(names);
            let report = driver.sync(&desired, &[]).unwrap();
            assert!(report.problems.is_empty(), "{:?}", report.problems);
            let reader = IptablesFlowReader::open(opts.group).unwrap();
            let Err(second) = IptablesFlowReader::open(opts.group) else {
                panic!("a second reader bound group {}", opts.group);
            };
            (reader, second)
        })
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

fn addr(r: &FlowRecord, src: bool) -> IpAddr {
    let bytes = if src { &r.src } else { &r.dst };
    if r.family == family::IPV4 {
        IpAddr::from([bytes[0], bytes[1], bytes[2], bytes[3]])
    } else {
        IpAddr::from(*bytes)
    }
}

/// The flow's 4-tuple (client address and port, server address and port).
fn tuple(r: &FlowRecord) -> (SocketAddr, SocketAddr) {
    (
        SocketAddr::new(addr(r, true), r.sport),
        SocketAddr::new(addr(r, false), r.dport),
    )
}

/// Records until `done` holds of what came, or `within` passes.
fn collect(
    reader: &mut IptablesFlowReader,
    within: Duration,
    done: impl Fn(&[FlowRecord]) -> bool,
) -> Vec<FlowRecord> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while Instant::now() < deadline && !done(&got) {
        got.extend(reader.next_batch(Duration::from_millis(200)));
    }
    got
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The pod `names` puts on the record's interface.
fn pod_of<'a>(names: &'a IptablesNames, r: &FlowRecord) -> &'a str {
    names
        .pods
        .get(&r.ifindex)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("no pod on ifindex {} in {:?}", r.ifindex, names.pods))
}

#[test]
fn iptables_records_name_the_rule_that_decided_each_new_flow() {
    let c = Conformance::new("iflog", Backend::Iptables);
    c.write_policies(ALLOW_WEB);
    let names_path = c.dir.join("iptables-names.json");
    let opts = FlowLogOptions {
        group: GROUP,
        ..FlowLogOptions::default()
    };
    let (mut reader, second) = enforce_with_records(&c, opts, names_path.clone());
    assert!(
        matches!(second, Error::GroupTaken { group: GROUP }),
        "{second}"
    );
    assert!(second.to_string().contains("already bound"), "{second}");

    let node = c.node();
    let web = &node.pod("alpha/web").unwrap().netns;
    let api = &node.pod("alpha/api").unwrap().netns;
    let db = SocketAddr::new(c.pod_ip("alpha/db", false), 80);
    let db6 = SocketAddr::new(c.pod_ip("alpha/db", true), 80);
    let started = monotonic_ns();

    // Allowed, in both families; then denied.
    let mut flows = Vec::new();
    for to in [db, db6] {
        let mut flow = connect(web, to, Duration::from_secs(2)).unwrap();
        assert_eq!(
            echo(&mut flow, b"one", Duration::from_secs(1)),
            Outcome::Open
        );
        flows.push(flow);
    }
    let opened: Vec<(SocketAddr, SocketAddr)> = flows
        .iter()
        .map(|f| (f.local_addr().unwrap(), f.peer_addr().unwrap()))
        .collect();
    assert!(
        connect(api, db, Duration::from_millis(500)).is_err(),
        "alpha/api reaches alpha/db"
    );
    let api_ip = c.pod_ip("alpha/api", false);

    let got = collect(&mut reader, Duration::from_secs(5), |got| {
        opened.iter().all(|t| got.iter().any(|r| tuple(r) == *t))
            && got.iter().any(|r| addr(r, true) == api_ip)
    });
    let names = read_names(&names_path).unwrap();
    assert_eq!(names.group, Some(GROUP));

    for (i, t) in opened.iter().enumerate() {
        let mine: Vec<&FlowRecord> = got.iter().filter(|r| tuple(r) == *t).collect();
        assert_eq!(mine.len(), 1, "one record for {t:?}: {got:?}");
        let r = mine[0];
        assert_eq!(r.reason, Reason::AllowPolicy as u8, "{r:?}");
        assert_eq!(r.direction, direction::INGRESS);
        assert_eq!(r.protocol, proto::TCP);
        assert_eq!(r.family, if i == 0 { family::IPV4 } else { family::IPV6 });
        assert_eq!(r.flags, RECORD_NEW_FLOW);
        assert_eq!(pod_of(&names, r), "alpha/db");
        assert!(
            names.pod_addresses[&r.ifindex].contains(&t.1.ip()),
            "{:?}",
            names.pod_addresses
        );
        // Stamped by the kernel at FORWARD, in CLOCK_MONOTONIC.
        assert!(
            r.timestamp_ns + 1_000_000_000 >= started && r.timestamp_ns <= monotonic_ns(),
            "timestamp {} not within the test ({started}..)",
            r.timestamp_ns
        );
        let key = RuleKey::new(
            kind::NETWORK_POLICY,
            direction::INGRESS,
            r.rule.network_policy,
        );
        let rule = rule_name_text(names.rules.get(&key).expect("the allowing rule is named"));
        assert_eq!(
            (rule.namespace.as_str(), rule.policy.as_str()),
            ("alpha", "allow-web")
        );
        assert!(r.rule.admin.is_none() && r.rule.baseline.is_none());
    }

    let denied: Vec<&FlowRecord> = got.iter().filter(|r| addr(r, true) == api_ip).collect();
    assert!(!denied.is_empty(), "no record of the denied flow: {got:?}");
    for r in &denied {
        // A retransmitted SYN is another dropped packet, another record.
        assert_eq!(r.reason, Reason::DropPolicy as u8, "{r:?}");
        assert_eq!(r.direction, direction::INGRESS);
        assert_eq!(tuple(r).1, db);
        assert_eq!(pod_of(&names, r), "alpha/db");
        assert_eq!(r.rule.network_policy, 0);
        let isolating = RuleKey::isolating(direction::INGRESS, r.endpoint_identity, 0);
        let policy = rule_name_text(names.rules.get(&isolating).expect("isolated by a policy"));
        assert_eq!(policy.qualified(), "alpha/allow-web");
        let identity = identity_name_str(&names.identities[&r.endpoint_identity]);
        assert!(identity.contains("app=db"), "{identity}");
    }
    assert_eq!(
        got.iter()
            .filter(|r| r.reason == Reason::AllowPolicy as u8)
            .count(),
        opened.len(),
        "only the two allowed flows: {got:?}"
    );

    // Established: the allowed flows go on, and nothing more is logged.
    for flow in &mut flows {
        for _ in 0..5 {
            assert_eq!(echo(flow, b"more", Duration::from_secs(1)), Outcome::Open);
        }
    }
    let later = collect(&mut reader, Duration::from_millis(1500), |_| false);
    let again: Vec<&FlowRecord> = later
        .iter()
        .filter(|r| opened.contains(&tuple(r)))
        .collect();
    assert!(
        again.is_empty(),
        "established packets were logged: {again:?}"
    );
    assert_eq!(reader.stats().lost, 0, "{:?}", reader.stats());
    assert_eq!(limited(&c), 0);

    // reset takes the record chains with the rest.
    drop(reader);
    c.reset();
    for tool in ["iptables-save", "ip6tables-save"] {
        let saved = c.node().node.exec(tool, &["-t", "filter"]).unwrap();
        assert!(!saved.contains("pa-agent:"), "{tool} after reset:\n{saved}");
    }
}

/// What the budget held back on the node so far.
fn limited(c: &Conformance) -> u64 {
    c.node()
        .node
        .spawn(|| limited_records(iptables::Backend::Auto).unwrap())
        .unwrap()
        .join()
        .unwrap()
        .unwrap()
}

/// Past the budget a flow is judged as before, only not logged: every
/// allowed connection still opens and a denied one stays shut; what was
/// not logged is counted, exactly.
#[test]
fn iptables_records_past_the_budget_keep_their_verdict_and_are_counted() {
    const FLOWS: usize = 8;
    let c = Conformance::new("iflogb", Backend::Iptables);
    c.write_policies(ALLOW_WEB);
    let opts = FlowLogOptions {
        group: GROUP,
        per_second: 1,
        burst: 2,
    };
    let (mut reader, _) = enforce_with_records(&c, opts, c.dir.join("names.json"));
    let node = c.node();
    let web = &node.pod("alpha/web").unwrap().netns;
    let api = &node.pod("alpha/api").unwrap().netns;
    let db = SocketAddr::new(c.pod_ip("alpha/db", false), 80);
    let started = Instant::now();
    let mut opened = Vec::new();
    for _ in 0..FLOWS {
        let mut flow = connect(web, db, Duration::from_secs(2)).unwrap();
        assert_eq!(
            echo(&mut flow, b"one", Duration::from_secs(1)),
            Outcome::Open
        );
        opened.push((flow.local_addr().unwrap(), flow.peer_addr().unwrap()));
    }
    let elapsed = started.elapsed();
    let got = collect(&mut reader, Duration::from_millis(1500), |_| false);
    let logged = got.iter().filter(|r| opened.contains(&tuple(r))).count();
    let held = limited(&c);
    assert_eq!(
        logged as u64 + held,
        FLOWS as u64,
        "every new flow is logged or counted ({logged} logged, {held} held back)"
    );
    // The burst, and one a second after it.
    let most = 2 + elapsed.as_secs() as usize + 1;
    assert!(
        logged >= 1 && logged <= most,
        "{logged} logged in {elapsed:?}"
    );

    // The budget spent again (a few allowed flows at once): a denied SYN
    // past it is still dropped, and counted, not logged.
    for _ in 0..4 {
        let mut flow = connect(web, db, Duration::from_secs(2)).unwrap();
        assert_eq!(
            echo(&mut flow, b"two", Duration::from_secs(1)),
            Outcome::Open
        );
    }
    let before = limited(&c);
    // Shorter than the first retransmission: one SYN.
    assert!(
        connect(api, db, Duration::from_millis(300)).is_err(),
        "alpha/api reaches alpha/db past the budget"
    );
    assert_eq!(limited(&c), before + 1, "the denied SYN is counted");
    let api_ip = c.pod_ip("alpha/api", false);
    let got = collect(&mut reader, Duration::from_millis(500), |_| false);
    assert!(
        got.iter().all(|r| addr(r, true) != api_ip),
        "logged past the budget: {got:?}"
    );
}
