//! The classifier programs through the verifier and into their pins.
//! The verifier's time is most of a first start: where nothing is
//! attached yet (no attachment to move over to the new programs), the
//! programs load in the background while the first compile runs and the
//! maps are written, and the first use of a program waits for them.
use std::{
    collections::BTreeMap,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use aya::programs::SchedClassifier;
use policy_common::{endpoint::EndpointMeta, maps as names};
use tracing::{debug, info, warn};

use super::{
    attach::Attachment,
    error::Error,
    loader::{Classifiers, PinnedClassifier, classifier, loader},
    object::{OBJECT, object_hash},
    pins::{Hook, PinLayout, remove_pin},
};

/// The programs of a [`PinnedClassifier`].
pub(super) enum Programs {
    Ready(Box<Classifiers>),
    /// Loading in the background (see [`load_in_background`]).
    Loading(JoinHandle<Result<Classifiers, Error>>),
    /// The last load failed (`at`, saying `why`): loaded again on a use
    /// [`RELOAD_AFTER`] later, not on every use (each load is a second of
    /// the verifier).
    Failed {
        at: Instant,
        why: String,
    },
}

/// How long after a failed load the programs are loaded again.
const RELOAD_AFTER: Duration = Duration::from_secs(5);

impl Programs {
    /// The program of `hook`, if loaded (see [`PinnedClassifier::programs`]
    /// to wait for it).
    pub(super) fn get_mut(&mut self, hook: Hook) -> Result<&mut SchedClassifier, Error> {
        match self {
            Self::Ready(c) => c.get_mut(hook),
            _ => Err(Error::MissingProgram(hook.program())),
        }
    }

    /// The kernel's id of the program of `hook`, if loaded.
    pub(super) fn id(&self, hook: Hook) -> Option<u32> {
        match self {
            Self::Ready(c) => c.id(hook),
            _ => None,
        }
    }

    pub(super) fn ready(&mut self) -> Option<&mut Classifiers> {
        match self {
            Self::Ready(c) => Some(c),
            _ => None,
        }
    }
}

/// Loads the object's programs from `ebpf` on a thread of their own and
/// pins them. Only where nothing is attached: an interface's attachment
/// would otherwise run the old programs against maps written for the new.
pub(super) fn load_in_background(
    layout: PinLayout,
    mut ebpf: aya::Ebpf,
) -> Result<Programs, Error> {
    info!(pins = %layout.progs_dir().display(), "loading classifier programs in the background");
    let path = layout.progs_dir();
    std::thread::Builder::new()
        .name("load".into())
        .spawn(move || load_and_pin(&layout, &mut ebpf, &BTreeMap::new()))
        .map(Programs::Loading)
        .map_err(|source| Error::Io {
            what: "starting the thread that loads the programs pinned under",
            path,
            source,
        })
}

/// Loads every program of `ebpf` the node uses, moves the attachments
/// `meta` records over to them (so no interface is ever without a
/// program), pins them in place of the old ones and opens the pins.
pub(super) fn load_and_pin(
    layout: &PinLayout,
    ebpf: &mut aya::Ebpf,
    meta: &BTreeMap<u32, EndpointMeta>,
) -> Result<Classifiers, Error> {
    load_in_parallel(ebpf)?;
    for hook in Hook::ALL {
        let name = hook.program();
        let path = layout.program(name);
        if !Hook::CORE.contains(&hook) {
            // In use only where the previous object pinned it.
            if !path.exists() {
                continue;
            }
            classifier(ebpf, name)?
                .load()
                .map_err(Error::program(name))?;
        }
        let prog = classifier(ebpf, name)?;
        for (ifindex, m) in meta {
            Attachment::new(layout, *ifindex, m.attach).replace_program(prog, hook)?;
        }
        remove_pin(&path)?;
        prog.pin(&path).map_err(|e| Error::Pin {
            path: path.clone(),
            source: Box::new(e),
        })?;
    }
    Classifiers::open_pinned(layout)
}

impl PinnedClassifier {
    /// Waits until the programs are loaded and pinned (at once unless a
    /// first start loads them in the background).
    pub fn wait_for_programs(&mut self) -> Result<(), Error> {
        self.programs().map(|_| ())
    }

    /// The programs, once loaded: waits for a background load, and loads
    /// again after one that failed. The object's hash is recorded once its
    /// programs are pinned (a later start reuses them).
    pub(super) fn programs(&mut self) -> Result<&mut Classifiers, Error> {
        let failed = |why: String| Programs::Failed {
            at: Instant::now(),
            why,
        };
        let loaded = match std::mem::replace(&mut self.programs, failed(String::new())) {
            Programs::Ready(c) => Ok(c),
            Programs::Loading(handle) => handle
                .join()
                .unwrap_or_else(|_| Err(Error::NotLoaded("the loading thread panicked".into())))
                .and_then(|c| self.record_hash().map(|()| Box::new(c))),
            Programs::Failed { at, why } if at.elapsed() < RELOAD_AFTER => {
                self.programs = Programs::Failed {
                    at,
                    why: why.clone(),
                };
                return Err(Error::NotLoaded(why));
            }
            Programs::Failed { .. } => self
                .load_again()
                .and_then(|c| self.record_hash().map(|()| Box::new(c))),
        };
        match loaded {
            Ok(c) => {
                self.programs = Programs::Ready(c);
                match &mut self.programs {
                    Programs::Ready(c) => Ok(c),
                    _ => Err(Error::NotLoaded(String::new())),
                }
            }
            Err(e) => {
                warn!(error = %e, "the classifier programs did not load; trying again in {RELOAD_AFTER:?}");
                self.programs = failed(e.to_string());
                Err(e)
            }
        }
    }

    /// Waits for a background load, so no thread pins programs after
    /// their owner is gone (a caller that removes the pins next would
    /// leave the late ones behind).
    fn finish_loading(&mut self) {
        if matches!(self.programs, Programs::Loading(_)) {
            let _ = self.programs();
        }
    }

    /// Records that the pinned programs are this object's (a later start
    /// reuses them).
    fn record_hash(&mut self) -> Result<(), Error> {
        let mut config = self.maps.config()?;
        config.object_hash = object_hash();
        self.maps.set_config(config)
    }

    /// The object again, its maps from their pins, its programs through
    /// the verifier.
    fn load_again(&mut self) -> Result<Classifiers, Error> {
        let mut ebpf = self.object_over_pins()?;
        let meta = self.maps.read_meta()?;
        load_and_pin(&self.layout, &mut ebpf, &meta)
    }

    /// The object again, its maps opened from their pins (its programs
    /// not loaded yet).
    pub(super) fn object_over_pins(&self) -> Result<aya::Ebpf, Error> {
        let paths: Vec<(&'static str, std::path::PathBuf)> = names::ALL
            .iter()
            .map(|n| (*n, self.layout.map(n)))
            .collect();
        loader(&[], &paths).load(OBJECT).map_err(|e| Error::Load {
            pins: self.layout.maps_dir(),
            source: Box::new(e),
        })
    }
}

/// Loads one classifier. The verifier gives up (EAGAIN, its log ending
/// without a violation) when a signal is pending for the loading thread,
/// and a verification takes most of a second under load: signals are
/// blocked in this thread while it runs (the process's other threads take
/// them), and a load still interrupted is tried again, twice at most. A
/// rejection is not tried again.
pub(super) fn load_classifier(prog: &mut SchedClassifier, name: &'static str) -> Result<(), Error> {
    const ATTEMPTS: usize = 3;
    let mut attempt = 1;
    loop {
        let loaded = {
            let _blocked = SignalsBlocked::new();
            prog.load()
        };
        match loaded {
            Ok(()) => return Ok(()),
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if attempt < ATTEMPTS
                    && matches!(io_error.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) =>
            {
                warn!(program = name, attempt, error = %io_error, "verification interrupted, loading again");
                attempt += 1;
            }
            Err(e) => return Err(Error::program(name)(e)),
        }
    }
}

/// Every blockable signal blocked in this thread until dropped.
struct SignalsBlocked {
    old: libc::sigset_t,
    ok: bool,
}

impl SignalsBlocked {
    fn new() -> Self {
        // SAFETY: sigset_t is plain data; both sets are valid for the
        // calls, which only read `all` and write `old`.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let ok = libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) == 0;
            Self { old, ok }
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        if self.ok {
            // SAFETY: restores the mask read by `new` in this same thread.
            unsafe {
                libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
            }
        }
    }
}

/// Loads the four classifiers into the kernel at once, one thread each:
/// the verifier's time is a large part of an agent's first start, and the
/// programs do not depend on each other.
fn load_in_parallel(ebpf: &mut aya::Ebpf) -> Result<(), Error> {
    let t = std::time::Instant::now();
    let wanted: Vec<&'static str> = Hook::CORE.iter().map(|h| h.program()).collect();
    let mut progs: Vec<(&'static str, &mut SchedClassifier)> = Vec::new();
    for (name, prog) in ebpf.programs_mut() {
        let Some(name) = wanted.iter().find(|w| **w == name) else {
            continue;
        };
        progs.push((name, prog.try_into().map_err(Error::program(name))?));
    }
    if let Some(missing) = wanted.iter().find(|w| !progs.iter().any(|(n, _)| n == *w)) {
        return Err(Error::MissingProgram(missing));
    }
    let results: Vec<Result<(), Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = progs
            .into_iter()
            .map(|(name, prog)| scope.spawn(move || load_classifier(prog, name)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.into_iter().collect::<Result<(), Error>>()?;
    debug!(
        took_ms = t.elapsed().as_millis() as u64,
        "classifier programs loaded"
    );
    Ok(())
}

impl Drop for PinnedClassifier {
    fn drop(&mut self) {
        self.finish_loading();
    }
}
