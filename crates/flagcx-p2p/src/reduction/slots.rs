//! The posting side of the reduction slots (`crate::slots`): a small all-reduce run on the
//! posting thread where its stream is idle, else as a host function on it.

use std::sync::Arc;

use flagcx_adaptor::reduce::{DataType, ReduceOp};
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, StreamHandle};

use crate::collectives::Collective;
use crate::comm::Comm;
use crate::error::Result;
use crate::slots::{Call, Slots};
use flagcx_adaptor::tracking::lock;

impl<A: DeviceAdaptor> Comm<A> {
    /// A small all-reduce through the reduction slots (`slots`): run here where the stream is
    /// idle, else enqueued on it as a host function whose outcome the returned collective
    /// reports. A failure fails the communicator, as any reduction's does.
    ///
    /// # Safety
    /// As the public calls; the slots exist only where device memory is host addressable.
    pub(super) unsafe fn all_reduce_in_slots(
        &self,
        s: &Arc<Slots>,
        (send, recv): (DevicePtr, DevicePtr),
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<Collective> {
        let call = Call {
            n: s.take_number(),
            send: send.0,
            recv: recv.0,
            count,
            dtype,
            op,
        };
        if self.adaptor().stream_query(stream)? {
            let stop = self.shared.slots_stop();
            // SAFETY: host-addressable buffers of `count` elements (the caller's contract and
            // the slots' condition); the stream is idle, so nothing earlier still writes them.
            return match unsafe { s.run(&call, &stop) } {
                Ok(()) => Ok(Collective::default()),
                Err(e) => {
                    self.shared.record_fatal(&e);
                    self.abort();
                    Err(e)
                }
            };
        }
        let cell = crate::collectives::Deferred::default();
        let (fill, s, shared) = (cell.clone(), s.clone(), self.shared.clone());
        self.adaptor().launch_host_func(
            stream,
            Box::new(move || {
                let stop = shared.slots_stop();
                // SAFETY: as above; the stream reached the call, so earlier work on the
                // buffers finished, and the caller keeps them valid until it passes the call.
                let r = unsafe { s.run(&call, &stop) };
                if let Err(e) = &r {
                    let what = "an all-reduce through the reduction slots";
                    crate::guard::fail_communicator(&shared, e.clone(), what);
                }
                *lock(&fill) = Some(r.map(|()| Collective::default()));
            }),
        )?;
        let mut c = Collective::deferred(cell);
        self.track_stream_end(&mut c, stream)?;
        Ok(c)
    }
}
