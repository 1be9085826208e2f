//! Attaching the classifiers to a host-side interface, and undoing it.
//!
//! Netlink (the default): a clsact qdisc and direct-action cls_bpf filters
//! at a fixed priority and handle, which the kernel keeps after the agent
//! exits; the agent records whether it created the qdisc so `reset`
//! removes only what it added. Adding a filter waits for no RCU grace
//! period, so it stays off the way of a CNI ADD (see ARCHITECTURE,
//! "Attachment"). TCX (`--attach tcx`, Linux >= 6.6): one link per hook,
//! first in the chain, pinned under `links/` so it outlives the agent.
//! An interface keeps the kind it was attached with.
use std::{error::Error as StdError, ffi::CStr};

use aya::programs::{
    LinkOrder, SchedClassifier, TcAttachType,
    links::{FdLink, PinnedLink},
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
};
use policy_common::endpoint::{
    ATTACH_ANY_UPLINK, ATTACH_CREATED_CLSACT, ATTACH_NETLINK, ATTACH_POD, ATTACH_TCX,
    ATTACH_UPLINK, ATTACH_UPLINK_INGRESS, ATTACH_UPLINK_INGRESS_L3, ATTACH_UPLINK_L3,
};
use tracing::debug;

use crate::netlink;

use super::{
    error::Error,
    pins::{Hook, PinLayout, remove_pin},
    sys::{self, current_netns, tc_type},
};

/// Priority and handle of our netlink filters on a pod's interface: fixed,
/// so a restarted agent (and `reset`) finds exactly its own filters.
pub const NETLINK_PRIORITY: u16 = 20;
pub const NETLINK_HANDLE: TcHandle = TcHandle::new(0, 0x4e50);
/// The uplink filter's: after the pod filter where an interface has both
/// (a pod's veth seen before its pod was known).
pub const NETLINK_UPLINK_PRIORITY: u16 = 21;
pub const NETLINK_UPLINK_HANDLE: TcHandle = TcHandle::new(0, 0x4e51);

/// The netlink filter slot (priority, handle) of a hook.
pub fn netlink_slot(hook: Hook) -> (u16, TcHandle) {
    match hook {
        Hook::Ingress | Hook::Egress => (NETLINK_PRIORITY, NETLINK_HANDLE),
        // At ingress, where the pod filter (same slot) never sits with it.
        Hook::Uplink | Hook::UplinkIngress | Hook::UplinkL3 | Hook::UplinkIngressL3 => {
            (NETLINK_UPLINK_PRIORITY, NETLINK_UPLINK_HANDLE)
        }
    }
}

/// Whether a listed filter sits in one of our slots (the pod filter runs
/// before the uplink one on a veth that has both: not a foreign one).
fn is_our_filter(f: &netlink::Filter) -> bool {
    [Hook::Ingress, Hook::Uplink].into_iter().any(|h| {
        let (priority, handle) = netlink_slot(h);
        f.priority == priority && f.handle == u32::from(handle)
    })
}

/// The ENDPOINT_META bit recording that `hook` is attached.
pub fn hook_bit(hook: Hook) -> u32 {
    match hook {
        Hook::Ingress | Hook::Egress => ATTACH_POD,
        Hook::Uplink => ATTACH_UPLINK,
        Hook::UplinkIngress => ATTACH_UPLINK_INGRESS,
        Hook::UplinkL3 => ATTACH_UPLINK_L3,
        Hook::UplinkIngressL3 => ATTACH_UPLINK_INGRESS_L3,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Tcx,
    Netlink,
}

impl AttachMode {
    /// TCX when asked for and the kernel has it (>= 6.6); netlink
    /// otherwise.
    pub fn detect(tcx: bool) -> Self {
        if tcx && super::kernel_features::kernel().tcx() {
            Self::Tcx
        } else {
            Self::Netlink
        }
    }
}

/// The interface name of an ifindex.
pub fn if_name(ifindex: u32) -> Result<String, Error> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return Err(Error::NoInterface(ifindex));
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// An attach failure at `hook` of `ifindex`, naming the interface if it
/// still exists.
pub(crate) fn attach_error<E: StdError + Send + Sync + 'static>(
    ifindex: u32,
    hook: Hook,
    e: E,
) -> Error {
    Error::Attach {
        interface: if_name(ifindex).unwrap_or_else(|_| format!("ifindex {ifindex}")),
        direction: hook.name(),
        source: Box::new(e),
    }
}

