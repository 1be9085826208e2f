//! The CNI hand-off with the real agent: `policy-agent run --cni-socket`
//! on a simulated node whose pods are made as a runtime makes them
//! (`sim::cni`: Debian's ptp + host-local, then our plugin), in manifests
//! mode and against the fake API server. Judged at the receiver: a
//! capture in the pod's namespace, opened before its ADD. Needs root and
//! containernetworking-plugins; run under the kernel-test lock.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use aya::programs::LinkOrder;
use policy_agent::datapath::bpf::{
    attach::NETLINK_PRIORITY,
    loader::endpoint_meta_name,
    maps::BpfMaps,
    pins::{Hook, PinLayout},
};
use policy_cni::protocol::code;
use policy_common::endpoint::{ATTACH_NETLINK, ATTACH_POD, ATTACH_STANDBY, ATTACH_TCX};
use policy_testbed::cni_runtime::{CniError, CniRuntime, Sandbox};
use policy_testbed::fixtures::cni::{
    agent::{AgentNode, POD_CIDR, ipv4, namespace, pod, policy, status},
    traffic::{Flood, Receiver, connect, send_udp},
};
use policy_testbed::fixtures::{
    fake_apiserver::FakeApi,
    services::{eventually, http_get_at},
    tcx,
};
use serde_json::{Value, json};

/// The victim's listeners.
const PORT: u16 = 19600;
/// Where a pod under deny-all egress tries to send.
const EGRESS_PORT: u16 = 19601;
/// How long traffic keeps coming after ADD returned.
const AFTER_ADD: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Manifests,
    Cluster,
}

/// The agent's node and, in cluster mode, the API server it watches.
struct World {
    node: AgentNode,
    api: Option<FakeApi>,
    objects: Vec<Value>,
}

impl World {
    /// `objects` are in the source before the agent starts.
    fn new(prefix: &'static str, mode: Mode, objects: Vec<Value>, extra: &[&str]) -> Self {
        let mut node = AgentNode::new(prefix);
        node.extra = extra.iter().map(|s| (*s).to_owned()).collect();
        let api = match mode {
            Mode::Manifests => {
                node.write(&objects);
                None
            }
            Mode::Cluster => {
                let api = FakeApi::start(&node.fx.node.node, objects.clone());
                let kubeconfig = node.fx.dir.path().join("kubeconfig");
                api.kubeconfig(&kubeconfig);
                node.env
                    .push(("KUBECONFIG".into(), kubeconfig.to_str().unwrap().to_owned()));
                Some(api)
            }
        };
        node.start();
        Self { node, api, objects }
    }

    /// A new object in the source (the file rewritten, or applied).
    fn add_object(&mut self, obj: Value) {
        self.objects.push(obj.clone());
        match &self.api {
            Some(api) => {
                api.apply(obj);
            }
            None => self.node.write(&self.objects),
        }
    }

    /// A pod made through the whole chain, then published as the kubelet
    /// does once the sandbox is up (status.podIPs, Running); its IPv4
    /// address.
    fn pod(&mut self, rt: &CniRuntime, name: &str) -> (Sandbox, Ipv4Addr) {
        let mut sb = self.node.sandbox(rt, name);
        let result = rt
            .add(&mut sb)
            .unwrap_or_else(|e| panic!("ADD {name}: {e}"));
        let ip = ipv4(&result);
        let obj = self
            .objects
            .iter_mut()
            .find(|o| o["kind"] == "Pod" && o["metadata"]["name"] == name)
            .unwrap();
        obj["status"] = json!({"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]});
        let obj = obj.clone();
        match &self.api {
            Some(api) => {
                api.apply(obj);
            }
            None => self.node.write(&self.objects),
        }
        (sb, ip)
    }
}

/// friend (allowed into the victim), foe (not), and the victim's policy:
/// `app=victim` isolated for ingress, only `role=friend` let in.
fn friend_foe_victim() -> Vec<Value> {
    vec![
        namespace(),
        pod("friend", &[("role", "friend")]),
        pod("foe", &[("role", "foe")]),
        pod("victim", &[("app", "victim")]),
        policy(
            "victim-from-friends",
            "victim",
            &["Ingress"],
            json!([{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}]}]),
        ),
    ]
}

