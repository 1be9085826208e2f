//! The full pod-to-pod connectivity matrix of a simulated node: every
//! source (each pod and the node) to every pod's every served port, over
//! IPv4 and IPv6, probed in parallel.
use std::{collections::BTreeMap, fmt, net::SocketAddr, time::Duration};

use super::{Error, NetNs, Outcome, Probe, SimNode, Transport, probe::matrix};

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

/// Results: (source, target, is_ipv6) → outcome.
#[derive(Clone, Debug, Default)]
pub struct Matrix {
    pub sources: Vec<String>,
    pub targets: Vec<Target>,
    pub cells: BTreeMap<(String, Target, bool), Outcome>,
}

/// The name the node row has.
pub const NODE_ROW: &str = "(node)";

impl SimNode {
    /// Probes everything. `ping` adds an ICMP echo column per pod.
    pub fn probe_matrix(&self, timeout: Duration, ping: bool) -> Result<Matrix, Error> {
        let mut targets = Vec::new();
        let mut probes = Vec::new();
        for p in &self.pods {
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
                    probes.push((
                        target.clone(),
                        ip.is_ipv6(),
                        Probe {
                            to: SocketAddr::new(*ip, port),
                            transport,
                        },
                    ));
                }
                targets.push(target);
            }
        }
        let mut sources: Vec<(String, &NetNs)> =
            self.pods.iter().map(|p| (p.pod.id(), &p.netns)).collect();
        sources.push((NODE_ROW.to_owned(), &self.node));
        let namespaces: Vec<&NetNs> = sources.iter().map(|(_, n)| *n).collect();
        let lists: Vec<Vec<Probe>> = sources
            .iter()
            .map(|_| probes.iter().map(|(_, _, p)| *p).collect())
            .collect();
        let raw = matrix(&namespaces, &lists, timeout)?;
        let mut cells = BTreeMap::new();
        for (i, (name, _)) in sources.iter().enumerate() {
            for (target, v6, probe) in &probes {
                if let Some(o) = raw.get(&(i, *probe)) {
                    cells.insert((name.clone(), target.clone(), *v6), *o);
                }
            }
        }
        Ok(Matrix {
            sources: sources.into_iter().map(|(n, _)| n).collect(),
            targets,
            cells,
        })
    }
}

impl Matrix {
    pub fn get(&self, from: &str, target: &Target, v6: bool) -> Option<Outcome> {
        self.cells
            .get(&(from.to_owned(), target.clone(), v6))
            .copied()
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
