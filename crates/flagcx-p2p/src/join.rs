//! Joining callers' streams: the start event an operation waits for, and the wait of the
//! caller's stream on the communicator's completion watermark (a stream memory operation on a
//! registered host page, or a host function where the vendor has none).

use std::time::Instant;

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{
    DeviceAdaptor, DevicePtr, EventHandle, GateHandle, StreamHandle, WaitCondition,
};

use crate::comm::Comm;
use crate::config::StreamJoin;
use crate::error::{CommError, Result};
use crate::watermark::{Joined, WatermarkPage, REJOIN_PAUSE_FACTOR};

/// Whether this process's streams share one work queue for joins of kind `join`
/// ([`waits_hold_other_streams`]), on a watermark page of its own (setup's comes after
/// the all-gather).
pub(crate) fn shares_queue<A: DeviceAdaptor>(adaptor: &A, join: StreamJoin) -> bool {
    let probe = WatermarkPage::new(adaptor).and_then(|mut page| {
        let r = waits_hold_other_streams(adaptor, &page, join);
        page.release(adaptor);
        r
    });
    probe.unwrap_or_else(|e| {
        tracing::debug!("could not tell whether streams share a work queue: {e}");
        false
    })
}

/// How long [`waits_hold_other_streams`] gives the second stream's memset: far more than an
/// idle runtime needs to run 4 KiB (microseconds), and than a busy 2-core machine takes to
/// schedule a host-vendor stream's worker, yet a small part of a job's start where the queues
/// are shared (the only case that waits it out). A wrong "shared" costs more than the wait:
/// late copies and waiting posts for the communicator's life. It was 20 ms until two runs of
/// reliability's stream-ordered killed-peer case on the 2-core VM found no stream-ordered link
/// (not reproduced in 50 runs since, 10 of them beside two spinning processes).
const SHARED_QUEUE_PROBE: std::time::Duration = std::time::Duration::from_millis(100);

