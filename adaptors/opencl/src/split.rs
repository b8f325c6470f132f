//! Large copies on CPU devices, cut into parts that run at once.
//!
//! A CPU device's runtime (PoCL) runs each command on one of its worker threads, and a copy
//! is that thread's `memcpy`: one copy moves at one core's speed however many cores the
//! device has. Commands of different queues run on different workers at once. So a copy of
//! at least two [`MIN_PART`]s is cut into up to [`OpenClAdaptor`]'s `copy_parts` pieces: the
//! first on the stream's own queue, the others on helper queues of that stream, each waiting
//! for the stream's last command (everything earlier on the stream, in order), and a barrier
//! on the stream's queue waits for all of them, so later work, events, `stream_query` and
//! `stream_synchronize` see the whole copy. Measured on a 2-core machine with PoCL 3
//! (`benches/probes/ocl_split.c`, no flagcx code; per direction, one queue against two
//! halves on two queues): 16 MiB 12–14 → 22–26 GB/s, 128 MiB 6.8–6.9 → 12.8–13.1; at 2 MiB
//! no gain, at 4 MiB in one run of two.
//!
//! Helper queues belong to one stream: two streams sharing one would order their parts
//! through it, and a part waiting for a gate of its own stream could then hold up the other
//! stream's work for ever. GPU devices copy with DMA engines that one command already keeps
//! busy, so they are not cut unless `FLAGCX_OPENCL_COPY_PARTS` asks.

use cl3::types::{cl_command_queue, cl_event, cl_int};
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{AdaptorError, Result, StreamHandle};

use crate::{cl_error, release, OpenClAdaptor, Raw};

/// The smallest part a copy is cut into: below 4 MiB in all, two parts gained nothing.
pub(crate) const MIN_PART: usize = 2 << 20;
/// The most parts one copy is cut into, whatever the device reports.
const MAX_PARTS: usize = 16;

/// How many parts a large copy may be cut into (`FLAGCX_OPENCL_COPY_PARTS`): `auto` (the
/// default) is, on CPU devices, the device's compute units (PoCL: its worker threads, one per
/// core of the machine) or the `cpus` this process may run on, whichever is fewer, at most
/// [`MAX_PARTS`] — a rank bound to one core (`flagcx-run` binds ranks where they are as many
/// as the cores) gains nothing from parts its workers can only take turns at, and measured
/// 7% slower at 4 MiB — and 1 (never cut) on GPUs and accelerators; a number from 1 to
/// [`MAX_PARTS`] sets it for any device.
pub(crate) fn max_parts(
    v: Option<&str>,
    device_type: u64,
    compute_units: u64,
    cpus: usize,
) -> Result<usize> {
    match v.map(str::trim) {
        None | Some("" | "auto") => Ok(if device_type & cl3::device::CL_DEVICE_TYPE_CPU != 0 {
            (compute_units as usize).min(cpus).clamp(1, MAX_PARTS)
        } else {
            1
        }),
        Some(n) => match n.parse::<usize>() {
            Ok(k @ 1..=MAX_PARTS) => Ok(k),
            _ => Err(AdaptorError::invalid(
                "FLAGCX_OPENCL_COPY_PARTS",
                format!("expected auto or a number from 1 to {MAX_PARTS}, got {n:?}"),
            )),
        },
    }
}

/// The parts a copy of `n` bytes is cut into, given at most `max`: none smaller than
/// [`MIN_PART`], so small copies stay whole.
pub(crate) fn parts(n: usize, max: usize) -> usize {
    (n / MIN_PART).clamp(1, max.max(1))
}

/// Part `i` of `k` of an `n`-byte copy: its offset and length. Parts are whole pages but the
/// last, which takes the rest.
pub(crate) fn span(n: usize, k: usize, i: usize) -> (usize, usize) {
    let each = n.div_ceil(k).next_multiple_of(4096);
    let off = (each * i).min(n);
    let end = if i + 1 == k { n } else { (off + each).min(n) };
    (off, end - off)
}

/// Enqueues one part of a copy on `queue`: its offset and length within the copy, and the
/// events it must wait for; returns its event.
pub(crate) type EnqueuePart<'a> = &'a dyn Fn(
    cl_command_queue,
    usize,
    usize,
    &[cl_event],
) -> std::result::Result<cl_event, cl_int>;

