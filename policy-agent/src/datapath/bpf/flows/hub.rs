//! The live subscribers' queues: the flow thread never waits for a
//! subscriber. Each has a bounded queue; a record that finds it full is
//! lost for that subscriber and counted.
use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
    mpsc::{Receiver, SyncSender, TrySendError, sync_channel},
};

/// The most subscribers at once.
pub const MAX_SUBSCRIBERS: usize = 8;
/// Lines a subscriber may have waiting.
pub const QUEUE: usize = 4096;

/// One line of newline-delimited JSON, shared by every queue.
pub type Line = Arc<str>;

#[derive(Default)]
pub struct Hub {
    subscribers: Mutex<Vec<SyncSender<Line>>>,
    lost: AtomicU64,
}

impl Hub {
    /// A new subscriber's queue, with [`QUEUE`] lines of room (None: at
    /// [`MAX_SUBSCRIBERS`] already).
    pub fn subscribe(&self) -> Option<Receiver<Line>> {
        self.subscribe_with(QUEUE)
    }

    /// [`Self::subscribe`] with a queue of `room` lines.
    pub fn subscribe_with(&self, room: usize) -> Option<Receiver<Line>> {
        let mut subs = self.subscribers.lock().ok()?;
        if subs.len() >= MAX_SUBSCRIBERS {
            return None;
        }
        let (tx, rx) = sync_channel(room);
        subs.push(tx);
        Some(rx)
    }

    /// Whether anyone listens (the flow thread then skips encoding).
    pub fn is_empty(&self) -> bool {
        self.subscribers.lock().map_or(true, |s| s.is_empty())
    }

    pub fn subscribers(&self) -> usize {
        self.subscribers.lock().map_or(0, |s| s.len())
    }

    /// Queues `line` for every subscriber; a full queue loses it, a gone
    /// subscriber is forgotten.
    pub fn publish(&self, line: &Line) {
        let Ok(mut subs) = self.subscribers.lock() else {
            return;
        };
        subs.retain(|tx| match tx.try_send(line.clone()) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.lost.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        });
    }

    /// Lines lost to full queues so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }
}
