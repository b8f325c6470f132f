//! IPC: same-vendor pairs, one device copy between the two ranks' buffers.
//!
//! The copier (each sender by default; one rank per pair with `FLAGCX_P2P_IPC_COPIER`) opens
//! the peer's allocation from its byte-form handle once ([`crate::ipccache::IpcCache`]) and copies straight into
//! the receiver's buffer (push) or out of the sender's (pull). Outside a group the posting
//! thread moves a message itself where nothing earlier of its pair is in flight
//! ([`Comm::try_caller_ipc`](crate::comm::Comm::try_caller_ipc), `FLAGCX_P2P_IPC_CALLER`); what it does not finish within its
//! spin time goes to the engine from where it stands ([`Resume`](crate::op::Resume)).

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle};

use super::Step;
use crate::channel::{RecvDesc, SendDesc};
use crate::engine::Engine;
use crate::error::Result;
use crate::ipccache::Theirs;

impl<A: DeviceAdaptor> Engine<A> {
    /// Maps the peer's allocation, or reuses an earlier mapping of it.
    pub(crate) fn open_ipc(&mut self, theirs: Theirs) -> Result<DevicePtr> {
        lock(&self.shared.ipc).open(&self.adaptor, theirs)
    }

    /// Opens (or reuses) the receiver's allocation and enqueues the one copy into it.
    pub(crate) fn issue_ipc_copy(&mut self, step: &Step, desc: &RecvDesc) -> Result<EventHandle> {
        let base = self.open_ipc(Theirs::recv(step.op.peer, desc))?;
        let dst = DevicePtr(base.0 + desc.offset);
        let (src, n, stream) = (step.op.ptr, step.op.bytes, self.send_stream);
        self.enqueue(stream, |a| {
            // SAFETY: `dst..dst+n` lies in the receiver's buffer (it announced `desc.size >= n`
            // at `offset` of that allocation, which it keeps until we answer); `src` is the
            // caller's buffer, valid until the operation completes.
            unsafe { a.memcpy_d2d_async(dst, src, n, stream) }
        })
    }

    /// Opens (or reuses) the sender's allocation and enqueues the one copy out of it into the
    /// caller's receive buffer.
    pub(crate) fn issue_ipc_pull(&mut self, step: &Step, offer: &SendDesc) -> Result<EventHandle> {
        let base = self.open_ipc(Theirs::send(step.op.peer, offer))?;
        let src = DevicePtr(base.0 + offer.offset);
        let (dst, n, stream) = (step.op.ptr, offer.size as usize, self.recv_stream);
        self.enqueue(stream, |a| {
            // SAFETY: `src..src+n` lies in the sender's buffer (it offered `n` bytes at `offset`
            // of that allocation and keeps them until our verdict); the destination is the
            // caller's buffer with `n <= bytes` (checked by the caller), valid until the
            // operation completes.
            unsafe { a.memcpy_d2d_async(dst, src, n, stream) }
        })
    }
}
