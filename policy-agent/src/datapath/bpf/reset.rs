//! Undoing everything the agent installed under one pin directory.
use std::path::PathBuf;

use policy_common::endpoint::ATTACH_CREATED_CLSACT;
use tracing::{info, warn};

use crate::exec;

use super::{
    attach::{Attachment, if_name},
    error::Error,
    maps::BpfMaps,
    pins::PinLayout,
    sys::current_netns,
};

/// What `reset` removed.
#[derive(Debug, Default)]
pub struct ResetReport {
    /// Interfaces whose attachments were removed.
    pub interfaces: Vec<String>,
    /// Pin directory removed (None when nothing was pinned).
    pub removed: Option<PathBuf>,
}

/// Detaches from every interface recorded in ENDPOINT_META, removes the
/// clsact qdiscs the agent created, then removes the pin directory, which
/// unloads programs and maps once nothing else holds them. Carries on past
/// failures and reports them all.
pub fn reset(layout: &PinLayout) -> Result<ResetReport, Vec<Error>> {
    let mut report = ResetReport::default();
    let mut errors = Vec::new();
    // An earlier layout's pins (an upgrade not finished): their TCX links
    // detach as their pins go.
    let _ = super::earlier_layout::retire(layout);
    if !layout.exists() {
        return Ok(report);
    }
    match BpfMaps::from_pins(layout).and_then(|m| m.read_meta()) {
        Ok(meta) => {
            for (ifindex, m) in meta {
                let here = m.netns == 0 || m.netns == current_netns();
                let name = if here {
                    if_name(ifindex).unwrap_or_else(|_| format!("ifindex {ifindex} (gone)"))
                } else {
                    format!("ifindex {ifindex} (other namespace)")
                };
                Attachment::new(layout, ifindex, m.attach).detach(m.netns, &mut errors);
                if here && m.attach & ATTACH_CREATED_CLSACT != 0 {
                    remove_clsact_if_empty(ifindex, &mut errors);
                }
                report.interfaces.push(name);
            }
        }
        Err(e) => {
            warn!(error = %e, "cannot read endpoint metadata; removing pins only");
            errors.push(e);
        }
    }
    let dir = layout.versioned();
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => report.removed = Some(dir.clone()),
        Err(source) => errors.push(Error::Io {
            what: "removing pin directory",
            path: dir.clone(),
            source,
        }),
    }
    // The unversioned root too, if nothing else lives there.
    let _ = std::fs::remove_dir(layout.root());
    info!(pins = %dir.display(), interfaces = report.interfaces.len(), "reset done");
    if errors.is_empty() {
        Ok(report)
    } else {
        Err(errors)
    }
}

/// Deletes the clsact qdisc the agent added, unless someone else's filters
/// now hang off it.
fn remove_clsact_if_empty(ifindex: u32, errors: &mut Vec<Error>) {
    let Ok(name) = if_name(ifindex) else { return };
    // Unknown (tc failed): assume someone else's filters are there.
    let has_filters = ["ingress", "egress"].iter().any(|hook| {
        exec::run("tc", &["filter", "show", "dev", &name, hook])
            .map(|out| !out.is_empty())
            .unwrap_or(true)
    });
    if has_filters {
        return;
    }
    if let Err(e) = exec::run("tc", &["qdisc", "del", "dev", &name, "clsact"]) {
        errors.push(Error::Command(e));
    }
}
