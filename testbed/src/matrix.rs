//! The full pod-to-pod connectivity matrix of a simulated node: every
//! source (each pod and the node) to every pod's every served port, over
//! IPv4 and IPv6, probed in parallel. Probed with the pods' [`Servers`],
//! each cell also records whether its request reached the destination
//! pod, and [`Matrix::mismatches`] judges a cell at both ends: open means
//! the request arrived and its reply came back, blocked means nothing
//! arrived.
use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use crate::{
    Error, NetNs, Outcome, Probe, Servers, SimCluster, SimNode, Transport, connectivity::matrix,
};

/// One column: a destination pod's port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    pub pod: String,
    pub port: u16,
    pub transport: Transport,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.transport {
            Transport::Ping => write!(f, "{} icmp", self.pod),
            t => write!(f, "{}:{}/{}", self.pod, self.port, t.name()),
        }
    }
}

/// A cell: (source, target, is_ipv6).
pub type Cell = (String, Target, bool);

/// Results: (source, target, is_ipv6) → outcome.
#[derive(Clone, Debug, Default)]
pub struct Matrix {
    pub sources: Vec<String>,
    pub targets: Vec<Target>,
    pub cells: BTreeMap<Cell, Outcome>,
    /// Whether each probe's request reached the destination pod (only
    /// when probed with the pods' servers, see [`SimNode::probe_matrix_at`]).
    pub arrived: BTreeMap<Cell, bool>,
}

/// The name the node row has.
pub const NODE_ROW: &str = "(node)";

/// Where a matrix sends its probes instead of the pods' own addresses:
/// to a frontend (a Service's ClusterIP) that the node's netfilter DNATs
/// to the pod on the same port. Each cell is still judged at the pod: its
/// request must arrive at the pod's own address.
pub struct Via<'a> {
    /// (target pod id, one of its addresses) → the address to probe
    /// instead; None leaves that column and family unprobed.
    pub address: &'a dyn Fn(&str, IpAddr) -> Option<IpAddr>,
    /// Cells left out (say a pod to its own Service: hairpin traffic,
    /// masqueraded to a node address).
    pub skip: &'a dyn Fn(&Cell) -> bool,
}

/// One probe of a plan: its cell's column and family, what is sent, and
/// where the request must arrive (the pod's own address and port).
struct Planned {
    target: Target,
    v6: bool,
    probe: Probe,
    arrive: SocketAddr,
}

/// What to probe: sources (name, namespace), columns, and every probe.
struct Plan<'a> {
    sources: Vec<(String, &'a NetNs)>,
    targets: Vec<Target>,
    probes: Vec<Planned>,
}

/// The plan over the pods of `nodes` (each with the name of its node
/// row): every pod and every node a source, every pod's port a column.
fn plan_nodes<'a>(nodes: &[(&str, &'a SimNode)], ping: bool, via: Option<&Via<'_>>) -> Plan<'a> {
    let mut targets = Vec::new();
    let mut probes = Vec::new();
    let mut sources: Vec<(String, &NetNs)> = Vec::new();
    for (_, node) in nodes {
        for p in &node.pods {
            let id = p.pod.id();
            let mut ports: Vec<(u16, Transport)> = p
                .pod
                .tcp_ports
                .iter()
                .map(|x| (*x, Transport::Tcp))
                .collect();
            ports.extend(p.pod.udp_ports.iter().map(|x| (*x, Transport::Udp)));
            if ping {
                ports.push((0, Transport::Ping));
            }
            for (port, transport) in ports {
                let target = Target {
                    pod: id.clone(),
                    port,
                    transport,
                };
                for ip in &p.pod.ips {
                    let to = match via {
                        None => Some(*ip),
                        Some(v) => (v.address)(&id, *ip),
                    };
                    let Some(to) = to else { continue };
                    probes.push(Planned {
                        target: target.clone(),
                        v6: ip.is_ipv6(),
                        probe: Probe {
                            to: SocketAddr::new(to, port),
                            transport,
                        },
                        arrive: SocketAddr::new(*ip, port),
                    });
                }
                targets.push(target);
            }
        }
        sources.extend(node.pods.iter().map(|p| (p.pod.id(), &p.netns)));
    }
    for (row, node) in nodes {
        sources.push(((*row).to_owned(), &node.node));
    }
    Plan {
        sources,
        targets,
        probes,
    }
}

impl SimCluster {
    /// Probes every pod of every node from every pod and every node
    /// (rows "(node-1)", "(node-2)"), the senders' view only. `ping` adds
    /// an ICMP echo column per pod.
    pub fn probe_matrix(&self, timeout: Duration, ping: bool) -> Result<Matrix, Error> {
        let rows: Vec<String> = self.nodes.iter().map(|n| format!("({})", n.name)).collect();
        let nodes: Vec<(&str, &SimNode)> = self
            .nodes
            .iter()
            .zip(&rows)
            .map(|(n, row)| (row.as_str(), &n.sim))
            .collect();
        probe_plan(plan_nodes(&nodes, ping, None), None, timeout, &|_| true)
    }
}

