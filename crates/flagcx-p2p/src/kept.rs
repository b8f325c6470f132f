//! The buffers a finished operation held the last reference to: freed at rest, never by the
//! progress thread while a stream may wait for it.
//!
//! The safe API's `send`/`recv` keep the caller's buffer alive until the operation finishes
//! ([`Keep`]). Where the caller dropped its own reference first, the operation's is the last,
//! and dropping it frees device memory. On CUDA `cuMemFree` holds the driver's process-wide
//! lock until every stream of the device is idle — including the caller's stream joined to
//! this very operation, which the progress thread releases only after the drop: the engine
//! would wait for itself for good (found on host ranks with `FLAGCX_HOST_FREE_SYNC=1`, which
//! frees as CUDA does: the free waited out its 60 s bound). So such a reference is held here
//! and dropped by [`crate::engine::Engine::trim_at_rest`] with nothing in flight, as stale IPC
//! mappings are closed, or at teardown.

use std::sync::Arc;

/// What keeps an operation's buffer alive: the caller's `Arc` of it.
pub(crate) type Keep = Arc<dyn std::any::Any + Send + Sync>;

/// How many last references, or how many bytes of their operations, are held before they are
/// freed at rest even beside another communicator of the process that joins streams (as the
/// IPC cache closes past its bound).
pub(crate) const KEPT_MAX: usize = 256;
/// See [`KEPT_MAX`].
pub(crate) const KEPT_MAX_BYTES: usize = 256 << 20;

/// Last references of finished operations, not yet dropped.
#[derive(Default)]
pub(crate) struct Kept {
    held: Vec<Keep>,
    /// The held operations' bytes.
    bytes: usize,
}

impl Kept {
    /// Takes a finished operation's reference (its message: `bytes`): dropped now where others
    /// remain (that only counts down), held where it is the last one.
    pub(crate) fn take(&mut self, keep: Option<Keep>, bytes: usize) {
        if let Some(k) = keep.filter(|k| Arc::strong_count(k) == 1) {
            self.held.push(k);
            self.bytes = self.bytes.saturating_add(bytes);
        }
    }

    /// Whether to free at the next rest: something is held, and no other communicator of the
    /// process joins streams (`alone`) or more than [`KEPT_MAX`] references or
    /// [`KEPT_MAX_BYTES`] are held.
    pub(crate) fn due(&self, alone: bool) -> bool {
        !self.held.is_empty()
            && (alone || self.held.len() > KEPT_MAX || self.bytes > KEPT_MAX_BYTES)
    }

    /// Drops every held reference (the caller made sure no stream waits for this
    /// communicator); how many there were.
    pub(crate) fn release(&mut self) -> usize {
        let n = self.held.len();
        self.held.clear();
        self.bytes = 0;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_last_references_are_held_until_released() {
        let mut kept = Kept::default();
        let shared: Keep = Arc::new(vec![1u8; 4]);
        let mine = shared.clone();
        kept.take(Some(shared), 4);
        assert!(
            !kept.due(true),
            "another reference remained: dropped at once"
        );
        assert_eq!(Arc::strong_count(&mine), 1);
        kept.take(Some(mine), 4);
        kept.take(None, 4);
        assert!(kept.due(true));
        assert!(
            !kept.due(false),
            "beside another joining communicator: below the bounds"
        );
        for _ in 0..KEPT_MAX {
            kept.take(Some(Arc::new(0u32)), 4);
        }
        assert!(kept.due(false), "past the count bound");
        assert_eq!(kept.release(), KEPT_MAX + 1);
        assert!(!kept.due(true));
        kept.take(Some(Arc::new(0u8)), KEPT_MAX_BYTES);
        assert!(!kept.due(false), "at the byte bound");
        kept.take(Some(Arc::new(0u8)), 1);
        assert!(kept.due(false), "past the byte bound");
    }
}