/// Right after the victim's ADD returned: the foe floods it (nothing
/// arrives) and the friend connects (it arrives, and is accepted).
fn assert_enforced_now(
    victim: &Sandbox,
    victim_ip: Ipv4Addr,
    rx: &Receiver,
    friend: &(Sandbox, Ipv4Addr),
    foe: &(Sandbox, Ipv4Addr),
) {
    let to = SocketAddrV4::new(victim_ip, PORT);
    let flood = Flood::start(&foe.0.netns, vec![to], AFTER_ADD);
    let reached = connect(&friend.0.netns, to, Duration::from_secs(3));
    std::thread::sleep(AFTER_ADD);
    let sent = flood.stop();
    assert!(sent > 0, "the foe sent nothing");
    let from_foe = rx.from(foe.1);
    assert!(
        from_foe.is_empty(),
        "{} packet(s) from the foe reached {} ({victim_ip}) after its ADD returned (of {sent} sent); first: {:?}",
        from_foe.len(),
        victim.container_id,
        from_foe.first()
    );
    assert!(
        reached && !rx.from(friend.1).is_empty() && rx.accepted() >= 1,
        "the friend must get through (the pod is up and only the foe is denied)"
    );
}

/// The friend and the foe up (pod and address), the victim's sandbox
/// made but not added, a receiver listening in it.
struct Cast {
    rt: CniRuntime,
    friend: (Sandbox, Ipv4Addr),
    foe: (Sandbox, Ipv4Addr),
    victim: Sandbox,
    rx: Receiver,
}

impl Cast {
    /// On a runtime whose plugin waits `timeout` seconds for the agent.
    fn new(w: &mut World, timeout: f64) -> Self {
        let rt = w.node.runtime(timeout);
        let friend = w.pod(&rt, "friend");
        let foe = w.pod(&rt, "foe");
        let victim = w.node.sandbox(&rt, "victim");
        let rx = Receiver::start(&victim.netns, PORT);
        Self {
            rt,
            friend,
            foe,
            victim,
            rx,
        }
    }

    /// [`assert_enforced_now`] for the victim, added at `victim_ip`.
    fn assert_enforced_now(&self, victim_ip: Ipv4Addr) {
        assert_enforced_now(&self.victim, victim_ip, &self.rx, &self.friend, &self.foe);
    }

    /// DELs the victim, the foe and the friend.
    fn del_all(self) {
        del_all(&self.rt, [self.victim, self.foe.0, self.friend.0]);
    }
}

fn enforced_once_add_returns(prefix: &'static str, mode: Mode) {
    let mut w = World::new(prefix, mode, friend_foe_victim(), &[]);
    let mut c = Cast::new(&mut w, 10.0);
    let result =
        c.rt.add(&mut c.victim)
            .unwrap_or_else(|e| panic!("ADD victim: {e}"));
    c.assert_enforced_now(ipv4(&result));
    c.del_all();
    assert!(w.node.fx.reserved().is_empty(), "every address released");
}

/// ADD returns only once the pod is enforced: the first packets a peer
/// sends after it returned are judged (manifests mode).
#[test]
fn add_returns_once_the_pod_is_enforced_manifests() {
    enforced_once_add_returns("cnia1m", Mode::Manifests);
}

/// The same in cluster mode (the pod object in the API before ADD).
#[test]
fn add_returns_once_the_pod_is_enforced_cluster() {
    enforced_once_add_returns("cnia1c", Mode::Cluster);
}

fn cni_code(r: &Result<Value, CniError>) -> Option<u64> {
    r.as_ref().err().and_then(CniError::code)
}

