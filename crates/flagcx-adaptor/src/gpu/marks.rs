//! Events as words in pinned host memory that the stream writes: recording is one 64-bit stream
//! write, completion one load, a stream's wait one stream wait on the word.
//!
//! Why not the runtime's events: on CUDA, while any thread of the process sits in a copy from
//! device memory into *pageable* host memory (a client reading a result with a plain
//! `cudaMemcpy`, torch's `tensor.cpu()`), `cuEventCreate`, `cuEventRecord`, `cuEventQuery`,
//! `cuLaunchHostFunc`, allocations and host registrations in every other thread of the process
//! wait until that copy finished (measured on an H100, driver 580; stream writes and waits,
//! `cuStreamQuery`, asynchronous copies and `cuIpcOpenMemHandle` go through). When that copy
//! is queued behind a communication operation, whose completion a progress thread finds by
//! querying events, the process deadlocks: the copy waits for the operation, the operation for
//! the progress thread, the progress thread for the copy. With marks the progress thread makes
//! no such call.
//!
//! A mark's word only ever grows: every recording takes the next value of one counter per
//! adaptor, so "complete" is `word >= generation`, and an unrecorded mark (generation 0) is
//! complete, as an unrecorded event is. Recording again on another stream while an earlier
//! recording is still pending moves the mark to a fresh word (the earlier write may land
//! later and would otherwise hide the newer one's generation); a word whose last write has not
//! landed is reused only once it has (`retiring`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::Result;

/// Handles of marks carry this in their top bits; the runtime's event handles are pointers
/// into its heap and never do.
pub(super) const MARK_TAG: u64 = 0xF1A6 << 48;

/// Words per slab (one 32 KiB registration).
pub(super) const SLAB_WORDS: usize = 4096;

/// A registered array of [`SLAB_WORDS`] words: where the CPU reads them and the address the
/// device writes.
pub(super) struct Slab {
    pub(super) host: *mut AtomicU64,
    pub(super) device: u64,
}

// SAFETY: the slab is plain memory shared by the threads through atomics; the pointer stays
// valid for the life of the table that owns it (released by its owner at teardown).
unsafe impl Send for Slab {}

/// One mark: the word it uses, the generation of its last recording (0: never recorded) and
/// the stream of that recording.
#[derive(Debug, Clone, Copy)]
struct Mark {
    word: usize,
    gen: u64,
    stream: u64,
}

/// A recording chosen under the table's lock and enqueued outside it
/// ([`Marks::begin_record`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    word: usize,
    pub(super) device: u64,
    pub(super) gen: u64,
    stream: u64,
    /// The mark moves to `word` from a word whose write is still out.
    moving: bool,
}

/// A recorded mark that has not completed: the word's device address and the value it will
/// reach, and the stream that writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pending {
    pub(super) device: u64,
    pub(super) gen: u64,
    pub(super) stream: u64,
}

/// Every mark of one adaptor.
#[derive(Default)]
pub(super) struct Marks {
    slabs: Vec<Slab>,
    free: Vec<usize>,
    live: HashMap<u64, Mark>,
    /// Words whose last pending write brings them to the given value; free once it has.
    retiring: Vec<(usize, u64)>,
    next_handle: u64,
    gen: u64,
    /// When a query last asked the runtime about a pending mark's stream.
    checked: Option<std::time::Instant>,
}

impl Marks {
    fn word(&self, w: usize) -> &AtomicU64 {
        let slab = &self.slabs[w / SLAB_WORDS];
        // SAFETY: `w % SLAB_WORDS` is inside the slab, which lives as long as `self`.
        unsafe { &*slab.host.add(w % SLAB_WORDS) }
    }

    fn device(&self, w: usize) -> u64 {
        self.slabs[w / SLAB_WORDS].device + 8 * (w % SLAB_WORDS) as u64
    }

    fn reached(&self, w: usize, gen: u64) -> bool {
        self.word(w).load(Ordering::Acquire) >= gen
    }