impl OpenClAdaptor {
    /// Enqueues an `n`-byte copy on `stream` through `part` (see [`EnqueuePart`]): whole on
    /// the stream's queue, or cut into [`parts`] as the module describes. Either way the copy
    /// is one step of the stream: after everything enqueued before it, before everything
    /// after it. Where a part fails to enqueue, the parts already enqueued are waited for
    /// before the error returns, so nothing of the copy runs on after it.
    pub(crate) fn copy_in_parts(
        &self,
        op: &'static str,
        stream: StreamHandle,
        n: usize,
        part: EnqueuePart<'_>,
    ) -> Result<()> {
        let q = self.queue(stream)?;
        let k = parts(n, self.inner.copy_parts);
        if k < 2 {
            return self.enqueued(op, stream, part(q, 0, n, &[]));
        }
        // One hold of the lock: the parts and their barrier are one step of the stream, which
        // no other thread's command on it can split.
        let mut queues = lock(&self.inner.queues);
        let state = queues
            .get_mut(&stream.0)
            .ok_or(AdaptorError::InvalidHandle {
                kind: "stream",
                value: stream.0,
            })?;
        while state.helpers.len() < k - 1 {
            // SAFETY: the device belongs to the context.
            #[allow(deprecated)]
            let h = unsafe {
                cl3::command_queue::create_command_queue(self.inner.context.0, self.inner.id.0, 0)
            }
            .map_err(|c| cl_error("clCreateCommandQueue", c))?;
            state.helpers.push(Raw(h));
        }
        let before: Vec<cl_event> = state.last.iter().map(|e| e.0).collect();
        let mut events = Vec::with_capacity(k - 1);
        let mut failed = None;
        for i in 1..k {
            let (off, len) = span(n, k, i);
            let h = state.helpers[i - 1].0;
            match part(h, off, len, &before) {
                Ok(e) => {
                    events.push(e);
                    let _ = cl3::command_queue::flush(h);
                }
                Err(c) => {
                    failed = Some(cl_error(op, c));
                    break;
                }
            }
        }
        if failed.is_none() {
            let (off, len) = span(n, k, 0);
            match part(q, off, len, &[]) {
                Ok(e) => {
                    if let Some(old) = state.last.replace(Raw(e)) {
                        release(old.0);
                    }
                }
                Err(c) => failed = Some(cl_error(op, c)),
            }
        }
        if !events.is_empty() {
            // SAFETY: a live queue; the wait list holds the parts' live events.
            let joined = unsafe {
                cl3::command_queue::enqueue_barrier_with_wait_list(
                    q,
                    events.len() as u32,
                    events.as_ptr(),
                )
            };
            match joined {
                Ok(b) => {
                    if let Some(old) = state.last.replace(Raw(b)) {
                        release(old.0);
                    }
                }
                Err(c) => {
                    // The stream cannot be made to wait: wait here, so no part outlives the
                    // error.
                    for h in &state.helpers {
                        let _ = cl3::command_queue::finish(h.0);
                    }
                    failed.get_or_insert(cl_error("clEnqueueBarrierWithWaitList", c));
                }
            }
            for e in events {
                release(e);
            }
        }
        let _ = cl3::command_queue::flush(q);
        match failed {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{max_parts, parts, span, MIN_PART};

    #[test]
    fn copies_are_cut_only_where_it_pays() {
        let (cpu, gpu) = (
            cl3::device::CL_DEVICE_TYPE_CPU,
            cl3::device::CL_DEVICE_TYPE_GPU,
        );
        assert_eq!(max_parts(None, cpu, 2, 2).unwrap(), 2);
        assert_eq!(max_parts(None, cpu, 2, 1).unwrap(), 1);
        assert_eq!(max_parts(Some("auto"), cpu, 64, 64).unwrap(), 16);
        assert_eq!(max_parts(None, gpu, 132, 16).unwrap(), 1);
        assert_eq!(max_parts(Some(" 4 "), gpu, 132, 1).unwrap(), 4);
        for bad in ["0", "17", "two"] {
            let e = max_parts(Some(bad), cpu, 2, 2).unwrap_err().to_string();
            assert!(e.contains("FLAGCX_OPENCL_COPY_PARTS"), "{e}");
        }
        assert_eq!(parts(2 * MIN_PART - 1, 8), 1);
        assert_eq!(parts(2 * MIN_PART, 8), 2);
        assert_eq!(parts(1 << 30, 8), 8);
        assert_eq!(parts(1 << 30, 1), 1);
        assert_eq!(parts(0, 0), 1);
    }

    #[test]
    fn parts_cover_the_copy_once() {
        for n in [
            2 * MIN_PART,
            2 * MIN_PART + 1,
            (9 << 20) + 4099,
            64 << 20,
            5 * MIN_PART - 3,
        ] {
            for k in 2..=8 {
                let mut next = 0;
                for i in 0..k {
                    let (off, len) = span(n, k, i);
                    assert_eq!(off, next, "n {n} k {k} part {i}");
                    assert!(len > 0 && (i + 1 == k || off % 4096 == 0));
                    next = off + len;
                }
                assert_eq!(next, n, "n {n} k {k}");
            }
        }
    }
}