/// Agent down: no socket, then a stale socket of a killed agent. ADD
/// fails with "try again later" (the kubelet retries); the runtime's DEL
/// succeeds; once the agent is back the retried ADD succeeds enforced.
#[test]
fn add_fails_while_the_agent_is_down_and_succeeds_enforced_once_it_is_back() {
    let mut w = World::new("cnidown", Mode::Manifests, friend_foe_victim(), &[]);
    let mut c = Cast::new(&mut w, 2.0);
    w.node.kill();
    for (what, stale) in [("stale socket", true), ("no socket", false)] {
        if !stale {
            std::fs::remove_file(w.node.fx.socket()).unwrap();
        }
        let r = c.rt.add(&mut c.victim);
        assert_eq!(
            cni_code(&r),
            Some(u64::from(code::TRY_AGAIN)),
            "{what}: {r:?}"
        );
        c.rt.del(&mut c.victim)
            .unwrap_or_else(|e| panic!("{what}: DEL after a failed ADD: {e}"));
    }
    w.node.start();
    let result =
        c.rt.add(&mut c.victim)
            .unwrap_or_else(|e| panic!("ADD with the agent back: {e}"));
    c.assert_enforced_now(ipv4(&result));
}

/// Agent slow: the pod object is not there yet, so the agent cannot
/// enforce it; the plugin's timeout (2 s) runs out first and ADD fails.
/// The object arrives (the agent would confirm now, nobody is waiting);
/// the retried ADD succeeds, enforced.
#[test]
fn add_fails_when_the_agent_confirms_after_the_timeout() {
    let mut objects = friend_foe_victim();
    let victim_obj = objects.remove(3);
    let mut w = World::new("cnislow", Mode::Manifests, objects, &[]);
    let mut c = Cast::new(&mut w, 2.0);
    let r = c.rt.add(&mut c.victim);
    assert_eq!(cni_code(&r), Some(u64::from(code::TRY_AGAIN)), "{r:?}");
    c.rt.del(&mut c.victim).unwrap();
    w.add_object(victim_obj);
    let result =
        c.rt.add(&mut c.victim)
            .unwrap_or_else(|e| panic!("retried ADD: {e}"));
    c.assert_enforced_now(ipv4(&result));
}

/// Agent restarting during ADD: the ADD is waiting (pod object not there
/// yet) when the agent is killed and started again with it. The ADD fails
/// (its connection died with the agent) or succeeds only enforced; a
/// failed one, retried, succeeds enforced.
#[test]
fn an_agent_restart_during_add_never_lets_the_pod_start_unenforced() {
    let mut objects = friend_foe_victim();
    let victim_obj = objects.remove(3);
    let mut w = World::new("cnirst", Mode::Manifests, objects, &[]);
    let mut c = Cast::new(&mut w, 15.0);
    let first = std::thread::scope(|s| {
        let add = s.spawn(|| c.rt.add(&mut c.victim));
        std::thread::sleep(Duration::from_secs(1));
        w.node.kill();
        w.add_object(victim_obj);
        w.node.start();
        add.join().unwrap()
    });
    let result = match first {
        Ok(result) => result,
        Err(e) => {
            assert_eq!(e.code(), Some(u64::from(code::TRY_AGAIN)), "{e}");
            c.rt.del(&mut c.victim).unwrap();
            c.rt.add(&mut c.victim)
                .unwrap_or_else(|e| panic!("retried ADD: {e}"))
        }
    };
    c.assert_enforced_now(ipv4(&result));
}

/// DEL of a sandbox the agent never saw (and a second DEL of one it did)
/// succeeds; the agent keeps answering.
#[test]
fn del_of_an_unknown_pod_succeeds() {
    let mut w = World::new("cnidel", Mode::Manifests, friend_foe_victim(), &[]);
    let rt = w.node.runtime(5.0);
    let mut never = w.node.sandbox(&rt, "ghost");
    rt.del(&mut never).unwrap();
    let (mut friend, _) = w.pod(&rt, "friend");
    rt.del(&mut friend).unwrap();
    rt.del(&mut friend).unwrap();
    assert!(status(&w.node.fx.socket()).is_some_and(|r| r.ok));
}