impl SimNode {
    fn plan(&self, ping: bool, via: Option<&Via<'_>>) -> Plan<'_> {
        plan_nodes(&[(NODE_ROW, self)], ping, via)
    }

    /// Probes everything. `ping` adds an ICMP echo column per pod. Only
    /// the senders' view: see [`Self::probe_matrix_at`].
    pub fn probe_matrix(&self, timeout: Duration, ping: bool) -> Result<Matrix, Error> {
        self.probe(None, ping, timeout, &|_| true, None)
    }

    /// Probes everything and records, from the pods' captures, whether
    /// each request reached its destination.
    pub fn probe_matrix_at(
        &self,
        servers: &Servers,
        timeout: Duration,
        ping: bool,
    ) -> Result<Matrix, Error> {
        self.probe(Some(servers), ping, timeout, &|_| true, None)
    }

    /// Probes only `cells` again (with the receivers' view).
    pub fn reprobe(
        &self,
        servers: &Servers,
        cells: &[Cell],
        timeout: Duration,
    ) -> Result<Matrix, Error> {
        self.reprobe_via(servers, cells, timeout, None)
    }

    fn reprobe_via(
        &self,
        servers: &Servers,
        cells: &[Cell],
        timeout: Duration,
        via: Option<&Via<'_>>,
    ) -> Result<Matrix, Error> {
        let ping = cells.iter().any(|(_, t, _)| t.transport == Transport::Ping);
        let wanted: std::collections::BTreeSet<&Cell> = cells.iter().collect();
        self.probe(Some(servers), ping, timeout, &|c| wanted.contains(c), via)
    }

    fn probe(
        &self,
        servers: Option<&Servers>,
        ping: bool,
        timeout: Duration,
        wanted: &dyn Fn(&Cell) -> bool,
        via: Option<&Via<'_>>,
    ) -> Result<Matrix, Error> {
        let plan = self.plan(ping, via);
        let wanted = |c: &Cell| wanted(c) && !via.is_some_and(|v| (v.skip)(c));
        probe_plan(plan, servers, timeout, &wanted)
    }

    /// Probes everything and compares each cell with `expect(source,
    /// target, is_ipv6)` (true: open), judged at both ends (see
    /// [`Matrix::mismatches`]). A cell expected open that failed is
    /// probed again up to `retries` times with `retry_timeout` (a slow
    /// answer on a loaded machine is not a verdict); a cell expected
    /// blocked is never retried. Returns the matrix and the cells still
    /// wrong.
    pub fn judge_matrix(
        &self,
        servers: &Servers,
        ping: bool,
        timeout: Duration,
        retry_timeout: Duration,
        retries: usize,
        expect: &dyn Fn(&str, &Target, bool) -> bool,
    ) -> Result<(Matrix, Vec<String>), Error> {
        self.judge_matrix_via(servers, ping, timeout, retry_timeout, retries, expect, None)
    }

    /// [`Self::judge_matrix`] with every probe sent `via` another address
    /// (a Service's ClusterIP), judged where it lands: the pod's own
    /// address. Only the cells `via` does not skip are in the matrix.
    #[allow(clippy::too_many_arguments)]
    pub fn judge_matrix_via(
        &self,
        servers: &Servers,
        ping: bool,
        timeout: Duration,
        retry_timeout: Duration,
        retries: usize,
        expect: &dyn Fn(&str, &Target, bool) -> bool,
        via: Option<&Via<'_>>,
    ) -> Result<(Matrix, Vec<String>), Error> {
        let mut m = self.probe(Some(servers), ping, timeout, &|_| true, via)?;
        for _ in 0..retries {
            let again: Vec<Cell> = m
                .cells
                .keys()
                .filter(|c| expect(&c.0, &c.1, c.2) && m.verdict(c) != Verdict::Open)
                .cloned()
                .collect();
            if again.is_empty() {
                break;
            }
            let retried = self.reprobe_via(servers, &again, retry_timeout, via)?;
            m.merge(retried);
        }
        let wrong = m.mismatches(expect);
        Ok((m, wrong))
    }
}

/// Runs `plan`'s probes of the cells `wanted` (with the receivers' view
/// when `servers` are given).
fn probe_plan(
    plan: Plan<'_>,
    servers: Option<&Servers>,
    timeout: Duration,
    wanted: &dyn Fn(&Cell) -> bool,
) -> Result<Matrix, Error> {
    let namespaces: Vec<&NetNs> = plan.sources.iter().map(|(_, n)| *n).collect();
    let lists: Vec<Vec<Probe>> = plan
        .sources
        .iter()
        .map(|(name, _)| {
            plan.probes
                .iter()
                .filter(|p| wanted(&(name.clone(), p.target.clone(), p.v6)))
                .map(|p| p.probe)
                .collect()
        })
        .collect();
    // What arrived before this round is no part of it.
    if let Some(s) = servers {
        s.arrivals()?;
    }
    let raw = matrix(&namespaces, &lists, timeout)?;
    let arrivals = servers.map(Servers::arrivals).transpose()?;
    let mut cells = BTreeMap::new();
    let mut arrived = BTreeMap::new();
    for (i, (name, _)) in plan.sources.iter().enumerate() {
        for p in &plan.probes {
            if let Some(sent) = raw.get(&(i, p.probe)) {
                let cell = (name.clone(), p.target.clone(), p.v6);
                if let Some(a) = &arrivals {
                    let reached = sent
                        .from
                        .is_some_and(|f| a.request_arrived(f, p.arrive, p.probe.transport));
                    arrived.insert(cell.clone(), reached);
                }
                cells.insert(cell, sent.outcome);
            }
        }
    }
    Ok(Matrix {
        sources: plan.sources.into_iter().map(|(n, _)| n).collect(),
        targets: plan.targets,
        cells,
        arrived,
    })
}

/// A cell judged at both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The request arrived and its reply came back.
    Open,
    /// Nothing arrived, and nothing came back.
    Blocked,
    /// Anything else: say a request that arrived without a reply coming
    /// back, or a reset/unreachable.
    Other,
}

