//! Eager: small messages through the channel's eager slots in shared host memory, one per send
//! descriptor — between host-addressable ranks (the host vendor) and on every staged pair.
//!
//! Outside a group the posting thread copies a send into the peer's slot, or a receive out of
//! it ([`Comm::try_eager`](crate::comm::Comm::try_eager)); a receive with the engine takes an eager message there
//! ([`Engine::take_eager`]). Where this rank's device memory is host addressable the CPU
//! copies; where not, the message goes through a host bounce buffer and the rank's runtime
//! copies between it and the device buffer, synchronously (on the caller's idle stream, or the
//! engine's eager stream): one blocking copy per side instead of the ring's descriptor
//! handshake, proxy hops and stream joins.

use flagcx_adaptor::DeviceAdaptor;

use super::{started, Progress, Step};
use crate::channel::SendDesc;
use crate::engine::Engine;
use crate::error::{CommError, Result};
use crate::link::eager::*;
use crate::shared::Path;

impl<A: DeviceAdaptor> Engine<A> {
    /// A receive whose sender sent eagerly (either receive phase): once the caller's stream
    /// passed the posting point, copies the message out of its eager slot.
    pub(crate) fn take_eager(
        &mut self,
        p: usize,
        step: &mut Step,
        sd: &SendDesc,
    ) -> Result<Progress> {
        if !started(&self.adaptor, self.watermark, &step.op)? {
            return Ok(Progress::Idle { on_peer: false });
        }
        let conn = self.peers[p].as_ref().expect("checked by caller");
        step.path = Path::Eager;
        let (dst, cap) = (step.op.ptr, step.op.bytes);
        let r = if self.adaptor.capabilities().host_addressable {
            receive_eager(&conn.inc, step.index, sd, dst, cap, p)
        } else {
            // Made at setup with the bounce buffer (see [`Bounce`]); here only if setup
            // found no pair to bounce for.
            let stream = match self.eager_stream {
                Some(s) => s,
                None => *self.eager_stream.insert(self.adaptor.stream_create()?),
            };
            let (a, inc, index) = (&self.adaptor, &conn.inc, step.index);
            let shared = conn.shares_device;
            self.eager_bounce.with(a, (sd.size as usize).min(cap), |b| {
                match receive_eager(inc, index, sd, host_ptr(b), cap, p) {
                    Ok(n) if n > 0 => copy_in(a, dst, &b[..n], stream, shared).map(|()| n),
                    r => r,
                }
            })
        };
        match r {
            Err(e @ CommError::Protocol(_)) => Err(e),
            r => Ok(Progress::Done(r)),
        }
    }
}