/// foe and receiver (neither isolated), victim (deny-all ingress) and
/// leaker (deny-all egress).
fn first_packet_objects() -> Vec<Value> {
    vec![
        namespace(),
        pod("foe", &[("role", "foe")]),
        pod("receiver", &[("role", "receiver")]),
        policy("victim-deny-all", "victim", &["Ingress"], Value::Null),
        policy("leaker-deny-all", "leaker", &["Egress"], Value::Null),
        pod("victim", &[("app", "victim")]),
        pod("leaker", &[("app", "leaker")]),
    ]
}

/// The first-packet test. The foe floods the victim's address (the next
/// host-local hands out) from before the victim's ADD starts until a
/// while after it returned; the victim's capture, open before ADD, sees
/// not one packet from it. Then the leaker, under deny-all egress, floods
/// the receiver from inside its namespace from before its ADD: the
/// receiver's capture sees not one packet from it (the foe's datagrams to
/// the same port do arrive: the capture works). `late`: the pod objects
/// reach the API only after ADD started (cluster mode).
fn first_packet(prefix: &'static str, mode: Mode, late: bool) {
    let mut objects = first_packet_objects();
    let pending: Vec<Value> = if late {
        objects.split_off(5)
    } else {
        Vec::new()
    };
    let mut w = World::new(prefix, mode, objects, &["--pod-cidr", POD_CIDR]);
    let rt = w.node.runtime(10.0);
    let (foe, foe_ip) = w.pod(&rt, "foe");
    let (receiver, receiver_ip) = w.pod(&rt, "receiver");
    // host-local hands out addresses in order from the first free one.
    let next = |ip: Ipv4Addr| Ipv4Addr::from(u32::from(ip) + 1);
    let (victim_ip, leaker_ip) = (next(receiver_ip), next(next(receiver_ip)));

    let mut victim = w.node.sandbox(&rt, "victim");
    let rx = Receiver::start(&victim.netns, PORT);
    let flood = Flood::start(
        &foe.netns,
        vec![SocketAddrV4::new(victim_ip, PORT)],
        Duration::from_secs(60),
    );
    std::thread::sleep(Duration::from_millis(200));
    let mut pending = pending.into_iter();
    let result = std::thread::scope(|s| {
        let add = s.spawn(|| rt.add(&mut victim));
        if late {
            std::thread::sleep(Duration::from_millis(500));
            w.add_object(pending.next().unwrap());
        }
        add.join().unwrap()
    })
    .unwrap_or_else(|e| panic!("ADD victim: {e}"));
    let added = std::time::Instant::now();
    assert_eq!(
        ipv4(&result),
        victim_ip,
        "the flood aimed at the victim's address"
    );
    std::thread::sleep(AFTER_ADD);
    let sent = flood.stop();
    let leaked = rx.from(foe_ip);
    assert!(sent > 0);
    let after = leaked.iter().filter(|p| p.at > added).count();
    assert!(
        leaked.is_empty(),
        "{} of {sent} packets from the foe reached the victim (deny-all ingress): {} before its ADD returned, {after} after",
        leaked.len(),
        leaked.len() - after,
    );

    let rx = Receiver::start(&receiver.netns, EGRESS_PORT);
    let mut leaker = w.node.sandbox(&rt, "leaker");
    let flood = Flood::start(
        &leaker.netns,
        vec![SocketAddrV4::new(receiver_ip, EGRESS_PORT)],
        Duration::from_secs(60),
    );
    let result = std::thread::scope(|s| {
        let add = s.spawn(|| rt.add(&mut leaker));
        if late {
            std::thread::sleep(Duration::from_millis(500));
            w.add_object(pending.next().unwrap());
        }
        add.join().unwrap()
    })
    .unwrap_or_else(|e| panic!("ADD leaker: {e}"));
    let added = std::time::Instant::now();
    assert_eq!(ipv4(&result), leaker_ip);
    std::thread::sleep(AFTER_ADD);
    let sent = flood.stop();
    send_udp(&foe.netns, SocketAddrV4::new(receiver_ip, EGRESS_PORT), 5);
    let arrived = rx.to_port(EGRESS_PORT);
    assert!(
        arrived.iter().any(|p| p.src == foe_ip),
        "the control datagrams from the foe must arrive"
    );
    let out: Vec<_> = arrived.iter().filter(|p| p.src == leaker_ip).collect();
    let after = out.iter().filter(|p| p.at > added).count();
    assert!(
        out.is_empty(),
        "{} packet(s) of the {sent} the leaker sent under deny-all egress reached the receiver: {} before its ADD returned, {after} after",
        out.len(),
        out.len() - after,
    );
    for mut sb in [leaker, victim, receiver, foe] {
        rt.del(&mut sb).unwrap();
    }
}

