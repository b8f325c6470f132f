//! Direct: a staged pair with a host-vendor rank, whose device memory (a memfd) the other
//! rank maps ([`super::hostmap`]) and copies straight into or out of, once the mapping is
//! registered; until then its messages take the ring. A copy is one runtime copy per piece of
//! registration it spans.

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, IpcMemHandle};

use super::hostmap::pieces;
use super::Step;
use crate::channel::{RecvDesc, SendDesc};
use crate::shared::Path;

use crate::engine::Engine;
use crate::error::{CommError, Result};

/// Checks that a peer's buffer (`bytes` at `offset`) lies inside its `len`-byte allocation.
pub(crate) fn placed_within(offset: u64, bytes: usize, len: usize) -> Result<()> {
    match offset.checked_add(bytes as u64) {
        Some(end) if end <= len as u64 => Ok(()),
        _ => Err(CommError::Protocol(format!(
            "the peer placed {bytes} bytes at offset {offset} of a {len}-byte allocation"
        ))),
    }
}

impl<A: DeviceAdaptor> Engine<A> {
    /// A send's copy straight into the receiver's mapped buffer (`desc` announced it), on
    /// the send stream; `None` when that buffer is not mapped (yet): the ring carries it.
    pub(crate) fn direct_push(
        &mut self,
        p: usize,
        step: &mut Step,
        desc: &RecvDesc,
    ) -> Result<Option<EventHandle>> {
        let maps = self.peers[p].as_ref().is_some_and(|c| c.roles.maps_peer);
        let bytes = step.op.bytes;
        let mapped = match (maps, desc.handle) {
            (true, Some(h)) => self.map_peer(&h, desc.offset, bytes)?,
            _ => None,
        };
        let Some((base, piece)) = mapped else {
            return Ok(None);
        };
        let (src, stream) = (step.op.ptr, self.send_stream);
        let ev = self.enqueue(stream, |a| {
            for (off, n) in pieces(desc.offset, bytes, piece) {
                let from = DevicePtr(src.0 + (off - desc.offset));
                // SAFETY: `base+off..+n` lies in the receiver's buffer (it announced
                // `desc.size >= bytes` at `offset` of the mapped allocation, checked by
                // `map_peer`, and keeps it until we answer) and in one registration; `from..+n`
                // lies in the caller's buffer of `bytes`, valid until the operation completes.
                unsafe { a.memcpy_d2h_async((base + off) as *mut u8, from, n, stream) }?;
            }
            Ok(())
        })?;
        step.path = Path::Direct;
        Ok(Some(ev))
    }

    /// A receive's copy straight out of the sender's mapped buffer (`offer` offered it), on
    /// the receive stream; `None` when that buffer is not mapped (yet): the ring carries it.
    pub(crate) fn direct_pull(
        &mut self,
        step: &mut Step,
        offer: &SendDesc,
    ) -> Result<Option<EventHandle>> {
        let n = offer.size as usize;
        let mapped = match offer.handle {
            Some(h) => self.map_peer(&h, offer.offset, n)?,
            None => None,
        };
        let Some((base, piece)) = mapped else {
            return Ok(None);
        };
        let (dst, stream) = (step.op.ptr, self.recv_stream);
        let ev = self.enqueue(stream, |a| {
            for (off, len) in pieces(offer.offset, n, piece) {
                let to = DevicePtr(dst.0 + (off - offer.offset));
                // SAFETY: `base+off..+len` lies in the sender's mapped buffer (it offered `n`
                // bytes at `offset`, checked by `map_peer`, and keeps them until our verdict) and
                // in one registration; `to..+len` lies in the caller's buffer (`n <= bytes`,
                // checked by the caller), valid until completion.
                unsafe { a.memcpy_h2d_async(to, (base + off) as *const u8, len, stream) }?;
            }
            Ok(())
        })?;
        step.path = Path::Direct;
        Ok(Some(ev))
    }

    /// Direct path: the host address of the peer allocation behind `handle` if it is mapped
    /// and ready (see [`super::hostmap::HostMaps::lookup`]), with the size of its
    /// registrations (a copy is split at their boundaries). A buffer the peer places outside
    /// its allocation (`offset + bytes` past its end) is a protocol error, never a copy.
    pub(crate) fn map_peer(
        &mut self,
        handle: &IpcMemHandle,
        offset: u64,
        bytes: usize,
    ) -> Result<Option<(u64, usize)>> {
        let Some(maps) = self.host_maps.as_mut() else {
            return Ok(None);
        };
        let Some((base, len)) = maps.lookup(handle) else {
            return Ok(None);
        };
        placed_within(offset, bytes, len)?;
        Ok(Some((base, maps.piece())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn a_peer_buffer_outside_its_allocation_is_refused() {
        assert!(placed_within(0, 4096, 4096).is_ok());
        assert!(placed_within(4000, 96, 4096).is_ok());
        assert!(placed_within(4000, 97, 4096).is_err());
        assert!(placed_within(u64::MAX, 2, 4096).is_err(), "no overflow");
    }
}