fn os_error(e: &(dyn StdError + 'static)) -> Option<i32> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(nl) = err.downcast_ref::<aya::sys::NetlinkError>()
            && let Some(code) = nl.raw_os_error()
        {
            return Some(code);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(code) = io.raw_os_error()
        {
            return Some(code);
        }
        cur = err.source();
    }
    None
}

/// What runs before our classifier at one hook (see
/// [`Attachment::ahead_of`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Ahead {
    /// TCX programs, by id.
    pub tcx: Vec<u32>,
    /// clsact filters (netlink attachment only).
    pub filters: Vec<netlink::Filter>,
    /// What could not be listed (so not "none"), and why.
    pub unknown: Option<String>,
}

impl Ahead {
    pub fn is_empty(&self) -> bool {
        self.tcx.is_empty() && self.filters.is_empty() && self.unknown.is_none()
    }
}

impl std::fmt::Display for Ahead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if !self.tcx.is_empty() {
            parts.push(format!("TCX programs {:?}", self.tcx));
        }
        for filter in &self.filters {
            parts.push(format!(
                "tc filter pref {} handle {:#x} ({})",
                filter.priority, filter.handle, filter.kind
            ));
        }
        if let Some(e) = &self.unknown {
            parts.push(e.clone());
        }
        f.write_str(&parts.join(", "))
    }
}

/// What the agent did to one interface.
pub struct Attachment<'a> {
    layout: &'a PinLayout,
    ifindex: u32,
    /// `ATTACH_*` bits, as stored in ENDPOINT_META.
    pub bits: u32,
}

impl<'a> Attachment<'a> {
    pub fn new(layout: &'a PinLayout, ifindex: u32, bits: u32) -> Self {
        Self {
            layout,
            ifindex,
            bits,
        }
    }

