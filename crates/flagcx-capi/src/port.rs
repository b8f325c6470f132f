//! Port channels (device-initiated transfers) from C and C++: a flagcx-rs extension of the
//! FlagCX ABI. Buffers are registered with `flagcxCommRegister`; `flagcxPortChannelCreate`
//! returns the channel and the handle a kernel drives through `flagcx/device.cuh`.

use std::ffi::{c_int, c_void};

use flagcx_rs::p2p::port::{PortChannel, PortRaw};
use flagcx_rs::Adaptor;

use crate::{comm_ref, flagcxComm, flagcxResult_t, guard, invalid, put, Failure, Registration, R};

/// A port channel (`flagcxPortChannel_t`).
pub struct flagcxPortChannel {
    chan: PortChannel<Adaptor>,
}

/// What a kernel needs to drive a port channel (`flagcxPortChannelHandle_t`): Rust's
/// [`PortRaw`], whose layout `flagcx.h` and `flagcx/device.cuh` repeat.
pub type flagcxPortChannelHandle = PortRaw;

/// The channel behind `channel`, or an `InvalidArgument` failure for NULL.
///
/// # Safety
/// `channel` is NULL or live (from `flagcxPortChannelCreate`, not yet closed).
unsafe fn chan_ref<'a>(channel: *const flagcxPortChannel) -> R<&'a flagcxPortChannel> {
    // SAFETY: the caller's contract.
    unsafe { channel.as_ref() }.ok_or_else(|| invalid("NULL port channel"))
}

/// Creates a port channel with `peer`. Both ranks call it, in the same order as their other
/// channels with that peer, each with `nhandles` registrations from `flagcxCommRegister`;
/// triggers name buffers by their index in these lists. `depth` is the FIFO's slot count.
///
/// # Safety
/// `comm` is NULL or live; `handles` holds `nhandles` live registration handles of `comm`;
/// `channel` and `device_handle` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxPortChannelCreate(
    comm: *const flagcxComm,
    peer: c_int,
    handles: *const *mut c_void,
    nhandles: c_int,
    depth: c_int,
    channel: *mut *mut flagcxPortChannel,
    device_handle: *mut flagcxPortChannelHandle,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        if channel.is_null() || device_handle.is_null() {
            return Err(invalid("NULL channel or device handle pointer"));
        }
        let (Ok(peer), Ok(n), Ok(depth)) = (
            usize::try_from(peer),
            usize::try_from(nhandles),
            usize::try_from(depth),
        ) else {
            return Err(invalid("negative peer, handle count or depth"));
        };
        if n > 0 && handles.is_null() {
            return Err(invalid("NULL handle list"));
        }
        let mut regs = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: `handles` holds `n` pointers (the caller's contract).
            let h = unsafe { *handles.add(i) }.cast::<Registration>();
            // SAFETY: a live registration from flagcxCommRegister (the caller's contract).
            let r = unsafe { h.as_ref() }.ok_or_else(|| invalid(format!("handle {i} is NULL")))?;
            regs.push(r.port.as_ref().ok_or_else(|| {
                Failure(
                    crate::flagcxNotSupported,
                    format!(
                        "registration {i}: this vendor's memory cannot be named by port channels"
                    ),
                )
            })?);
        }
        let chan = c.comm.port_channel(peer, &regs, depth)?;
        let h = chan.raw();
        let boxed = Box::into_raw(Box::new(flagcxPortChannel { chan }));
        // SAFETY: both checked non-null above; writable by the caller's contract.
        unsafe {
            device_handle.write(h);
            put(channel, boxed, "channel pointer")
        }
    })
}

/// Fails the channel on purpose, releasing every kernel waiting on it on both ranks.
///
/// # Safety
/// `channel` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn flagcxPortChannelPoison(
    channel: *mut flagcxPortChannel,
) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        unsafe { chan_ref(channel) }?.chan.poison();
        Ok(())
    })
}

/// `flagcxSuccess` while the channel is healthy; else why it failed.
///
/// # Safety
/// `channel` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn flagcxPortChannelCheck(channel: *mut flagcxPortChannel) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        Ok(unsafe { chan_ref(channel) }?.chan.check()?)
    })
}

/// Closes the channel (both ranks, after every kernel using it ended) and frees it; returns the
/// channel's failure if it had one. The channel is gone either way.
///
/// # Safety
/// `channel` is NULL or live, and not used again.
#[no_mangle]
pub unsafe extern "C" fn flagcxPortChannelClose(channel: *mut flagcxPortChannel) -> flagcxResult_t {
    guard(None, || {
        if channel.is_null() {
            return Err(invalid("NULL port channel"));
        }
        // SAFETY: made by `Box::into_raw` in flagcxPortChannelCreate; the caller gives it up.
        let c = unsafe { Box::from_raw(channel) };
        Ok(c.chan.close()?)
    })
}