    /// Frees the retiring words whose last write landed.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.retiring.len() {
            let (w, g) = self.retiring[i];
            if self.reached(w, g) {
                self.free.push(w);
                self.retiring.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// A free word; none is an error: the table grows ([`Marks::add_slab`]) before the caller
    /// locks it, never under the lock.
    fn take(&mut self) -> Result<usize> {
        if self.free.is_empty() {
            self.reap();
        }
        self.free.pop().ok_or_else(|| {
            crate::AdaptorError::invalid(
                "event_create",
                "no free event word (the table grows before it is locked)",
            )
        })
    }

    /// Whether no word is free (after freeing the retiring words whose write landed): the
    /// caller grows the table ([`Marks::add_slab`]) before it creates or records, outside
    /// the table's lock — registering memory is a runtime call that may wait.
    ///
    /// The retiring words are scanned only once the free list ran out, and a scan that frees
    /// fewer than one in eight of them counts as full (the table grows): with thousands of
    /// operations enqueued ahead of the device, every word retires pending, and a scan on
    /// each create or record — under the lock every query takes — held the lock so long that
    /// a posting thread creating marks in a loop starved the progress thread of it (two CUDA
    /// ranks' ten enqueued 128 MiB all-reduces stopped on an H100).
    pub(super) fn full(&mut self) -> bool {
        if self.free.is_empty() {
            let before = self.retiring.len();
            self.reap();
            return self.free.len() * 8 < before.max(1);
        }
        false
    }

    /// Adds a slab's words to the free list.
    pub(super) fn add_slab(&mut self, slab: Slab) {
        let first = self.slabs.len() * SLAB_WORDS;
        self.slabs.push(slab);
        self.free.extend((first..first + SLAB_WORDS).rev());
    }

    /// A new mark's handle (never recorded: complete).
    pub(super) fn create(&mut self) -> Result<u64> {
        let word = self.take()?;
        self.next_handle += 1;
        let h = MARK_TAG | self.next_handle;
        self.live.insert(
            h,
            Mark {
                word,
                gen: 0,
                stream: 0,
            },
        );
        Ok(h)
    }

    /// Whether `h` is a mark of this table.
    #[cfg(test)]
    pub(super) fn owns(&self, h: u64) -> bool {
        h & MARK_TAG == MARK_TAG && self.live.contains_key(&h)
    }

    /// Records mark `h` on `stream`: `write(device address, value)` enqueues the stream's
    /// write; if it fails the mark keeps its earlier recording. ([`Marks::begin_record`] and
    /// [`Marks::finish_record`] with the write between them, in one call.)
    #[cfg(test)]
    pub(super) fn record(
        &mut self,
        h: u64,
        stream: u64,
        write: impl FnOnce(u64, u64) -> Result<()>,
    ) -> Result<()> {
        let p = self.begin_record(h, stream)?;
        let r = write(p.device, p.gen);
        self.finish_record(h, p, r.is_ok());
        r
    }

    /// The word and value of a new recording of mark `h` on `stream`, for the caller to
    /// enqueue the stream's write with the table unlocked (the write is a runtime call that
    /// blocks while the stream's queue is full, which can take as long as the device needs to
    /// reach a wait that the progress thread, querying marks, must release) and then to
    /// commit with [`Marks::finish_record`].
    pub(super) fn begin_record(&mut self, h: u64, stream: u64) -> Result<Planned> {
        let m = *self.live.get(&h).ok_or_else(|| {
            crate::AdaptorError::invalid("event_record", "the mark was destroyed")
        })?;
        let moving = m.gen != 0 && m.stream != stream && !self.reached(m.word, m.gen);
        let word = if moving { self.take()? } else { m.word };
        self.gen += 1;
        Ok(Planned {
            word,
            device: self.device(word),
            gen: self.gen,
            stream,
            moving,
        })
    }

    /// Commits recording `p` of mark `h` once its write was enqueued (`ok`), or gives its
    /// word back where the write failed (the mark keeps its earlier recording).
    pub(super) fn finish_record(&mut self, h: u64, p: Planned, ok: bool) {
        if !ok {
            if p.moving {
                self.free.push(p.word);
            }
            return;
        }
        match self.live.get(&h).copied() {
            // A later recording committed meanwhile (two threads recording one mark): that
            // one stays; this one's word, if its own, retires once its write landed.
            Some(m) if m.gen > p.gen => {
                if p.moving {
                    self.retiring.push((p.word, p.gen));
                }
            }
            Some(m) => {
                if p.moving {
                    self.retiring.push((m.word, m.gen));
                }
                self.live.insert(
                    h,
                    Mark {
                        word: p.word,
                        gen: p.gen,
                        stream: p.stream,
                    },
                );
            }
            // Destroyed meanwhile: the word is not reused before this write landed.
            None => self.hold(p.word, p.gen),
        }
    }

    /// Keeps `word` from reuse until it reached `gen`.
    fn hold(&mut self, word: usize, gen: u64) {
        if let Some(r) = self.retiring.iter_mut().find(|(w, _)| *w == word) {
            r.1 = r.1.max(gen);
            return;
        }
        self.free.retain(|&w| w != word);
        self.retiring.push((word, gen));
    }

    /// The last recording of `h` if it has not completed.
    pub(super) fn pending(&self, h: u64) -> Option<Pending> {
        let m = self.live[&h];
        (!self.reached(m.word, m.gen)).then(|| Pending {
            device: self.device(m.word),
            gen: m.gen,
            stream: m.stream,
        })
    }

    /// Whether a pending mark's query should ask the runtime whether its stream failed: at
    /// most once per `every` across the table (a faulted context never writes the word, where
    /// the runtime's event query would have returned its error).
    pub(super) fn fault_check_due(&mut self, every: std::time::Duration) -> bool {
        let now = std::time::Instant::now();
        match self.checked {
            Some(t) if now.duration_since(t) < every => false,
            _ => {
                self.checked = Some(now);
                true
            }
        }
    }

    /// Whether `pending` (from [`Marks::pending`]) has completed since.
    pub(super) fn landed(&self, h: u64, pending: Pending) -> bool {
        match self.live.get(&h) {
            Some(m) if m.gen == pending.gen => self.reached(m.word, m.gen),
            // Recorded again or destroyed meanwhile: that recording is not ours to wait for.
            _ => true,
        }
    }

    /// Forgets mark `h`; its word is reused once its last write landed.
    pub(super) fn destroy(&mut self, h: u64) {
        if let Some(m) = self.live.remove(&h) {
            if self.reached(m.word, m.gen) {
                self.free.push(m.word);
            } else {
                self.retiring.push((m.word, m.gen));
            }
        }
    }

    /// The slabs, for their owner to release at teardown.
    pub(super) fn drain_slabs(&mut self) -> Vec<Slab> {
        self.live.clear();
        self.free.clear();
        self.retiring.clear();
        std::mem::take(&mut self.slabs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slab in plain memory, where the test plays the device by storing into the words.
    fn slab(keep: &mut Vec<Box<[AtomicU64]>>) -> Result<Slab> {
        let mut words: Box<[AtomicU64]> = (0..SLAB_WORDS).map(|_| AtomicU64::new(0)).collect();
        let host = words.as_mut_ptr();
        keep.push(words);
        Ok(Slab {
            host,
            device: host as u64,
        })
    }

    /// A new mark, growing the table first where it is full (as `GpuAdaptor::with_free_word`).
    fn grown(m: &mut Marks, keep: &mut Vec<Box<[AtomicU64]>>) -> u64 {
        if m.full() {
            m.add_slab(slab(keep).unwrap());
        }
        m.create().unwrap()
    }

    /// The device's write of `value` at `device`.
    fn land(device: u64, value: u64) {
        // SAFETY: `device` is an address of a slab the test keeps alive (device == host here).
        unsafe { (*(device as *const AtomicU64)).store(value, Ordering::Release) };
    }

    #[test]
    fn unrecorded_is_complete_and_a_recording_completes_when_its_write_lands() {
        let mut keep = Vec::new();
        let mut m = Marks::default();
        let h = grown(&mut m, &mut keep);
        assert!(m.owns(h) && !m.owns(h + 1) && !m.owns(0x7f00_1234_5678));
        assert_eq!(m.pending(h), None);
        let mut wrote = None;
        m.record(h, 1, |d, g| {
            wrote = Some((d, g));
            Ok(())
        })
        .unwrap();
        let (d, g) = wrote.unwrap();
        let p = m.pending(h).expect("pending until the write lands");
        assert_eq!((p.device, p.gen, p.stream), (d, g, 1));
        land(d, g);
        assert_eq!(m.pending(h), None);
        assert!(m.landed(h, p));
    }

    #[test]
    fn a_new_recording_on_another_stream_moves_off_a_pending_word() {
        let mut keep = Vec::new();
        let mut m = Marks::default();
        let h = grown(&mut m, &mut keep);
        let mut w = vec![];
        let mut rec = |m: &mut Marks, s| {
            m.record(h, s, |d, g| {
                w.push((d, g));
                Ok(())
            })
            .unwrap()
        };
        rec(&mut m, 1);
        rec(&mut m, 2);
        let (first, second) = (w[0], w[1]);
        assert_ne!(
            first.0, second.0,
            "a pending word is not shared by two streams"
        );
        // The second stream finishes first, then the first's stale write lands: the mark
        // follows its last recording only.
        land(second.0, second.1);
        assert_eq!(m.pending(h), None);
        // The old word is not reused while its write is out.
        let other = m.create().unwrap();
        let mut got = 0;
        m.record(other, 3, |d, _| {
            got = d;
            Ok(())
        })
        .unwrap();
        assert_ne!(got, first.0);
        land(first.0, first.1);
        m.destroy(other);
        m.reap();
        assert!(m
            .free
            .contains(&((first.0 - keep[0].as_ptr() as u64) as usize / 8)));
    }

    #[test]
    fn the_same_stream_keeps_its_word_and_a_failed_write_keeps_the_old_recording() {
        let mut keep = Vec::new();
        let mut m = Marks::default();
        let h = grown(&mut m, &mut keep);
        let mut w = vec![];
        for _ in 0..2 {
            m.record(h, 5, |d, g| {
                w.push((d, g));
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(w[0].0, w[1].0);
        assert!(w[1].1 > w[0].1);
        let before = m.pending(h).unwrap();
        let err = m.record(h, 6, |_, _| {
            Err(crate::AdaptorError::invalid("test", "refused"))
        });
        assert!(err.is_err());
        assert_eq!(m.pending(h), Some(before));
    }

    #[test]
    fn a_table_grown_before_locking_never_grows_under_its_lock() {
        let mut keep = Vec::new();
        let mut m = Marks::default();
        assert!(m.full(), "an empty table has no free word");
        m.add_slab(slab(&mut keep).unwrap());
        assert!(!m.full());
        for _ in 0..SLAB_WORDS {
            m.create().unwrap();
        }
        assert!(m.full(), "every word taken");
        assert!(
            m.create().is_err(),
            "a full table does not grow under its lock"
        );
    }

    #[test]
    fn fault_checks_come_at_most_once_per_period() {
        let mut m = Marks::default();
        let every = std::time::Duration::from_secs(3600);
        assert!(m.fault_check_due(every));
        assert!(!m.fault_check_due(every));
        assert!(m.fault_check_due(std::time::Duration::ZERO));
    }

    #[test]
    fn a_full_slab_grows_and_destroyed_pending_words_wait_for_their_write() {
        let mut keep = Vec::new();
        let mut m = Marks::default();
        let hs: Vec<u64> = (0..SLAB_WORDS + 1)
            .map(|_| grown(&mut m, &mut keep))
            .collect();
        assert_eq!(keep.len(), 2, "the 4097th mark took a second slab");
        let h = hs[0];
        let mut at = (0, 0);
        m.record(h, 1, |d, g| {
            at = (d, g);
            Ok(())
        })
        .unwrap();
        m.destroy(h);
        assert_eq!(m.retiring, vec![(0, at.1)]);
        land(at.0, at.1);
        m.reap();
        assert!(m.retiring.is_empty() && m.free.contains(&0));
    }
}