    fn attach_err<E: StdError + Send + Sync + 'static>(
        &self,
        hook: Hook,
    ) -> impl FnOnce(E) -> Error + '_ {
        move |e| attach_error(self.ifindex, hook, e)
    }

    /// How this interface is attached: the kind recorded, or `mode` for
    /// an interface with nothing attached yet (one interface never mixes
    /// the two, and a restarted agent keeps what it finds).
    pub fn kind(&self, mode: AttachMode) -> AttachMode {
        if self.bits & ATTACH_TCX != 0 {
            AttachMode::Tcx
        } else if self.bits & ATTACH_NETLINK != 0 {
            AttachMode::Netlink
        } else {
            mode
        }
    }

    /// Makes sure `prog` runs at `hook` of this interface.
    pub fn ensure(
        &mut self,
        prog: &mut SchedClassifier,
        hook: Hook,
        mode: AttachMode,
    ) -> Result<(), Error> {
        let name = if_name(self.ifindex)?;
        match self.kind(mode) {
            AttachMode::Tcx => self.ensure_tcx(prog, hook, &name)?,
            AttachMode::Netlink => self.ensure_netlink(prog, hook, &name)?,
        }
        self.bits |= hook_bit(hook);
        Ok(())
    }

    fn ensure_tcx(
        &mut self,
        prog: &mut SchedClassifier,
        hook: Hook,
        name: &str,
    ) -> Result<(), Error> {
        let path = self.layout.link(self.ifindex, hook);
        let ours = prog.info().map_err(self.attach_err(hook))?.id();
        if let Ok(pinned) = PinnedLink::from_pin(&path) {
            let attached: Vec<u32> = SchedClassifier::query_tcx(name, tc_type(hook))
                .map(|(_, progs)| progs.iter().map(|p| p.id()).collect())
                .unwrap_or_default();
            let link: FdLink = pinned.into();
            let linked = link.info().map(|i| i.program_id()).unwrap_or(0);
            if attached.contains(&linked) {
                if linked != ours {
                    let link =
                        SchedClassifierLink::try_from(link).map_err(self.attach_err(hook))?;
                    prog.attach_to_link(link).map_err(self.attach_err(hook))?;
                }
                self.bits |= ATTACH_TCX;
                return Ok(());
            }
            // The pin outlived its interface (a new one got the ifindex).
            debug!(path = %path.display(), "removing stale link pin");
            remove_pin(&path)?;
        }
        let id = prog
            .attach_with_options(
                name,
                tc_type(hook),
                // First in the chain: see `sys::tcx_attach_and_pin`.
                TcAttachOptions::TcxOrder(LinkOrder::first()),
            )
            .map_err(self.attach_err(hook))?;
        let link = prog.take_link(id).map_err(self.attach_err(hook))?;
        let fd: FdLink = link.try_into().map_err(self.attach_err(hook))?;
        fd.pin(&path).map_err(|e| Error::Pin {
            path: path.clone(),
            source: Box::new(e),
        })?;
        self.bits |= ATTACH_TCX;
        Ok(())
    }

    fn ensure_netlink(
        &mut self,
        prog: &mut SchedClassifier,
        hook: Hook,
        name: &str,
    ) -> Result<(), Error> {
        match tc::qdisc_add_clsact(name) {
            Ok(()) => self.bits |= ATTACH_CREATED_CLSACT,
            Err(e) if os_error(&e) == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(Error::Clsact {
                    interface: name.to_owned(),
                    source: Box::new(e),
                });
            }
        }
        let (priority, handle) = netlink_slot(hook);
        let options = NlOptions {
            priority,
            handle,
            classid: None,
        };
        let id = match prog.attach_with_options(
            name,
            tc_type(hook),
            TcAttachOptions::Netlink(options),
        ) {
            Ok(id) => id,
            Err(e) if os_error(&e) == Some(libc::EEXIST) => {
                // Our filter is there already (an earlier agent): replace its program.
                let existing =
                    SchedClassifierLink::attached(name, tc_type(hook), priority, handle, None)
                        .map_err(self.attach_err(hook))?;
                prog.attach_to_link(existing)
                    .map_err(self.attach_err(hook))?
            }
            Err(e) => return Err(self.attach_err(hook)(e)),
        };
        // The kernel keeps the filter; dropping aya's handle would detach it.
        std::mem::forget(prog.take_link(id).map_err(self.attach_err(hook))?);
        self.bits |= ATTACH_NETLINK;
        Ok(())
    }

    /// What runs before our program `prog` at `hook` and could pass a
    /// packet (`TC_ACT_OK`) before the classifier judges it; our other
    /// programs (`ours`, by id) and filters do not count. Under TCX: the
    /// programs ahead of ours in the chain. Under netlink: every TCX
    /// program (the kernel runs TCX before clsact), and the filters at a
    /// lower priority number, or at ours with another handle.
    pub fn ahead_of(&self, prog: u32, ours: &[u32], hook: Hook) -> Ahead {
        let mut ahead = Ahead::default();
        let Ok(name) = if_name(self.ifindex) else {
            return ahead;
        };
        let tcx: Vec<u32> = match SchedClassifier::query_tcx(&name, tc_type(hook)) {
            Ok((_, progs)) => progs.iter().map(aya::programs::ProgramInfo::id).collect(),
            // An older kernel cannot be asked, and has no TCX: none.
            Err(_) if !super::kernel_features::kernel().tcx() => Vec::new(),
            Err(e) => {
                ahead.unknown = Some(format!("TCX programs unknown: {e}"));
                Vec::new()
            }
        };
        if self.bits & ATTACH_TCX != 0 {
            ahead.tcx = tcx
                .into_iter()
                .take_while(|id| *id != prog)
                .filter(|id| !ours.contains(id))
                .collect();
        } else if self.bits & ATTACH_NETLINK != 0 {
            ahead.tcx = tcx.into_iter().filter(|id| !ours.contains(id)).collect();
            let (priority, handle) = netlink_slot(hook);
            let handle = u32::from(handle);
            match netlink::clsact_filters(self.ifindex, tc_type(hook) == TcAttachType::Egress) {
                Ok(filters) => {
                    ahead.filters = filters
                        .into_iter()
                        .filter(|f| !is_our_filter(f))
                        .filter(|f| {
                            f.priority < priority || (f.priority == priority && f.handle != handle)
                        })
                        .collect();
                }
                Err(e) => ahead.unknown = Some(format!("filters unknown: {e}")),
            }
        }
        ahead
    }

    /// Moves a netlink-attached interface to TCX links, first in the
    /// chain: for foreign TCX programs, which would otherwise run before
    /// our filters. The links go on before the filters come off, so the
    /// interface is never without the classifiers; the clsact qdisc stays
    /// (with its ATTACH_CREATED_CLSACT record, for `reset`).
    pub fn move_to_tcx(
        &mut self,
        programs: &mut super::loader::Classifiers,
        errors: &mut Vec<Error>,
    ) -> Result<(), Error> {
        if self.bits & ATTACH_NETLINK == 0 {
            return Ok(());
        }
        let name = if_name(self.ifindex)?;
        let hooks: Vec<Hook> = Hook::ALL
            .into_iter()
            .filter(|h| self.bits & hook_bit(*h) != 0)
            .collect();
        for hook in &hooks {
            self.ensure_tcx(programs.get_mut(*hook)?, *hook, &name)?;
        }
        self.remove_filters(&name, &hooks, errors);
        self.bits &= !ATTACH_NETLINK;
        Ok(())
    }

    /// Points an existing attachment at `prog` (an upgraded program).
    pub fn replace_program(&mut self, prog: &mut SchedClassifier, hook: Hook) -> Result<(), Error> {
        if self.bits & hook_bit(hook) == 0 {
            return Ok(()); // Not attached at this hook.
        }
        let Ok(name) = if_name(self.ifindex) else {
            return Ok(()); // The interface is gone; nothing to move.
        };
        if self.bits & ATTACH_TCX != 0 {
            return self.ensure_tcx(prog, hook, &name);
        }
        if self.bits & ATTACH_NETLINK != 0 {
            return self.ensure_netlink(prog, hook, &name);
        }
        Ok(())
    }

    /// Removes what the agent attached here (every hook). Errors are
    /// collected so one failure does not leave the rest in place. `netns`
    /// is the namespace the attachment was made in: TCX links are detached
    /// from anywhere (through their pins); netlink filters only from that
    /// namespace.
    pub fn detach(&mut self, netns: u64, errors: &mut Vec<Error>) {
        self.detach_hooks(&Hook::ALL, netns, errors);
    }

    /// Removes the attachments at `hooks` only, clearing their bits.
    pub fn detach_hooks(&mut self, hooks: &[Hook], netns: u64, errors: &mut Vec<Error>) {
        for hook in hooks {
            let path = self.layout.link(self.ifindex, *hook);
            // Detach now: dropping the last reference (the pin) frees the
            // link only later, from a workqueue.
            if path.exists()
                && let Err(source) = sys::link_detach(&path)
                && source.raw_os_error() != Some(libc::ENOLINK)
            {
                errors.push(Error::Io {
                    what: "detaching link",
                    path: path.clone(),
                    source,
                });
            }
            if let Err(e) = remove_pin(&path) {
                errors.push(e);
            }
        }
        let netlink = self.bits & ATTACH_NETLINK != 0;
        for hook in hooks {
            self.bits &= !hook_bit(*hook);
        }
        if !netlink {
            return;
        }
        if netns != 0 && netns != current_netns() {
            errors.push(Error::OtherNamespace {
                ifindex: self.ifindex,
            });
            return;
        }
        let Ok(name) = if_name(self.ifindex) else {
            return; // Interface gone: its filters went with it.
        };
        self.remove_filters(&name, hooks, errors);
    }

    /// Deletes our netlink filters at `hooks` (absent ones are fine).
    fn remove_filters(&self, name: &str, hooks: &[Hook], errors: &mut Vec<Error>) {
        for hook in hooks {
            let (priority, handle) = netlink_slot(*hook);
            // Absent (never attached at this hook): nothing to do.
            let Ok(link) =
                SchedClassifierLink::attached(name, tc_type(*hook), priority, handle, None)
            else {
                continue;
            };
            use aya::programs::Link as _;
            if let Err(e) = link.detach()
                && os_error(&e) != Some(libc::ENOENT)
            {
                errors.push(self.attach_err(*hook)(e));
            }
        }
    }

    /// Whether anything is still attached (besides how: mode bits).
    pub fn any_hook(&self) -> bool {
        self.bits & (ATTACH_POD | ATTACH_ANY_UPLINK) != 0
    }
}
