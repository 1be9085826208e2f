//! Loading the object with its maps pinned, reusing what an earlier agent
//! left, and keeping programs pinned so enforcement outlives the agent.
use aya::{EbpfLoader, programs::SchedClassifier};
use policy_common::{
    endpoint::{ATTACH_POD, ATTACH_STANDBY, ATTACH_TCX, ENDPOINT_NAME_LEN, EndpointMeta},
    maps as names,
};
use tracing::{debug, info};

use super::{
    attach::{Ahead, AttachMode, Attachment, attach_error, hook_bit},
    error::Error,
    maps::BpfMaps,
    object::{OBJECT, object_hash},
    pins::{Hook, PinLayout, remove_pin},
    program_load::{Programs, load_and_pin, load_in_background},
    sys::{current_netns, tcx_attach_and_pin},
};

/// What [`PinnedClassifier::check_order`] found and did.
#[derive(Debug)]
pub struct OrderCheck {
    /// Set when foreign TCX programs made the interface move from netlink
    /// filters to TCX links: filters left behind, or why it failed.
    pub moved: Option<Result<Vec<Error>, Error>>,
    /// What still runs before the classifiers, by hook.
    pub ahead: Vec<(Hook, Ahead)>,
}

/// Knobs for opening the datapath.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Attach through TCX links where the kernel has them, instead of
    /// netlink clsact filters.
    pub tcx: bool,
    /// Map capacity overrides (map name → entries), applied when a map is
    /// first created.
    pub capacities: Vec<(&'static str, u32)>,
    /// The most `CONNTRACK` entries one interface may hold (0: no bound;
    /// None: [`super::conntrack_share::share_for`]'s default).
    pub conntrack_share: Option<u32>,
    /// The flow-record budget and the daemon's flow log.
    pub flows: super::flows::FlowOptions,
}

/// The classifiers, loaded or opened from their pins. Those of a device
/// without a link-layer header only once the node has one (see
/// [`PinnedClassifier::load_missing`]).
pub struct Classifiers {
    pub from_pod: SchedClassifier,
    pub to_pod: SchedClassifier,
    pub to_uplink: SchedClassifier,
    pub from_uplink: SchedClassifier,
    pub to_uplink_l3: Option<SchedClassifier>,
    pub from_uplink_l3: Option<SchedClassifier>,
}

impl Classifiers {
    /// Opens the programs pinned under `layout`.
    pub fn open_pinned(layout: &PinLayout) -> Result<Self, Error> {
        open_pinned(layout)
    }

    fn slot(&mut self, hook: Hook) -> Option<&mut SchedClassifier> {
        match hook {
            Hook::Ingress => Some(&mut self.from_pod),
            Hook::Egress => Some(&mut self.to_pod),
            Hook::Uplink => Some(&mut self.to_uplink),
            Hook::UplinkIngress => Some(&mut self.from_uplink),
            Hook::UplinkL3 => self.to_uplink_l3.as_mut(),
            Hook::UplinkIngressL3 => self.from_uplink_l3.as_mut(),
        }
    }

    /// The program of `hook` (an error for one not loaded yet).
    pub fn get_mut(&mut self, hook: Hook) -> Result<&mut SchedClassifier, Error> {
        self.slot(hook).ok_or(Error::MissingProgram(hook.program()))
    }

    pub fn id(&self, hook: Hook) -> Option<u32> {
        let prog = match hook {
            Hook::Ingress => &self.from_pod,
            Hook::Egress => &self.to_pod,
            Hook::Uplink => &self.to_uplink,
            Hook::UplinkIngress => &self.from_uplink,
            Hook::UplinkL3 => self.to_uplink_l3.as_ref()?,
            Hook::UplinkIngressL3 => self.from_uplink_l3.as_ref()?,
        };
        prog.info().ok().map(|i| i.id())
    }
}

/// The pinned BPF datapath: maps, programs, attachments.
pub struct PinnedClassifier {
    pub(super) layout: PinLayout,
    pub(super) maps: BpfMaps,
    pub(super) programs: Programs,
    pub(super) mode: AttachMode,
    /// What the maps hold at most (writes are planned within it).
    pub(super) capacities: super::capacity_plan::Capacities,
}