#[test]
fn first_packet_manifests() {
    first_packet("cnifpm", Mode::Manifests, false);
}

#[test]
fn first_packet_cluster() {
    first_packet("cnifpc", Mode::Cluster, false);
}

#[test]
fn first_packet_cluster_pod_object_after_add_started() {
    first_packet("cnifpl", Mode::Cluster, true);
}

/// The ifindex of `name` in the node.
fn ifindex(w: &World, name: &str) -> u32 {
    let out = w
        .node
        .fx
        .node
        .node
        .ip(&["-o", "link", "show", name])
        .unwrap();
    out.split(':').next().unwrap().trim().parse().unwrap()
}

/// Whether both pod classifiers of `ifindex` (`name`) are attached — TCX
/// links pinned, or (no TCX, the 6.1 guest) our netlink filters in place
/// — and its record.
fn pod_hooks(w: &World, ifindex: u32, name: &str) -> (bool, Option<(u32, String)>) {
    let layout = PinLayout::new(&w.node.pin);
    let meta = BpfMaps::from_pins(&layout)
        .unwrap()
        .meta(ifindex)
        .map(|m| (m.attach, endpoint_meta_name(&m)));
    let bits = meta.as_ref().map_or(0, |m| m.0);
    let attached = if bits & ATTACH_NETLINK != 0 {
        ["ingress", "egress"].iter().all(|side| {
            w.node
                .fx
                .node
                .node
                .exec("tc", &["filter", "show", "dev", name, side])
                .is_ok_and(|out| out.contains(&format!("pref {NETLINK_PRIORITY} ")))
        })
    } else {
        Hook::BOTH.iter().all(|h| layout.link(ifindex, *h).exists())
    };
    (attached, meta)
}

/// A veth that appears while the agent runs carries the pod classifiers
/// at once (standby: no pod holds it yet, so they pass everything on to
/// the uplink classifiers), a veth that goes before any pod claims it
/// leaves nothing behind, and a pod's ADD finds its veth prepared and
/// makes it the pod's. Netlink filters, the default.
#[test]
fn a_new_veth_is_prepared_before_its_add_and_cleaned_up_when_it_goes() {
    standby("cnisb", &[]);
}

/// The same through TCX links (`--attach tcx`; netlink below Linux 6.6).
#[test]
fn a_new_veth_is_prepared_before_its_add_and_cleaned_up_when_it_goes_tcx() {
    standby("cnisn", &["--attach", "tcx"]);
}