/// How long the host-function probe of [`waits_hold_other_streams`] blocks at most if the host
/// never lets it go (it always does, right after the probe): a runtime thread is never held for
/// good.
const PROBE_HOST_FN_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether a stream's join of kind `join` (resolved: [`StreamJoin::resolve`]) holds up work
/// that another stream of this process enqueues after it: true where the runtime runs all of a
/// process's streams through one work queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`; the host vendor's
/// `FLAGCX_HOST_QUEUES=1`). There a join enqueued before the proxy's copy that completes it
/// stalls both (git show 7ff18bc:docs/performance.md, "one hardware queue stalls the proxy"). Found out by doing
/// it on two fresh streams: the first waits as a join would (on a word of the watermark page,
/// a line of its own, not the watermark; in a host function; at a gate) with a memset behind
/// the wait, the second sets another 2 KiB of device memory, and the host lets the first go
/// once the second finished or [`SHARED_QUEUE_PROBE`] passed. Two consecutive streams land on
/// different queues where there are several, so this sees one shared queue, not two streams
/// that happen to share one of many. `Ok(false)` for `None` (no join) and for a memory wait without a registered page.
pub(crate) fn waits_hold_other_streams<A: DeviceAdaptor>(
    adaptor: &A,
    page: &WatermarkPage,
    join: StreamJoin,
) -> Result<bool> {
    const OFFSET: usize = 64;
    let device = match (join, page.device) {
        (StreamJoin::MemOp, Some(d)) => Some(d),
        (StreamJoin::HostFn | StreamJoin::Gate, _) => None,
        _ => return Ok(false),
    };
    let word = page.host.wrapping_add(OFFSET).cast::<u32>();
    let a = adaptor.stream_create()?;
    let cleanup = |b: Option<StreamHandle>, buf: Option<DevicePtr>| {
        if let Some(b) = b {
            let _ = adaptor.stream_synchronize(b);
            let _ = adaptor.stream_destroy(b);
        }
        let _ = adaptor.stream_synchronize(a);
        let _ = adaptor.stream_destroy(a);
        if let Some(buf) = buf {
            // SAFETY: both streams are idle; nothing else has the buffer.
            let _ = unsafe { adaptor.mem_free(buf) };
        }
    };
    let b = match adaptor.stream_create() {
        Ok(b) => b,
        Err(e) => {
            cleanup(None, None);
            return Err(e.into());
        }
    };
    let buf = match adaptor.mem_alloc(4096) {
        Ok(buf) => buf,
        Err(e) => {
            cleanup(Some(b), None);
            return Err(e.into());
        }
    };
    // SAFETY: `word` is in our mapped page (offset 64 of 4096), 4-byte aligned; it starts at 0.
    unsafe { adaptor.host_write_value32(word, 0) };
    let go = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut gate = None;
    let run = |gate: &mut Option<GateHandle>| -> Result<bool> {
        match device {
            // SAFETY: the page is registered (`device`) and stays so until `release`, after
            // the host has written the word and `cleanup` synchronized the stream.
            Some(device) => unsafe {
                adaptor.stream_wait_value32(
                    a,
                    DevicePtr(device.0 + OFFSET as u64),
                    1,
                    WaitCondition::Geq,
                )?
            },
            None if join == StreamJoin::Gate => *gate = Some(adaptor.stream_gate(a)?),
            None => {
                let go = go.clone();
                adaptor.launch_host_func(
                    a,
                    Box::new(move || {
                        let t0 = Instant::now();
                        while !go.load(std::sync::atomic::Ordering::Acquire)
                            && t0.elapsed() < PROBE_HOST_FN_MAX
                        {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                    }),
                )?
            }
        }
        // Work behind the wait on its own stream, as a join always has (the next operation's
        // start, the caller's kernels): CUDA puts the wait for a host function into the queue
        // with the stream's next command, so a host function with nothing behind it held up
        // nothing and the probe said "not shared" where a staged pair's joins then stalled the
        // proxy's copies (`posts_wait_where_streams_share_one_queue` on an H200).
        // SAFETY: the buffer is ours and 4096 bytes long; the streams set disjoint halves.
        unsafe { adaptor.memset_async(buf, 1, 2048, a)? };
        // SAFETY: as above.
        unsafe { adaptor.memset_async(DevicePtr(buf.0 + 2048), 0, 2048, b)? };
        let t0 = Instant::now();
        loop {
            if adaptor.stream_query(b)? {
                return Ok(false);
            }
            if t0.elapsed() >= SHARED_QUEUE_PROBE {
                return Ok(true);
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    };
    let held = run(&mut gate);
    // SAFETY: as above.
    unsafe { adaptor.host_write_value32(word, 1) };
    go.store(true, std::sync::atomic::Ordering::Release);
    if let Some(g) = gate {
        let _ = adaptor.gate_open(g);
    }
    cleanup(Some(b), Some(buf));
    held
}

impl<A: DeviceAdaptor> Comm<A> {
    /// An event of the API side's pool (`Shared::spare_events`), or a new one.
    pub(crate) fn spare_event(&self) -> Result<EventHandle> {
        let spare = lock(&self.shared.spare_events).pop();
        match spare {
            Some(e) => Ok(e),
            None => Ok(self.adaptor.event_create(false)?),
        }
    }

    /// An event recorded on `stream` now: where an operation may start.
    pub(crate) fn start_event(&self, stream: StreamHandle) -> Result<EventHandle> {
        let start = self.spare_event()?;
        if let Err(e) = self.adaptor.event_record(start, stream) {
            let _ = self.adaptor.event_destroy(start);
            return Err(e.into());
        }
        Ok(start)
    }

    /// The watermark word streams wait on with a stream memory operation, where joins use
    /// them (see [`Self::join_stream`]).
    fn memop_word(&self) -> Option<DevicePtr> {
        let join = self.config.join.resolve(&self.adaptor.capabilities());
        self.page.device.filter(|_| join == StreamJoin::MemOp)
    }

    /// Whether streams join at gates (see [`Self::join_stream`]).
    fn joins_at_gates(&self) -> bool {
        self.config.join.resolve(&self.adaptor.capabilities()) == StreamJoin::Gate
    }

    /// What an operation posted on `stream` now starts after: nothing where the stream is
    /// `idle`; behind nothing but this communicator's closed gate, the operation that gate
    /// waits for (on the host: the gate will wait for this one in turn, and no command is added
    /// to the stream); else an event recorded on the stream.
    pub(crate) fn start_of(
        &self,
        stream: StreamHandle,
        idle: bool,
    ) -> Result<(Option<EventHandle>, u64)> {
        if idle {
            return Ok((None, 0));
        }
        match self.behind_own_gate(stream)? {
            Some(after) => Ok((None, after)),
            None => Ok((Some(self.start_event(stream)?), 0)),
        }
    }

    /// Where all `stream` still holds is this communicator's closed gate (nothing was enqueued
    /// behind it) and nothing was enqueued in front of it after its operation was posted
    /// ([`Joined::clean`]), the operation that gate waits for: an operation posted now may
    /// start once that one finished, without a start event, and the gate can then wait for it
    /// too ([`Self::join_stream`] with `extend`) instead of a second gate. One command per
    /// stream however many operations are posted back to back while the first is still
    /// running. A gate with work in front of it that its operation does not cover (a
    /// reduction step of the slice before, running beside the messages) does not: that work
    /// may still run when the operation finishes, and the next post takes a start event.
    pub(crate) fn behind_own_gate(&self, stream: StreamHandle) -> Result<Option<u64>> {
        if !self.joins_at_gates() {
            return Ok(None);
        }
        let Some(j) = lock(&self.joined).get(&stream.0).copied() else {
            return Ok(None);
        };
        match j.gate {
            Some(g)
                if j.clean
                    && *lock(&self.shared.watermark) < j.seq
                    && self.adaptor.gate_is_last(g)? =>
            {
                Ok(Some(j.seq))
            }
            _ => Ok(None),
        }
    }

    /// Makes `stream` wait until operation `seq` (and all before it) finished. With `extend`
    /// (no operation behind this join recorded a start event on `stream`), a closed gate that
    /// is still the stream's last work is made to wait for `seq` instead of adding a gate.
    ///
    /// The operations are with the engine already when their stream joins them. If the runtime
    /// fails to enqueue the join, the stream would run on while they still use its buffers, so
    /// the communicator is failed with that error, as [`Comm::abort`] fails it: every pending
    /// operation and `async_error` report it, later posts fail with `Aborted`.
    ///
    /// `clean`: nothing was enqueued on `stream` since the operations were posted
    /// ([`Joined::clean`]).
    pub(crate) fn join_stream(
        &self,
        stream: StreamHandle,
        seq: u64,
        extend: bool,
        clean: bool,
    ) -> Result<()> {
        self.try_join_stream(stream, seq, extend, clean)
            .inspect_err(|e| {
                tracing::warn!("a caller's stream could not join operation {seq}: {e}");
                self.shared.record_error(e);
                self.shared.verdict.give(e.clone());
                self.abort();
            })
    }

    fn try_join_stream(
        &self,
        stream: StreamHandle,
        seq: u64,
        extend: bool,
        mut clean: bool,
    ) -> Result<()> {
        let join = self.config.join;
        if join == StreamJoin::None {
            return Ok(());
        }
        let (mut gate, mut held) = (None, 0);
        match self.memop_word() {
            Some(word) => {
                // SAFETY: the word lives in the registered watermark page, which outlives every
                // stream wait (Drop releases the waits and waits for each joined stream's
                // last-join event before unmapping).
                unsafe {
                    self.adaptor.stream_wait_value32(
                        stream,
                        word,
                        seq as u32,
                        WaitCondition::Geq,
                    )?
                };
            }
            None if self.joins_at_gates() => {
                // Every operation posted since that gate was made saw it last (nothing can be
                // enqueued in front of the last command), so none waits for it by an event:
                // holding it for longer cannot make an operation wait for itself.
                let prev = lock(&self.joined).get(&stream.0).copied();
                (gate, held) = match prev {
                    Some(Joined {
                        gate: Some(g),
                        held,
                        clean: was,
                        ..
                    }) if extend
                        && self.adaptor.gate_is_last(g)?
                        && self.shared.gate_extend(g, seq) =>
                    {
                        clean &= was;
                        (Some(g), held + 1)
                    }
                    _ => (self.shared.gate_until(&self.adaptor, stream, seq)?, 0),
                };
            }
            None => {
                let shared = self.shared.clone();
                self.adaptor
                    .launch_host_func(stream, Box::new(move || shared.wait_watermark(seq)))?;
            }
        }
        // Read first: no other lock is taken under `joined`.
        let watermark = *lock(&self.shared.watermark);
        let mut joined = lock(&self.joined);
        let prev = joined.get(&stream.0).copied();
        let ev = match prev {
            Some(j) => j.ev,
            None => self.adaptor.event_create(false)?,
        };
        let rejoin_at = match prev {
            Some(p) if watermark < p.seq => p.rejoin_at,
            _ => Instant::now(),
        };
        joined.insert(
            stream.0,
            Joined {
                ev,
                seq,
                gate,
                held,
                clean,
                rejoin_at,
            },
        );
        self.adaptor.event_record(ev, stream)?;
        Ok(())
    }

    /// Whether `stream` is idle, waiting up to the spin time when all it may still hold is
    /// this communicator's join of an operation that already finished: a caller that waited
    /// for a request posts its next operation before the stream has passed that (satisfied)
    /// wait, and only an idle stream lets the next message go eagerly. Without this, one
    /// message through the proxy keeps every later one there.
    /// Only waits where the eager path could follow (`eager`). Where the message could go
    /// eagerly (`small`) and all the stream holds is this communicator's fresh gate (one
    /// operation's join, nothing behind it), it first waits up to `Config::rejoin_wait` for that
    /// operation: once per gate, so posts behind a peer that does not answer pay it once.
    /// Where the stream's last join is a stream memory wait or a host function (which cannot
    /// tell whether work was enqueued behind them) for an operation still running, a message
    /// that is `small`, or of any eager size where this rank's eager copies are the CPU's
    /// (`cpu`), waits the same way, at most once per ten rejoin waits of a chain of joins
    /// ([`Joined::rejoin_at`]): without it, small messages enqueued back to back (a stream of
    /// collectives) never leave the proxy once one went there — four host ranks on two cores
    /// took 75–100 µs per 4 KiB all-to-all so, 14 µs eagerly; a CUDA rank and a host rank
    /// 20–54 µs per 8–512 B `sendrecv`, 18–24 µs eagerly.
    pub(crate) fn idle_or_soon(
        &self,
        stream: StreamHandle,
        eager: bool,
        small: bool,
        cpu: bool,
    ) -> Result<bool> {
        if self.adaptor.stream_query(stream)? {
            return Ok(true);
        }
        let spin = self.config.spin.unwrap_or_default();
        let passed = |seq: u64| *lock(&self.shared.watermark) >= seq;
        let last = lock(&self.joined).get(&stream.0).copied();
        // How long to spin for the stream once its join is satisfied: the spin time, or what
        // is left of the wait for the gate's operation (its barrier takes tens of µs to pass
        // once opened, ~45 µs on PoCL).
        let mut until = spin;
        let t0 = std::time::Instant::now();
        let rejoin = eager && !spin.is_zero() && !self.config.rejoin_wait.is_zero();
        // The operation to wait for, and whether its join is a gate.
        let wait_for = match last {
            Some(j) if eager && !spin.is_zero() && passed(j.seq) => None,
            Some(Joined {
                seq,
                gate: Some(g),
                held: 0,
                ..
            }) if rejoin && small && self.adaptor.gate_is_last(g)? => Some((seq, true)),
            Some(Joined {
                seq, gate: None, ..
            }) if rejoin && (small || cpu) && self.claim_rejoin(stream, seq) => Some((seq, false)),
            _ => return Ok(false),
        };
        if let Some((seq, gate)) = wait_for {
            if !self.shared.watermark_within(seq, self.config.rejoin_wait) {
                return Ok(false);
            }
            // An abort's release also moves the watermark.
            if self
                .shared
                .aborted
                .load(std::sync::atomic::Ordering::Acquire)
            {
                return Err(CommError::Aborted);
            }
            // A gate's barrier takes tens of µs to pass once opened; a stream memory wait a
            // few, so there the spin alone is what a stream with the caller's work behind the
            // join costs this post.
            until = t0.elapsed() + spin;
            if gate {
                until = until.max(self.config.rejoin_wait);
            }
        }
        while t0.elapsed() < until {
            flagcx_adaptor::spin::relax();
            if self.adaptor.stream_query(stream)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// Takes a wait of a chain of joins ([`Joined::rejoin_at`]): whether `stream`'s last join
    /// is still the one for `seq` and its chain lets a post wait now.
    fn claim_rejoin(&self, stream: StreamHandle, seq: u64) -> bool {
        let now = Instant::now();
        let mut joined = lock(&self.joined);
        match joined.get_mut(&stream.0) {
            Some(j) if j.seq == seq && j.rejoin_at <= now => {
                j.rejoin_at = now + self.config.rejoin_wait * REJOIN_PAUSE_FACTOR;
                true
            }
            _ => false,
        }
    }
}

impl crate::shared::Shared {
    /// Makes `stream` wait at a gate until the watermark reaches `seq`: the publisher of the
    /// watermark opens it ([`Self::publish_watermark`]), with no runtime thread in between.
    /// Nothing is enqueued where the operation already finished. Returns the gate while it
    /// waits in [`Self::gates`].
    pub(crate) fn gate_until<A: DeviceAdaptor>(
        &self,
        adaptor: &A,
        stream: StreamHandle,
        seq: u64,
    ) -> Result<Option<GateHandle>> {
        if *lock(&self.watermark) >= seq {
            return Ok(None);
        }
        let gate = adaptor.stream_gate(stream)?;
        // Checked again under the lock the publisher holds while it collects gates: a gate is
        // either seen by a later publish or opened here.
        let passed = {
            let w = lock(&self.watermark);
            if *w < seq {
                lock(&self.gates).push((seq, gate));
            }
            *w >= seq
        };
        if passed {
            adaptor.gate_open(gate)?;
            return Ok(None);
        }
        Ok(Some(gate))
    }

    /// Makes the closed `gate` wait until operation `seq` finished, where it still waits for
    /// an earlier one; `false` where it was opened already (or waits for `seq` or later).
    pub(crate) fn gate_extend(&self, gate: GateHandle, seq: u64) -> bool {
        // Under the publisher's lock: a gate is either moved before it sees it or opened.
        let w = lock(&self.watermark);
        let mut gates = lock(&self.gates);
        match gates.iter_mut().find(|(_, g)| *g == gate) {
            Some(entry) if *w < entry.0 && entry.0 < seq => {
                entry.0 = seq;
                self.joins_held
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Releases every stream waiting for an operation up to `through`, from the host and
    /// without the engine thread (`Comm::abort`, `Comm`'s drop): the watermark is published
    /// there now and never below it afterwards.
    pub(crate) fn release_through<A: DeviceAdaptor>(&self, adaptor: &A, through: u64) {
        self.released
            .fetch_max(through, std::sync::atomic::Ordering::AcqRel);
        self.publish_watermark(adaptor, through);
    }
}