impl Matrix {
    pub fn get(&self, from: &str, target: &Target, v6: bool) -> Option<Outcome> {
        self.cells
            .get(&(from.to_owned(), target.clone(), v6))
            .copied()
    }

    /// Whether the request of a cell reached its destination (None if
    /// not known: probed without the receivers' view).
    pub fn arrived(&self, from: &str, target: &Target, v6: bool) -> Option<bool> {
        self.arrived
            .get(&(from.to_owned(), target.clone(), v6))
            .copied()
    }

    /// A cell judged at both ends (the sender's view only when the
    /// receivers' is not known).
    pub fn verdict(&self, cell: &Cell) -> Verdict {
        let arrived = self.arrived.get(cell).copied();
        match (self.cells.get(cell), arrived) {
            (Some(Outcome::Open), Some(true) | None) => Verdict::Open,
            (Some(Outcome::Blocked), Some(false) | None) => Verdict::Blocked,
            _ => Verdict::Other,
        }
    }

    /// Cells judged differently from `expect(source, target, is_ipv6)`
    /// (true: open), described.
    pub fn mismatches(&self, expect: &dyn Fn(&str, &Target, bool) -> bool) -> Vec<String> {
        let mut wrong = Vec::new();
        for (cell, outcome) in &self.cells {
            let (from, target, v6) = cell;
            let want = expect(from, target, *v6);
            let verdict = self.verdict(cell);
            let ok = if want {
                verdict == Verdict::Open
            } else {
                verdict == Verdict::Blocked
            };
            if ok {
                continue;
            }
            let fam = if *v6 { "IPv6" } else { "IPv4" };
            let seen = match self.arrived.get(cell) {
                Some(true) => "; the request reached the receiver",
                Some(false) => "; the request never reached the receiver",
                None => "",
            };
            wrong.push(format!(
                "  {from} -> {target} {fam}: expected {}, the sender saw {outcome:?}{seen}",
                if want { "open" } else { "blocked" },
            ));
        }
        wrong
    }

    /// Replaces the cells `other` holds.
    pub fn merge(&mut self, other: Matrix) {
        self.cells.extend(other.cells);
        self.arrived.extend(other.arrived);
    }

    /// Cells where IPv4 and IPv6 disagree.
    pub fn family_mismatches(&self) -> Vec<(String, Target)> {
        let mut out = Vec::new();
        for s in &self.sources {
            for t in &self.targets {
                if let (Some(a), Some(b)) = (self.get(s, t, false), self.get(s, t, true))
                    && a != b
                {
                    out.push((s.clone(), t.clone()));
                }
            }
        }
        out
    }

    /// Cells that differ from `other`: (source, target, v6, before, after).
    pub fn changes(&self, other: &Matrix) -> Vec<(String, Target, bool, Outcome, Outcome)> {
        self.cells
            .iter()
            .filter_map(|((s, t, v6), o)| {
                let after = other.cells.get(&(s.clone(), t.clone(), *v6))?;
                (after != o).then(|| (s.clone(), t.clone(), *v6, *o, *after))
            })
            .collect()
    }
}

fn mark(o: Option<Outcome>) -> &'static str {
    match o {
        Some(Outcome::Open) => "✓",
        Some(Outcome::Blocked) => "✗",
        Some(Outcome::Refused) => "R",
        None => " ",
    }
}

/// A table: rows are sources, columns targets; each cell shows IPv4 then
/// IPv6 (✓ passes both ways, ✗ dropped, R refused).
impl fmt::Display for Matrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .sources
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(4)
            .max(6);
        for (i, t) in self.targets.iter().enumerate() {
            writeln!(f, "{:>width$}  [{i:>2}] {t}", "", width = width)?;
        }
        write!(f, "{:>width$} ", "from \\ to", width = width)?;
        for i in 0..self.targets.len() {
            write!(f, " {i:>2} ")?;
        }
        writeln!(f)?;
        for s in &self.sources {
            write!(f, "{s:>width$} ", width = width)?;
            for t in &self.targets {
                write!(
                    f,
                    " {}{} ",
                    mark(self.get(s, t, false)),
                    mark(self.get(s, t, true))
                )?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
