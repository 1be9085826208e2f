//! Connections through a Service frontend, judged where they land: many
//! probes from one pod to a ClusterIP (kube-proxy picks a backend for
//! each), and for each probe which backend's capture saw its request
//! (by the probe's source address and port, unchanged: kube-proxy does
//! not masquerade pod-to-ClusterIP traffic) and what the sender saw.
use std::{net::SocketAddr, time::Duration};

use crate::{Error, NetNs, Outcome, Probe, Servers, Transport, connectivity::run_probes};

/// One probe through a frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Landed {
    /// What the sender saw.
    pub outcome: Outcome,
    /// The backend (pod id) whose capture saw the request, if any.
    pub backend: Option<String>,
}

/// Sends `count` probes (each its own connection or socket) from `from`
/// to `frontend` and finds where each request arrived among `backends`
/// (pod id, the address and port the request arrives at), with the
/// captures of `servers` (one per node).
pub fn through(
    from: &NetNs,
    frontend: SocketAddr,
    transport: Transport,
    backends: &[(String, SocketAddr)],
    servers: &[&Servers],
    count: usize,
    timeout: Duration,
) -> Result<Vec<Landed>, Error> {
    // What arrived before is no part of this round.
    for s in servers {
        s.arrivals()?;
    }
    let probes = vec![
        Probe {
            to: frontend,
            transport,
        };
        count
    ];
    let name = from.name.clone();
    let sent = from
        .spawn(move || run_probes(&probes, timeout))?
        .join()
        .map_err(|_| Error::Invalid(format!("probe thread in {name} panicked")))??
        .map_err(|source| Error::Socket {
            netns: from.name.clone(),
            source,
        })?;
    let arrivals = servers
        .iter()
        .map(|s| s.arrivals())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(sent
        .into_iter()
        .map(|s| {
            let backend = s.from.and_then(|f| {
                backends
                    .iter()
                    .find(|(_, at)| {
                        arrivals
                            .iter()
                            .any(|a| a.request_arrived(f, *at, transport))
                    })
                    .map(|(id, _)| id.clone())
            });
            Landed {
                outcome: s.outcome,
                backend,
            }
        })
        .collect())
}