pub(super) fn loader<'a>(
    capacities: &'a [(&'a str, u32)],
    pins: &'a [(&'static str, std::path::PathBuf)],
) -> EbpfLoader<'a> {
    let mut loader = EbpfLoader::new();
    for (name, path) in pins {
        loader.map_pin_path(name, path.as_path());
    }
    for (name, entries) in capacities {
        loader.map_max_entries(name, *entries);
        // A family's full-length prefixes live in its host table: sized
        // as its trie, so the capacity plan of one holds for both.
        if *name == names::IPCACHE_V4 {
            loader.map_max_entries(names::IPCACHE_HOSTS_V4, *entries);
        } else if *name == names::IPCACHE_V6 {
            loader.map_max_entries(names::IPCACHE_HOSTS_V6, *entries);
        }
    }
    loader
}

/// The classifier `name` of a loaded object.
pub(super) fn classifier<'a>(
    ebpf: &'a mut aya::Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, Error> {
    ebpf.program_mut(name)
        .ok_or(Error::MissingProgram(name))?
        .try_into()
        .map_err(Error::program(name))
}

impl PinnedClassifier {
    /// The pinned maps (the testbed writes chosen content through them).
    pub fn maps(&self) -> &BpfMaps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut BpfMaps {
        &mut self.maps
    }

    /// How the classifiers go on an interface.
    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// Loads and pins the programs of `hooks` not loaded yet (those of a
    /// device without a link-layer header, once the node has one): the
    /// object again, its maps from their pins, that program alone through
    /// the verifier.
    pub fn load_missing(&mut self, hooks: &[Hook]) -> Result<(), Error> {
        for hook in hooks {
            if self.programs()?.get_mut(*hook).is_ok() {
                continue;
            }
            let name = hook.program();
            let mut ebpf = self.object_over_pins()?;
            let prog = classifier(&mut ebpf, name)?;
            super::program_load::load_classifier(prog, name)?;
            let path = self.layout.program(name);
            remove_pin(&path)?;
            prog.pin(&path).map_err(|e| Error::Pin {
                path: path.clone(),
                source: Box::new(e),
            })?;
            info!(
                program = name,
                "loaded for a device without a link-layer header"
            );
            let opened = SchedClassifier::from_pin(&path).map_err(Error::program(name))?;
            match hook {
                Hook::UplinkL3 => self.programs()?.to_uplink_l3 = Some(opened),
                Hook::UplinkIngressL3 => self.programs()?.from_uplink_l3 = Some(opened),
                // The others are loaded at start.
                _ => {}
            }
        }
        Ok(())
    }
}

impl PinnedClassifier {
    /// Opens the datapath pinned under `layout`, creating it if absent.
    ///
    /// Maps are reused when pinned (their content is the enforced state).
    /// Programs are reused when they came from this very object; otherwise
    /// fresh ones are loaded, every existing attachment is switched to them
    /// atomically, and they replace the old pins.
    pub fn open(layout: &PinLayout, opts: &LoadOptions) -> Result<Self, Error> {
        if OBJECT.is_empty() {
            return Err(Error::NoObject);
        }
        let kernel = super::kernel_features::kernel();
        if let Some(line) = kernel.missing_line() {
            return Err(Error::Unsupported(line));
        }
        for fallback in kernel.fallbacks() {
            info!(kernel = %kernel.release, "{fallback}");
        }
        let fresh = !layout.exists();
        layout.create()?;
        let paths: Vec<(&'static str, std::path::PathBuf)> =
            names::ALL.iter().map(|n| (*n, layout.map(n))).collect();
        let mut ebpf = loader(&opts.capacities, &paths)
            .load(OBJECT)
            .map_err(|e| Error::Load {
                pins: layout.maps_dir(),
                source: Box::new(e),
            })?;
        let mut maps = BpfMaps::from_ebpf(&mut ebpf, Some(layout))?;
        if fresh {
            super::earlier_layout::carry_over(layout, &mut maps);
        }
        let mode = AttachMode::detect(opts.tcx);

        let hash = object_hash();
        let mut config = maps.config()?;
        let pinned = Hook::CORE
            .iter()
            .all(|h| layout.program(h.program()).exists());
        let programs = if pinned && config.object_hash == hash {
            debug!(pins = %layout.progs_dir().display(), "reusing pinned programs");
            Programs::Ready(Box::new(open_pinned(layout)?))
        } else {
            let meta = maps.read_meta()?;
            if meta.is_empty() {
                load_in_background(layout.clone(), ebpf)?
            } else {
                info!(pins = %layout.progs_dir().display(), "loading classifier programs");
                let programs = load_and_pin(layout, &mut ebpf, &meta)?;
                config.object_hash = hash;
                maps.set_config(config)?;
                Programs::Ready(Box::new(programs))
            }
        };
        let capacities = maps.capacities();
        warn_resized(&opts.capacities, &capacities);
        if let Some(rate) = opts.flows.rate
            && let Err(e) = super::flows::budget::write(layout, rate)
        {
            tracing::warn!(error = %e, "the flow-record budget could not be written");
        }
        Ok(Self {
            layout: layout.clone(),
            maps,
            programs,
            mode,
            capacities,
        })
    }
}

impl PinnedClassifier {
    /// Attaches both pod classifiers to the interface `ifindex` and
    /// records it (with `name`, e.g. "namespace/pod") in ENDPOINT_META.
    /// Write the endpoint's map entry first, so its first packet is
    /// already judged.
    pub fn attach(&mut self, ifindex: u32, name: &str) -> Result<(), Error> {
        self.attach_hooks(ifindex, name, &Hook::BOTH, false)
    }

