//! Stand-ins: buffers of our own that an IPC pair exports in place of memory the runtime has
//! no handle for.
//!
//! On an IPC pair one side names its buffer to the other (the receiver when the sender copies,
//! the sender when the receiver pulls), by the IPC handle of the allocation holding it. Not
//! all device memory has one: CUDA's stream-ordered pools (`cudaMallocAsync`, torch's
//! `backend:cudaMallocAsync`) and VMM allocations made without a shareable handle type refuse
//! `cuIpcGetMemHandle`. Such a message goes through a stand-in: an allocation of this
//! communicator, exportable, that the sender fills from its buffer before offering it, or that
//! the receiver announces and copies into its buffer once the data is there — one
//! device-to-device copy more on that side, the same bytes.
//!
//! Stand-ins are taken by the posting thread, which may call the runtime's allocator (the
//! progress thread never does: on CUDA an allocation waits while any thread of the process
//! copies into pageable memory, and such a copy may wait for this very operation). A
//! stand-in goes back to the pool when its operation succeeded; one whose operation failed
//! may still be written by the peer's copy engine, so it stays aside until the communicator
//! is destroyed. Pool sizes are powers of two, at least [`MIN_STAND_IN`]; all are freed with
//! the communicator.

use std::sync::{Arc, Mutex};

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr};

use crate::error::Result;

/// The smallest stand-in allocated: small messages reuse one allocation.
pub(crate) const MIN_STAND_IN: usize = 1 << 20;

/// A communicator's stand-ins.
#[derive(Debug, Default)]
pub(crate) struct StandIns {
    /// Free stand-ins: `(address, bytes)`.
    free: Vec<(DevicePtr, usize)>,
    /// Every stand-in allocated, freed at teardown.
    all: Vec<(DevicePtr, usize)>,
}

/// A stand-in lent to one operation; back in the pool when dropped after [`StandIn::done`] or
/// before it was ever named to the peer ([`StandIn::expose`]: a message that went another way,
/// eagerly at a group's end), else kept aside until teardown.
#[derive(Debug)]
pub(crate) struct StandIn {
    pub(crate) ptr: DevicePtr,
    len: usize,
    /// Sender: the copy from the caller's buffer into the stand-in completed.
    pub(crate) filled: bool,
    /// The operation succeeded: nobody touches the stand-in any more.
    done: bool,
    /// Named to the peer (announced or offered): its copy engine may touch it.
    exposed: bool,
    pool: Arc<Mutex<StandIns>>,
}

impl StandIn {
    /// The operation succeeded; the stand-in may serve the next one.
    pub(crate) fn done(&mut self) {
        self.done = true;
    }

    /// The stand-in is about to be named to the peer; returns its address.
    pub(crate) fn expose(&mut self) -> DevicePtr {
        self.exposed = true;
        self.ptr
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if self.done || !self.exposed {
            lock(&self.pool).free.push((self.ptr, self.len));
        }
    }
}

/// Takes a stand-in of at least `bytes` from `pool`, allocating one (a power of two, at least
/// [`MIN_STAND_IN`]) where none free is large enough.
pub(crate) fn take<A: DeviceAdaptor>(
    pool: &Arc<Mutex<StandIns>>,
    a: &A,
    bytes: usize,
) -> Result<StandIn> {
    let mut g = lock(pool);
    let best = g
        .free
        .iter()
        .enumerate()
        .filter(|(_, &(_, len))| len >= bytes)
        .min_by_key(|(_, &(_, len))| len)
        .map(|(i, _)| i);
    let (ptr, len) = match best {
        Some(i) => g.free.swap_remove(i),
        None => {
            let len = bytes.max(MIN_STAND_IN).next_power_of_two();
            let ptr = a.mem_alloc(len)?;
            g.all.push((ptr, len));
            (ptr, len)
        }
    };
    Ok(StandIn {
        ptr,
        len,
        filled: false,
        done: false,
        exposed: false,
        pool: pool.clone(),
    })
}

/// Frees every stand-in of `pool` (the communicator is going away and its operations ended).
pub(crate) fn release<A: DeviceAdaptor>(pool: &Mutex<StandIns>, a: &A) {
    let mut g = lock(pool);
    g.free.clear();
    for (ptr, _) in g.all.drain(..) {
        // SAFETY: allocated by `take`; every operation that used it ended (the proxy was
        // joined) and a peer's mapping keeps its own reference to the memory.
        let _ = unsafe { a.mem_free(ptr) };
    }
}

/// Bytes the pool holds, free and lent ([`crate::PathStats::stand_in_bytes`]).
pub(crate) fn held(pool: &Mutex<StandIns>) -> usize {
    lock(pool).all.iter().map(|&(_, l)| l).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> flagcx_host::HostAdaptor {
        flagcx_host::HostAdaptor::open(0).expect("the host vendor")
    }

    #[test]
    fn stand_ins_are_reused_after_success_and_kept_aside_after_failure() {
        let a = host();
        let pool = Arc::new(Mutex::new(StandIns::default()));
        let mut s = take(&pool, &a, 3 << 20).unwrap();
        assert_eq!(s.len, 4 << 20, "a power of two");
        let first = s.ptr;
        s.done();
        drop(s);
        // A smaller message reuses it.
        let t = take(&pool, &a, 100).unwrap();
        assert_eq!(t.ptr, first);
        // Dropped unused (never named to the peer): back in the pool.
        drop(t);
        let mut t = take(&pool, &a, 100).unwrap();
        assert_eq!(t.ptr, first);
        // Named to the peer, then dropped without success: kept aside, so the next take
        // allocates anew.
        t.expose();
        drop(t);
        let u = take(&pool, &a, 100).unwrap();
        assert_ne!(u.ptr, first);
        assert_eq!(u.len, MIN_STAND_IN);
        assert_eq!(held(&pool), (4 << 20) + MIN_STAND_IN);
        drop(u);
        release(&pool, &a);
        assert_eq!(held(&pool), 0);
    }
}
