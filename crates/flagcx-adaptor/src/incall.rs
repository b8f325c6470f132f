//! Which runtime call a watched thread is inside, and since when.
//!
//! A progress thread that stops taking steps is either off the CPU or inside a runtime call
//! that waits for something — on CUDA, say, `cuIpcOpenMemHandle` behind another thread's
//! synchronous copy. A stall message that names the call (and how long it has lasted) says
//! which; one that can only guess sends people after the wrong thread. So a thread that wants
//! to be watched registers a [`CallSlot`] ([`watch_this_thread`]), the GPU adaptors mark every
//! driver call with [`enter`], and a watcher reads the slot ([`CallSlot::current`]).
//!
//! Threads that registered nothing pay one thread-local read per call.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The call a watched thread is inside, if any.
#[derive(Debug, Default)]
pub struct CallSlot {
    now: Mutex<Option<(&'static str, Instant)>>,
}

impl CallSlot {
    /// A slot for a thread to register.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The call the thread is inside now and how long it has been, or `None` between calls.
    pub fn current(&self) -> Option<(&'static str, Duration)> {
        let now = *self.now.lock().unwrap_or_else(PoisonError::into_inner);
        now.map(|(name, since)| (name, since.elapsed()))
    }

    fn set(&self, v: Option<(&'static str, Instant)>) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = v;
    }
}

thread_local! {
    static SLOT: RefCell<Option<Arc<CallSlot>>> = const { RefCell::new(None) };
}

/// Makes the calling thread's runtime calls visible in `slot` (until the thread ends or
/// registers another).
pub fn watch_this_thread(slot: Arc<CallSlot>) {
    SLOT.with(|s| *s.borrow_mut() = Some(slot));
}

/// Makes the calling thread's runtime calls visible in `slot` until the returned guard drops
/// (a thread that runs a watched thread's work for a while: a waiter driving the engine).
pub fn watching(slot: &Arc<CallSlot>) -> Watching {
    let before = SLOT.with(|s| s.borrow_mut().replace(slot.clone()));
    Watching { before }
}

/// Restores the thread's earlier slot when dropped (see [`watching`]).
#[must_use = "the thread is watched only while the guard lives"]
pub struct Watching {
    before: Option<Arc<CallSlot>>,
}

impl Drop for Watching {
    fn drop(&mut self) {
        let before = self.before.take();
        SLOT.with(|s| *s.borrow_mut() = before);
    }
}

/// Marks the calling thread as inside runtime call `name` until the returned guard drops.
pub fn enter(name: &'static str) -> InCall {
    let watched = SLOT.with(|s| {
        s.borrow().as_ref().map(|slot| {
            slot.set(Some((name, Instant::now())));
        })
    });
    InCall {
        watched: watched.is_some(),
    }
}

/// Clears the thread's slot when dropped (see [`enter`]).
#[must_use = "the call is marked only while the guard lives"]
pub struct InCall {
    watched: bool,
}

impl Drop for InCall {
    fn drop(&mut self) {
        if self.watched {
            SLOT.with(|s| {
                if let Some(slot) = s.borrow().as_ref() {
                    slot.set(None);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_thread_shows_its_call_and_unwatched_ones_nothing() {
        let slot = CallSlot::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let s2 = slot.clone();
        let t = std::thread::spawn(move || {
            watch_this_thread(s2);
            let g = enter("cuIpcOpenMemHandle");
            tx.send(()).unwrap();
            go_rx.recv().unwrap();
            drop(g);
            tx.send(()).unwrap();
        });
        rx.recv().unwrap();
        let (name, _) = slot.current().expect("inside a call");
        assert_eq!(name, "cuIpcOpenMemHandle");
        go_tx.send(()).unwrap();
        rx.recv().unwrap();
        assert!(slot.current().is_none(), "the guard cleared the slot");
        t.join().unwrap();
        // This thread registered nothing: entering marks nothing anywhere.
        let g = enter("cuMemFree");
        assert!(!g.watched);
        assert!(slot.current().is_none());
        drop(g);
        // Watched for a while: marked inside, unmarked after.
        {
            let _w = watching(&slot);
            let _g = enter("cuEventRecord");
            assert_eq!(slot.current().map(|c| c.0), Some("cuEventRecord"));
        }
        let g = enter("cuEventRecord");
        assert!(!g.watched && slot.current().is_none());
    }
}
