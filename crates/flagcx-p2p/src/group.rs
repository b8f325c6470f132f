//! Groups and the hand-over of operations to the proxy: what `Comm::group_end` does with a
//! group (its eager moves, then the rest to the engine) and how streams are made to wait.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use flagcx_adaptor::{DeviceAdaptor, StreamHandle};

use crate::channel::Counter;
use crate::comm::Comm;
use crate::error::{CommError, Result};
use crate::op::{Dir, Op, Resume};
use flagcx_adaptor::tracking::lock;

impl<A: DeviceAdaptor> Comm<A> {
    /// Runs `f`, posting its operations together: they progress at once and each stream waits
    /// once for all of them. Use it for exchanges in both directions.
    pub fn group<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.group_begin()?;
        let r = f();
        let submitted = self.group_end();
        let t = r?;
        submitted?;
        Ok(t)
    }

    /// Opens a group explicitly (for callers that cannot pass a closure, like the C ABI's
    /// `flagcxGroupStart`): operations this thread posts until it calls [`Comm::group_end`]
    /// progress together. A group belongs to the thread that opened it, as NCCL's do: other
    /// threads' posts meanwhile are not part of it. Groups do not nest.
    pub fn group_begin(&self) -> Result<()> {
        let mut g = lock(&self.group);
        match g.entry(crate::posting::thread_number()) {
            Entry::Occupied(_) => Err(CommError::InvalidArgument("groups do not nest".into())),
            Entry::Vacant(v) => {
                // Room for a send and a receive to every peer: one allocation for a
                // collective's group.
                v.insert(Vec::with_capacity(2 * self.nranks()));
                Ok(())
            }
        }
    }

    /// Closes the group this thread opened with [`Comm::group_begin`] and hands its operations
    /// over, after moving its small messages itself where the pairs have eager slots (sends
    /// first; then it waits up to the spin time for the group's eager receives). Collectives
    /// posted inside the group that cannot join it (the reductions, made of dependent steps)
    /// are enqueued now, after its point-to-point operations, in the order they were posted;
    /// the first failure of any of them is the result.
    pub fn group_end(&self) -> Result<()> {
        let ended = self.group_end_then(true, || Ok(false));
        let later = lock(&self.deferred)
            .remove(&crate::posting::thread_number())
            .unwrap_or_default();
        let mut first = ended.err();
        for post in later {
            if let Err(e) = post(self) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Whether this thread has a group open.
    pub(crate) fn in_group(&self) -> bool {
        lock(&self.group).contains_key(&crate::posting::thread_number())
    }

    /// Keeps `post` for this thread's [`Comm::group_end`] (a group is open).
    pub(crate) fn defer(&self, post: crate::comm::Deferred<A>) {
        lock(&self.deferred)
            .entry(crate::posting::thread_number())
            .or_default()
            .push(post);
    }

    /// [`Comm::group_end`], running `before_join` once the operations are handed over and
    /// before the streams wait for them (see [`Comm::submit_then`]); without the eager moves
    /// where `eager` is false (a collective's messages that already had their chance).
    pub(crate) fn group_end_then(
        &self,
        eager: bool,
        before_join: impl FnOnce() -> Result<bool>,
    ) -> Result<()> {
        let ops = lock(&self.group)
            .remove(&crate::posting::thread_number())
            .ok_or_else(|| CommError::InvalidArgument("this thread has no group open".into()))?;
        let ops = if eager { self.group_eager(ops) } else { ops };
        self.submit_then(ops, before_join)
    }

    /// Hands operations to the proxy, then makes each stream wait for its last one.
    pub(crate) fn submit(&self, ops: Vec<(Op, StreamHandle)>) -> Result<()> {
        self.submit_then(ops, || Ok(false))
    }

    /// [`Comm::submit`], running `before_join` after the hand-over and before the streams are
    /// made to wait: work it enqueues on those streams runs beside the operations instead of
    /// after them (a collective's local copy, a reduction step). It returns whether it
    /// enqueued any (then no later post starts behind these joins without a start event:
    /// [`Joined::clean`](crate::watermark::Joined)). Its failure is returned after the joins.
    pub(crate) fn submit_then(
        &self,
        mut ops: Vec<(Op, StreamHandle)>,
        before_join: impl FnOnce() -> Result<bool>,
    ) -> Result<()> {
        if ops.is_empty() {
            return before_join().map(|_| ());
        }
        // Per stream: the last operation to join, and whether none waits for a start event
        // there (then a closed gate may be held for longer, see `join_stream`).
        let mut last: BTreeMap<u64, (u64, bool)> = BTreeMap::new();
        // Where posts wait (`Comm::posts_wait`), the operations to wait for instead.
        let mut settle = Vec::new();
        for (op, s) in &mut ops {
            if op.seq == 0 {
                op.seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            }
            // A stream-ordered or late-copy message is on its stream already: nothing to join.
            let on_stream = op.resume.is_none()
                && (self.streamed_link(op.peer, op.dir, op.bytes).is_some()
                    || self.late_link(op.peer).is_some());
            if !on_stream && self.posts_wait {
                settle.push(op.slot.clone());
            } else if !on_stream {
                let e = last.entry(s.0).or_insert((0, true));
                e.0 = e.0.max(op.seq);
                e.1 &= op.start.is_none();
            }
        }
        // Late-copy messages are numbered here and claimed after the inbox lock (a claim may
        // wait for the peer), under their own lock so that claims go in number order.
        let late_order = ops
            .iter()
            .any(|(op, _)| op.resume.is_none() && self.late_link(op.peer).is_some())
            .then(|| lock(&self.late_order));
        let mut late = Vec::new();
        {
            // Behind a message a posting thread is moving itself, the pair's next ones wait
            // until it is done or handed over (well under a millisecond: its spin time).
            let mut inbox = self.inbox_for_handover(|| {
                ops.iter().any(|(op, _)| {
                    self.shared.reserved[op.peer][op.dir as usize].load(Ordering::Acquire)
                })
            });
            // Stream-ordered messages, per stream in number order: (index in the inbox,
            // stream, link), enqueued together below.
            let mut ordered = Vec::new();
            for (mut op, stream) in ops {
                let d = op.dir as usize;
                op.index = inbox.next[op.peer][d];
                inbox.next[op.peer][d] += 1;
                if op.resume.is_none() && self.late_link(op.peer).is_some() {
                    if late.is_empty() {
                        self.shared.late_posting.fetch_add(1, Ordering::AcqRel);
                    }
                    late.push((op, stream));
                    continue;
                }
                let link = self
                    .streamed_link(op.peer, op.dir, op.bytes)
                    .filter(|_| op.resume.is_none());
                if let Some(link) = link {
                    ordered.push((inbox.ops.len(), stream, link));
                } else if op.dir == Dir::Send {
                    if let Some(link) = self.eager.get(op.peer).and_then(|l| l.as_ref()) {
                        // After every earlier eager message of the pair (published under the
                        // same lock), so the receiver's look at the slot settles which is which.
                        link.out.store(Counter::Handshake, op.index + 1);
                    }
                }
                self.shared.pending[op.peer][d].fetch_add(1, Ordering::AcqRel);
                inbox.ops.push(op);
            }
            // Numbered and enqueued under one lock, so each stream carries its pair's messages
            // in number order; one call per stream (one kernel on CUDA) for all of a group's,
            // its sends first (see `enqueue_streamed`).
            ordered.sort_by_key(|&(i, s, _)| (s.0, inbox.ops[i].dir == Dir::Recv, i));
            for batch in ordered.chunk_by(|a, b| a.1 == b.1) {
                let stream = batch[0].1;
                let msgs: Vec<_> = batch
                    .iter()
                    .map(|&(i, _, link)| {
                        let op = &inbox.ops[i];
                        (link, op.dir, op.index, op.ptr, op.bytes)
                    })
                    .collect();
                // SAFETY: `post` checked the buffers; each operation (holding its buffer, for
                // safe callers) lives until its event completes.
                let r = unsafe { self.enqueue_streamed(&msgs, stream) };
                match r {
                    Ok(()) => {
                        for &(i, ..) in batch {
                            inbox.ops[i].resume = Some(Resume::Streamed);
                        }
                    }
                    Err(e) => {
                        for &(i, ..) in batch {
                            inbox.ops[i].resume = Some(Resume::Failed(Box::new(e.duplicate())));
                        }
                    }
                }
            }
        }
        if !late.is_empty() {
            self.enqueue_late(&mut late);
            let mut inbox = lock(&self.shared.inbox);
            for (op, _) in late {
                self.shared.pending[op.peer][op.dir as usize].fetch_add(1, Ordering::AcqRel);
                inbox.ops.push(op);
            }
            self.shared.late_posting.fetch_sub(1, Ordering::AcqRel);
        }
        drop(late_order);
        self.shared.posted.fetch_add(1, Ordering::Release);
        self.shared.wake_for_work();
        let between = before_join();
        // A failed `before_join` may have enqueued part of its work.
        let clean = matches!(between, Ok(false));
        for (stream, (seq, extend)) in last {
            self.join_stream(StreamHandle(stream), seq, extend, clean)?;
        }
        // Their results stay in the slots for the requests; a slot settled by a verdict
        // (abort, stall guard) leaves the rest to their requests too.
        let spin = self.config.spin.unwrap_or_default();
        for slot in settle {
            if !slot.settle(None, spin) || !slot.is_done() {
                break;
            }
        }
        between.map(|_| ())
    }
}