fn standby(prefix: &'static str, extra: &[&str]) {
    let mut w = World::new(prefix, Mode::Manifests, friend_foe_victim(), extra);
    let node = |args: &[&str]| w.node.fx.node.node.ip(args).unwrap();
    node(&[
        "link", "add", "sbx0", "type", "veth", "peer", "name", "sbx1",
    ]);
    let bare = ifindex(&w, "sbx0");
    eventually(
        "standby on a bare veth",
        Duration::from_secs(10),
        || match pod_hooks(&w, bare, "sbx0") {
            (true, Some((bits, name)))
                if bits & (ATTACH_POD | ATTACH_STANDBY) == ATTACH_POD | ATTACH_STANDBY =>
            {
                assert_eq!(name, "standby sbx0");
                Ok(())
            }
            other => Err(format!("{other:?}")),
        },
    );
    node(&["link", "del", "sbx0"]);
    eventually(
        "the bare veth's pins gone",
        Duration::from_secs(10),
        || match pod_hooks(&w, bare, "sbx0") {
            (false, None) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );

    let rt = w.node.runtime(10.0);
    let (mut victim, _) = w.pod(&rt, "victim");
    let host = host_if(victim.result.as_ref().unwrap());
    let (attached, meta) = pod_hooks(&w, ifindex(&w, &host), &host);
    let (bits, name) = meta.expect("the victim's veth has a record");
    assert!(attached, "both pod classifiers attached");
    assert_eq!(
        bits & (ATTACH_POD | ATTACH_STANDBY),
        ATTACH_POD,
        "the pod's now ({bits:#x})"
    );
    assert!(name.ends_with("/victim"), "recorded as the pod: {name}");
    rt.del(&mut victim).unwrap();
}

/// A foreign TCX program already on a new pod's veth when our ADD comes
/// (kernels with TCX): the kernel runs it before the default netlink
/// filters, and this one passes everything. The order check right after
/// the hand-off's attach moves the veth to TCX links, first in the chain,
/// before ADD returns: the foe reaches nothing, the friend gets through,
/// with the foreign program still attached.
#[test]
fn a_foreign_tcx_program_on_a_new_veth_is_overtaken_before_add_returns() {
    if !tcx::kernel_has_tcx() {
        eprintln!("no TCX on this kernel: no TCX program can run ahead");
        return;
    }
    let mut w = World::new("cniftx", Mode::Manifests, friend_foe_victim(), &[]);
    let mut c = Cast::new(&mut w, 10.0);
    let rt = &c.rt;
    // The chain as a runtime runs it, but stopping before our plugin.
    let list = rt.list().clone();
    let plugins = list["plugins"].as_array().unwrap().clone();
    let (ours, main) = plugins.split_last().unwrap();
    assert_eq!(ours["type"], "policy-cni");
    let mut prev: Option<Value> = None;
    for plugin in main {
        let inv = rt
            .invoke("ADD", &c.victim, &rt.derive(&list, plugin, prev.as_ref()))
            .unwrap();
        assert_eq!(inv.status, Some(0), "{}: {}", inv.plugin, inv.stderr);
        prev = Some(serde_json::from_str(inv.stdout.trim()).unwrap());
    }
    let host = host_if(prev.as_ref().unwrap());
    let foreign = tcx::Foreign::attach(
        &w.node.fx.node.node,
        "foreign_pass",
        vec![host.clone()],
        LinkOrder::first,
    );
    let inv = rt
        .invoke("ADD", &c.victim, &rt.derive(&list, ours, prev.as_ref()))
        .unwrap();
    assert_eq!(inv.status, Some(0), "ours: {} {}", inv.stdout, inv.stderr);
    let result: Value = serde_json::from_str(inv.stdout.trim()).unwrap();
    c.victim.result = Some(result.clone());
    let victim_ip = ipv4(&result);
    on_tcx_links(&w, ifindex(&w, &host), &host).unwrap();
    c.assert_enforced_now(victim_ip);
    drop(foreign);
    c.del_all();
}

/// A foreign TCX program attached to a *running* pod's veth, first in
/// the chain, passing everything: the kernel runs it before the netlink
/// filters. The agent's periodic order check sees the change and its full
/// pass moves the veth to TCX links, ahead of it: the foe reaches nothing
/// again, the friend gets through, the foreign program still attached.
#[test]
fn a_foreign_tcx_program_on_a_running_pod_is_overtaken_by_the_order_check() {
    if !tcx::kernel_has_tcx() {
        eprintln!("no TCX on this kernel: no TCX program can run ahead");
        return;
    }
    let extra = ["--order-check-ms", "200"];
    let mut w = World::new("cnirtx", Mode::Manifests, friend_foe_victim(), &extra);
    let rt = w.node.runtime(10.0);
    let friend = w.pod(&rt, "friend");
    let foe = w.pod(&rt, "foe");
    let (victim, victim_ip) = w.pod(&rt, "victim");
    let rx = Receiver::start(&victim.netns, PORT);
    let host = host_if(victim.result.as_ref().unwrap());
    let veth = ifindex(&w, &host);
    let (_, meta) = pod_hooks(&w, veth, &host);
    let (bits, _) = meta.expect("the victim's veth has a record");
    assert!(
        bits & ATTACH_NETLINK != 0,
        "netlink filters first ({bits:#x})"
    );
    // The checks that find nothing new run no sync: once the victim's
    // publication is synced, a whole second (five checks) passes quietly.
    eventually("a second without syncs", Duration::from_secs(5), || {
        let before = syncs(&w);
        std::thread::sleep(Duration::from_secs(1));
        match syncs(&w) - before {
            0 => Ok(()),
            n => Err(format!("{n} sync(s)")),
        }
    });
    let foreign = tcx::Foreign::attach(
        &w.node.fx.node.node,
        "foreign_pass",
        vec![host.clone()],
        LinkOrder::first,
    );
    eventually(
        "the veth moved to TCX links",
        Duration::from_secs(10),
        || on_tcx_links(&w, veth, &host),
    );
    assert_enforced_now(&victim, victim_ip, &rx, &friend, &foe);
    drop(foreign);
    del_all(&rt, [victim, foe.0, friend.0]);
}

/// The host-side interface a CNI result names.
fn host_if(result: &Value) -> String {
    result["interfaces"][0]["name"].as_str().unwrap().to_owned()
}

/// Ok once `host` carries both pod classifiers on TCX links only (moved
/// off the netlink filters).
fn on_tcx_links(w: &World, ifindex: u32, host: &str) -> Result<(), String> {
    match pod_hooks(w, ifindex, host) {
        (true, Some((bits, _))) if bits & ATTACH_TCX != 0 && bits & ATTACH_NETLINK == 0 => Ok(()),
        other => Err(format!("not moved to TCX links: {other:?}")),
    }
}

/// DELs every sandbox, as a runtime tearing pods down.
fn del_all(rt: &CniRuntime, sandboxes: impl IntoIterator<Item = Sandbox>) {
    for mut sb in sandboxes {
        rt.del(&mut sb).unwrap();
    }
}

/// The agent's count of successful syncs (its /metrics).
fn syncs(w: &World) -> u64 {
    let text = http_get_at(&w.node.fx.node.node, 19999, "/metrics");
    metric(&text, "policy_agent_syncs_total{result=\"ok\"}") as u64
}

/// A datapath problem stands until something fixes it: a local pod whose
/// address no interface of the node routes to is reported, and still
/// reported after an unrelated policy change (an incremental sync that
/// does not look at that pod again), until the pod goes.
#[test]
fn a_problem_stands_until_fixed_not_until_the_next_sync() {
    let mut ghost = pod("ghost", &[("app", "ghost")]);
    ghost["status"] =
        json!({"phase": "Running", "podIP": "10.99.0.5", "podIPs": [{"ip": "10.99.0.5"}]});
    let mut objects = friend_foe_victim();
    objects.push(ghost);
    let mut w = World::new("cniprb", Mode::Manifests, objects, &[]);
    // friend, foe and victim have no address yet (the compiler's three).
    let ghost_reported = |w: &World, want: f64| {
        let text = http_get_at(&w.node.fx.node.node, 19999, "/metrics");
        match metric(&text, "policy_agent_problems") {
            n if n == want => Ok(()),
            n => Err(format!("{n} problems, not {want}")),
        }
    };
    eventually("the ghost reported", Duration::from_secs(5), || {
        ghost_reported(&w, 4.0)
    });
    let before = syncs(&w);
    w.add_object(policy("unrelated", "nobody", &["Ingress"], Value::Null));
    eventually("the change synced", Duration::from_secs(5), || {
        match syncs(&w) > before {
            true => Ok(()),
            false => Err("no sync yet".into()),
        }
    });
    // Let any sync that follows run, then look.
    std::thread::sleep(Duration::from_millis(500));
    ghost_reported(&w, 4.0).expect("still reported after an incremental sync");
    w.objects.retain(|o| o["metadata"]["name"] != "ghost");
    w.node.write(&w.objects);
    eventually(
        "the ghost's problem gone with it",
        Duration::from_secs(5),
        || ghost_reported(&w, 3.0),
    );
}

/// A metric's value in a Prometheus text (panics if absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}