    /// Attaches both pod classifiers to a new veth no pod is known to hold
    /// yet (ATTACH_STANDBY): without an endpoint entry they judge as the
    /// uplink classifiers, and the pod's hand-off later finds them in
    /// place (no attach, with its RCU grace periods, on the way of a CNI
    /// ADD).
    pub fn attach_standby(&mut self, ifindex: u32) -> Result<(), Error> {
        self.attach_hooks(ifindex, &standby_label(ifindex), &Hook::BOTH, true)
    }

    /// Attaches the uplink classifiers `hooks` (egress, and ingress with
    /// `--pod-cidr`) to `ifindex`.
    pub fn attach_uplink(&mut self, ifindex: u32, name: &str, hooks: &[Hook]) -> Result<(), Error> {
        self.attach_hooks(ifindex, name, hooks, false)
    }

    /// `standby`: the pod hooks go on ahead of a pod (see
    /// [`Self::attach_standby`]); otherwise attaching the pod hooks makes
    /// the interface a pod's.
    fn attach_hooks(
        &mut self,
        ifindex: u32,
        name: &str,
        hooks: &[Hook],
        standby: bool,
    ) -> Result<(), Error> {
        self.load_missing(hooks)?;
        let known = self.maps.meta(ifindex).map(|m| m.attach).unwrap_or(0);
        let mut attachment = Attachment::new(&self.layout, ifindex, known);
        let mut result = Ok(());
        for hook in hooks {
            result = self
                .programs
                .get_mut(*hook)
                .and_then(|prog| attachment.ensure(prog, *hook, self.mode));
            if result.is_err() {
                break;
            }
        }
        if hooks == Hook::BOTH.as_slice() {
            if standby {
                attachment.bits |= ATTACH_STANDBY;
            } else if result.is_ok() {
                attachment.bits &= !ATTACH_STANDBY;
            }
        }
        // Record what was done even on failure, so `reset` can undo it.
        self.maps
            .set_meta(ifindex, &endpoint_meta(name, attachment.bits))?;
        result
    }

