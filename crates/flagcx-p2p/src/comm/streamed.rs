//! The posting side of [`crate::transport::streamed`]: what the API thread does for it.

use crate::comm::Comm;
use crate::error::Result;
use crate::link::streamed::*;
use crate::op::Dir;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, SlotStep, StreamHandle};

impl<A: DeviceAdaptor> Comm<A> {
    /// The stream-ordered link with `peer`, if a message of `bytes` in direction `dir` takes it.
    pub(crate) fn streamed_link(&self, peer: usize, dir: Dir, bytes: usize) -> Option<&StreamLink> {
        self.streamed
            .get(peer)
            .and_then(|l| l.as_ref())
            .filter(|l| l.takes(dir, bytes))
    }

    /// Enqueues the stream-ordered messages `msgs` — (link, direction, number, buffer, bytes)
    /// each — on `stream` in one call of [`DeviceAdaptor::stream_slot_steps`] (one kernel on
    /// CUDA; as separate stream operations where a pair shares its device), or fails (after
    /// which no wait of theirs is left on the stream). No event is recorded: a send is done
    /// once its status word landed, a receive once its taken word did — the posting thread
    /// makes one call, and the engine follows with loads of host memory, no driver calls.
    /// Sends go first in the call: done in order, a receive ahead of them would wait for a
    /// peer whose receive waits the same way (a group that posts its receives first, on both
    /// ranks).
    ///
    /// # Safety
    /// Each buffer is device memory of this adaptor, valid until its operation finishes.
    pub(crate) unsafe fn enqueue_streamed(
        &self,
        msgs: &[(&StreamLink, Dir, u64, DevicePtr, usize)],
        stream: StreamHandle,
    ) -> Result<()> {
        let steps: Vec<SlotStep> = msgs
            .iter()
            .map(|&(link, dir, k, ptr, bytes)| link.step(dir, k, ptr, bytes))
            .collect();
        let a = &self.adaptor;
        // SAFETY: forwarded contract; each link's words and slots are registered and live.
        let r = unsafe {
            match msgs.iter().all(|m| m.0.fused) {
                true => a.stream_slot_steps(stream, &steps),
                false => flagcx_adaptor::slot_steps_in_order(a, stream, &steps),
            }
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) => {
                // Whatever part went in must not wait for good: the pairs are retired by the
                // engine for this failure, so their words are ours to settle.
                for &(link, dir, k, ..) in msgs {
                    StreamLink::release_side(&link.out, &link.inc, dir, k);
                }
                Err(e.into())
            }
        }
    }
}