    /// Attaches many new interfaces at once. With TCX the kernel attaches
    /// in parallel (each attach waits for an RCU grace period); interfaces
    /// that already have something pinned go through [`Self::attach`].
    pub fn attach_many(&mut self, items: &[(u32, String)]) -> Vec<(u32, Result<(), Error>)> {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        if self.mode != AttachMode::Tcx {
            return items
                .iter()
                .map(|(i, n)| (*i, self.attach(*i, n)))
                .collect();
        }
        if let Err(e) = self.programs() {
            let why = e.to_string();
            return items
                .iter()
                .map(|(i, _)| (*i, Err(Error::NotLoaded(why.clone()))))
                .collect();
        }
        let layout = self.layout.clone();
        let fds: Vec<(Hook, i32)> = Hook::BOTH
            .iter()
            .filter_map(|h| {
                let prog = self.programs.get_mut(*h).ok()?;
                prog.fd().ok().map(|fd| (*h, fd.as_fd().as_raw_fd()))
            })
            .collect();
        let (fresh, known): (Vec<_>, Vec<_>) = items
            .iter()
            .cloned()
            .partition(|(i, _)| Hook::ALL.iter().all(|h| !layout.link(*i, *h).exists()));
        let mut out: Vec<(u32, Result<(), Error>)> = known
            .iter()
            .map(|(i, n)| (*i, self.attach(*i, n)))
            .collect();
        let chunk = fresh.len().div_ceil(8).max(1);
        let results: Vec<(u32, &str, Result<(), Error>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = fresh
                .chunks(chunk)
                .map(|part| {
                    let (layout, fds) = (&layout, &fds);
                    scope.spawn(move || {
                        part.iter()
                            .map(|(ifindex, name)| {
                                let r = fds.iter().try_for_each(|(hook, fd)| {
                                    tcx_attach_and_pin(
                                        *fd,
                                        *ifindex,
                                        *hook,
                                        &layout.link(*ifindex, *hook),
                                    )
                                    .map_err(|e| attach_error(*ifindex, *hook, e))
                                });
                                (*ifindex, name.as_str(), r)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        for (ifindex, name, r) in results {
            // Record even partial attachments, so `reset` can undo them.
            let before = self.maps.meta(ifindex).map(|m| m.attach).unwrap_or(0);
            let bits = if Hook::BOTH.iter().any(|h| layout.link(ifindex, *h).exists()) {
                (before | ATTACH_TCX | ATTACH_POD) & !ATTACH_STANDBY
            } else {
                before
            };
            let recorded = self.maps.set_meta(ifindex, &endpoint_meta(name, bits));
            out.push((ifindex, r.and(recorded)));
        }
        out
    }

    /// What runs before the classifiers on `ifindex`, at every hook the
    /// agent attached there (only hooks where something does).
    pub fn foreign_ahead(&mut self, ifindex: u32) -> Vec<(Hook, Ahead)> {
        let known = self.maps.meta(ifindex).map(|m| m.attach).unwrap_or(0);
        let attachment = Attachment::new(&self.layout, ifindex, known);
        let ours: Vec<u32> = Hook::ALL
            .iter()
            .filter_map(|h| self.programs.id(*h))
            .collect();
        Hook::ALL
            .iter()
            .filter(|h| known & hook_bit(**h) != 0)
            .filter_map(|h| Some((*h, self.programs.id(*h)?)))
            .map(|(h, prog)| (h, attachment.ahead_of(prog, &ours, h)))
            .filter(|(_, ahead)| !ahead.is_empty())
            .collect()
    }

    /// How `ifindex` is attached (or would be, with nothing on it yet).
    pub fn kind_of(&self, ifindex: u32) -> AttachMode {
        let known = self.maps.meta(ifindex).map(|m| m.attach).unwrap_or(0);
        Attachment::new(&self.layout, ifindex, known).kind(self.mode)
    }

    /// Moves a netlink-attached `ifindex` to TCX links, first in the
    /// chain, ahead of foreign TCX programs (see
    /// [`Attachment::move_to_tcx`]). Filters left behind are errors to
    /// report; the classifiers run either way.
    pub fn move_to_tcx(&mut self, ifindex: u32) -> Result<Vec<Error>, Error> {
        let meta = self.maps.meta(ifindex);
        let known = meta.as_ref().map_or(0, |m| m.attach);
        self.programs()?;
        let mut attachment = Attachment::new(&self.layout, ifindex, known);
        let mut errors = Vec::new();
        let Some(programs) = self.programs.ready() else {
            return Err(Error::NotLoaded("still loading".into()));
        };
        let moved = attachment.move_to_tcx(programs, &mut errors);
        let name = meta
            .as_ref()
            .map(endpoint_meta_name)
            .unwrap_or_else(|| uplink_label(ifindex));
        // Recorded even after a failure half way, so `reset` undoes both.
        self.maps
            .set_meta(ifindex, &endpoint_meta(&name, attachment.bits))?;
        moved.map(|()| errors)
    }

    /// Makes sure nothing foreign runs before the classifiers of
    /// `ifindex` where the agent can help it: foreign TCX programs run
    /// before every clsact filter, so a netlink-attached interface that
    /// has any moves to TCX links, first in the chain. What still runs
    /// ahead afterwards (a filter at a lower priority number, a program
    /// that took the first TCX slot later) is the caller's to report.
    pub fn check_order(&mut self, ifindex: u32) -> OrderCheck {
        let mut ahead = self.foreign_ahead(ifindex);
        let tcx_ahead = ahead.iter().any(|(_, a)| !a.tcx.is_empty());
        let mut moved = None;
        if tcx_ahead && self.kind_of(ifindex) == AttachMode::Netlink {
            moved = Some(self.move_to_tcx(ifindex));
            ahead = self.foreign_ahead(ifindex);
        }
        OrderCheck { moved, ahead }
    }

    /// Removes the pod classifiers of `ifindex` (and its record, unless
    /// the uplink classifier stays).
    pub fn detach(&mut self, ifindex: u32) -> Result<(), Vec<Error>> {
        self.detach_hooks(ifindex, &Hook::BOTH)
    }

    /// Removes every classifier of `ifindex` and its record (an interface
    /// that went before any pod claimed it).
    pub fn detach_all(&mut self, ifindex: u32) -> Result<(), Vec<Error>> {
        self.detach_hooks(ifindex, &Hook::ALL)
    }

    /// Removes the uplink classifiers `hooks` of `ifindex` (and its
    /// record, unless other classifiers stay).
    pub fn detach_uplink(&mut self, ifindex: u32, hooks: &[Hook]) -> Result<(), Vec<Error>> {
        self.detach_hooks(ifindex, hooks)
    }

    /// Detaches `hooks`; the record stays while anything is still attached.
    fn detach_hooks(&mut self, ifindex: u32, hooks: &[Hook]) -> Result<(), Vec<Error>> {
        let meta = self.maps.meta(ifindex);
        let (known, netns) = meta.as_ref().map_or((0, 0), |m| (m.attach, m.netns));
        let mut errors = Vec::new();
        let mut attachment = Attachment::new(&self.layout, ifindex, known);
        attachment.detach_hooks(hooks, netns, &mut errors);
        let written = if attachment.any_hook() {
            let name = match &meta {
                Some(m) if attachment.bits & ATTACH_POD != 0 => endpoint_meta_name(m),
                _ => uplink_label(ifindex),
            };
            self.maps
                .set_meta(ifindex, &endpoint_meta(&name, attachment.bits))
        } else {
            self.maps.remove_meta(ifindex)
        };
        if let Err(e) = written {
            errors.push(e);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// A pinned map keeps the size it was created with: say so when the
/// configuration asks for another.
fn warn_resized(asked: &[(&'static str, u32)], have: &super::capacity_plan::Capacities) {
    for (name, entries) in asked {
        let current = match *name {
            names::POLICY => have.policy,
            names::IPCACHE_V4 => have.ipcache_v4,
            names::IPCACHE_V6 => have.ipcache_v6,
            names::IDENTITY_NAMES => have.identities,
            names::RULE_NAMES => have.rule_names,
            names::ENDPOINTS => have.endpoints,
            names::SERVICES => have.services,
            _ => continue,
        };
        if current != *entries as usize {
            tracing::warn!(
                map = name,
                pinned = current,
                configured = entries,
                "a pinned map keeps its size; `policy-agent reset` (or a new --pin-dir) applies the configured one"
            );
        }
    }
}

/// The ENDPOINT_META name of an interface carrying the pod classifiers
/// ahead of its pod.
pub fn standby_label(ifindex: u32) -> String {
    let name = super::attach::if_name(ifindex).unwrap_or_else(|_| format!("ifindex {ifindex}"));
    format!("standby {name}")
}

/// The name an uplink's ENDPOINT_META record carries.
pub fn uplink_label(ifindex: u32) -> String {
    let name = super::attach::if_name(ifindex).unwrap_or_else(|_| format!("ifindex {ifindex}"));
    format!("uplink {name}")
}

/// The ENDPOINT_META value for an interface.
pub fn endpoint_meta(name: &str, attach: u32) -> EndpointMeta {
    let mut meta = EndpointMeta {
        attach,
        name_len: 0,
        netns: current_netns(),
        name: [0; ENDPOINT_NAME_LEN],
    };
    let bytes = name.as_bytes();
    let n = bytes.len().min(ENDPOINT_NAME_LEN);
    meta.name[..n].copy_from_slice(&bytes[..n]);
    meta.name_len = n as u32;
    meta
}

/// The name an ENDPOINT_META value records (e.g. "namespace/pod").
pub fn endpoint_meta_name(meta: &EndpointMeta) -> String {
    let n = (meta.name_len as usize).min(meta.name.len());
    String::from_utf8_lossy(&meta.name[..n]).into_owned()
}

fn open_pinned(layout: &PinLayout) -> Result<Classifiers, Error> {
    let open = |hook: Hook| {
        let name = hook.program();
        SchedClassifier::from_pin(layout.program(name)).map_err(Error::program(name))
    };
    // Pinned only where the node has such a device.
    let open_if_pinned = |hook: Hook| -> Result<Option<SchedClassifier>, Error> {
        if layout.program(hook.program()).exists() {
            open(hook).map(Some)
        } else {
            Ok(None)
        }
    };
    Ok(Classifiers {
        from_pod: open(Hook::Ingress)?,
        to_pod: open(Hook::Egress)?,
        to_uplink: open(Hook::Uplink)?,
        from_uplink: open(Hook::UplinkIngress)?,
        to_uplink_l3: open_if_pinned(Hook::UplinkL3)?,
        from_uplink_l3: open_if_pinned(Hook::UplinkIngressL3)?,
    })
}
