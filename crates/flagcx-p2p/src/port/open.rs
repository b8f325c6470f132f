//! Making port channels: registration of buffers, and the hello both ranks of a pair
//! exchange to create a channel (IPC handles on an IPC pair, lanes on a staged one).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use flagcx_adaptor::{AdaptorError, DeviceAdaptor, DevicePtr, IpcMemHandle, StreamHandle};

use super::{
    lane, Channel, ControlBlock, PortChannel, PortProxy, RegInner, Registered, DEVICE_WORDS,
    FRAME_HELLO, FRAME_REFUSED, MAX_BUFFERS, MAX_DEPTH,
};
use crate::comm::Comm;
use crate::error::{CommError, Result};
use crate::peer::TransportKind;
use crate::wire::{Reader, Tag, Writer};

/// Local resources made before the peer's hello arrives; freed if creation fails.
struct Partial<'a, A: DeviceAdaptor> {
    adaptor: &'a A,
    control: Option<ControlBlock>,
    words: Option<DevicePtr>,
    streams: Vec<StreamHandle>,
    opened: Vec<DevicePtr>,
    lanes: Vec<lane::Lane>,
}

impl<A: DeviceAdaptor> Drop for Partial<'_, A> {
    fn drop(&mut self) {
        for &b in &self.opened {
            // SAFETY: nothing was issued on these mappings yet.
            let _ = unsafe { self.adaptor.ipc_close(b) };
        }
        for &s in &self.streams {
            let _ = self.adaptor.stream_synchronize(s);
            let _ = self.adaptor.stream_destroy(s);
        }
        for l in &self.lanes {
            // SAFETY: the streams are synchronized and nothing was published on the lanes.
            unsafe { l.release(self.adaptor) };
        }
        if let Some(w) = self.words.take() {
            // SAFETY: the streams that touched it are synchronized; the peer never mapped it
            // (creation failed before or while exchanging) or failed along with us.
            let _ = unsafe { self.adaptor.mem_free(w) };
        }
        if let Some(mut c) = self.control.take() {
            c.release(self.adaptor);
        }
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// Makes `len` bytes at `ptr` (device memory of this rank's adaptor) nameable in port
    /// channels. Local: nothing is exchanged until a channel names the buffer.
    pub fn register(&self, ptr: DevicePtr, len: usize) -> Result<Registered> {
        if len == 0 {
            return Err(CommError::InvalidArgument(
                "cannot register a zero-byte buffer".into(),
            ));
        }
        let (base, size) = self.adaptor.mem_get_range(ptr)?;
        let end = ptr.0.checked_add(len as u64);
        if end.map_or(true, |e| e > base.0 + size as u64) {
            return Err(CommError::InvalidArgument(format!(
                "{len} bytes at {ptr} run past the end of their allocation ({size} bytes at \
                 {base})"
            )));
        }
        let handle = if self.adaptor.capabilities().ipc_bytes {
            Some(self.adaptor.ipc_get_handle(base)?)
        } else {
            None
        };
        Ok(Registered {
            inner: Arc::new(RegInner {
                ptr,
                len,
                handle,
                offset: ptr.0 - base.0,
            }),
        })
    }

    /// Ends a registration. Fails while a channel still names the buffer (close it first).
    pub fn deregister(&self, buffer: Registered) -> Result<()> {
        match Arc::try_unwrap(buffer.inner) {
            Ok(_) => Ok(()),
            Err(inner) => Err(CommError::InvalidArgument(format!(
                "{} bytes at {} are still named by {} port channel(s)",
                inner.len,
                inner.ptr,
                Arc::strong_count(&inner) - 1
            ))),
        }
    }

    /// Creates a port channel with `peer`: both ranks call it (in the same order as their
    /// other channels with that peer), each with the buffers it registered; triggers name
    /// them by index. `depth` is the FIFO's number of trigger slots (1 to [`MAX_DEPTH`]).
    ///
    /// On an IPC pair a put is one copy into the peer's buffer, mapped here. On a staged pair
    /// of one node (different vendors, or `FLAGCX_P2P_DISABLE`) puts go through a lane of
    /// shared host memory ([`lane`]): a copy out on this rank's stream, a copy in on the
    /// peer's; each rank then maps and registers two lanes (its own and the peer's) of 8
    /// slots ([`lane::SLOT_ENV`] bytes each, 1 MiB by default) per channel. Both need a vendor
    /// with host registration and 64-bit stream memory operations on both ranks; pairs on
    /// different hosts are `Unsupported`.
    ///
    /// Where one rank cannot make its side (a bad argument or setting, a runtime failure), it
    /// returns that error and the peer gets [`CommError::RemoteFailure`] with the reason; the
    /// pair can make its next channel as usual.
    pub fn port_channel(
        &self,
        peer: usize,
        buffers: &[&Registered],
        depth: usize,
    ) -> Result<PortChannel<A>> {
        if peer >= self.nranks || peer == self.rank {
            return Err(CommError::InvalidArgument(format!(
                "port channel peer {peer}: not another rank of this {}-rank job",
                self.nranks
            )));
        }
        // Both ranks decide from what both announced at init, so neither waits for a hello
        // the other will not send.
        let able = |c: &flagcx_adaptor::Capabilities| c.host_register && c.stream_mem_ops_64;
        let (mine, theirs) = (&self.infos[self.rank], &self.infos[peer]);
        if !able(&mine.caps) || !able(&theirs.caps) {
            let vendor = if able(&mine.caps) {
                theirs.vendor
            } else {
                mine.vendor
            };
            return Err(AdaptorError::Unsupported {
                vendor,
                op: "device-initiated transfers (port channels need host registration and \
                     64-bit stream memory operations on both ranks)",
            }
            .into());
        }
        let vendor = self.adaptor.vendor();
        let staged = match self.transports[peer] {
            Some(TransportKind::Ipc) => false,
            Some(TransportKind::Staged) => true,
            _ => {
                return Err(AdaptorError::Unsupported {
                    vendor,
                    op: "port channels with a peer on another host (network pairs are not \
                         supported yet)",
                }
                .into())
            }
        };
        let a = &self.adaptor;
        let prepare = || -> Result<(Partial<'_, A>, Vec<u8>, DevicePtr)> {
            if depth == 0 || depth > MAX_DEPTH {
                return Err(CommError::InvalidArgument(format!(
                    "port channel depth {depth}: must be 1 to {MAX_DEPTH}"
                )));
            }
            if buffers.len() > MAX_BUFFERS {
                return Err(CommError::InvalidArgument(format!(
                    "{} buffers: a port channel names at most {MAX_BUFFERS}",
                    buffers.len()
                )));
            }
            let mut part = Partial {
                adaptor: a,
                control: Some(ControlBlock::new(a, depth)?),
                words: None,
                streams: Vec::new(),
                opened: Vec::new(),
                lanes: Vec::new(),
            };
            part.streams.push(a.stream_create()?);
            part.streams.push(a.stream_create()?);
            let words = a.mem_alloc(DEVICE_WORDS)?;
            part.words = Some(words);
            // SAFETY: our fresh allocation of DEVICE_WORDS bytes; synchronized below.
            unsafe { a.memset_async(words, 0, DEVICE_WORDS, part.streams[0])? };
            a.stream_synchronize(part.streams[0])?;

            let mut w = Writer::new();
            w.u8(FRAME_HELLO).u32(depth as u32).u8(staged as u8);
            if staged {
                part.streams.push(a.stream_create()?);
                let slot = lane::slot_from_env()?;
                part.lanes.push(lane::Lane::create(a, peer, slot)?);
                w.u32(buffers.len() as u32);
                for b in buffers {
                    w.u64(b.inner.len as u64);
                }
                w.u64(slot as u64);
            } else {
                let flag = crate::link::export(a, words, 8, TransportKind::Ipc)?;
                let handle = flag
                    .handle
                    .ok_or_else(|| CommError::Protocol("flag word has no IPC handle".into()))?;
                w.bytes(&handle.to_wire()).u64(flag.offset);
                w.u32(buffers.len() as u32);
                for b in buffers {
                    let h = b.inner.handle.as_ref().ok_or_else(|| {
                        CommError::Protocol("a registered buffer has no IPC handle".into())
                    })?;
                    w.bytes(&h.to_wire())
                        .u64(b.inner.offset)
                        .u64(b.inner.len as u64);
                }
            }
            Ok((part, w.finish(), words))
        };
        // From here the peer waits for a frame from us: on a local failure it gets a refusal
        // saying why (and we take its hello or refusal), so neither rank waits forever and the
        // next channel's frames stay in step.
        let (mut part, ours, words) = match prepare() {
            Ok(p) => p,
            Err(e) => {
                let refusal = Writer::new().u8(FRAME_REFUSED).str(&e.to_string()).finish();
                if self._boot.send(peer, Tag::Port, &refusal, &[]).is_ok() {
                    let _ = self._boot.recv(peer, Tag::Port);
                }
                return Err(e);
            }
        };
        let lane_fd: Vec<_> = part.lanes.iter().map(|l| l.segment().fd()).collect();
        self._boot.send(peer, Tag::Port, &ours, &lane_fd)?;
        drop(lane_fd);
        let (hello, mut fds) = self._boot.recv(peer, Tag::Port)?;
        let mut r = Reader::new(&hello, "port channel hello");
        match r.u8()? {
            FRAME_HELLO => {}
            FRAME_REFUSED => {
                return Err(CommError::RemoteFailure {
                    peer,
                    reason: format!(
                        "it could not make its side of the port channel: {}",
                        r.str()?
                    ),
                })
            }
            _ => {
                return Err(CommError::Protocol(
                    "port channel: expected the peer's hello (channels must be created and \
                     closed in the same order on both ranks)"
                        .into(),
                ))
            }
        }
        let _peer_depth = r.u32()?;
        if r.u8()? != staged as u8 {
            return Err(CommError::Protocol(
                "port channel: the peer chose the other kind of pair (IPC vs staged)".into(),
            ));
        }
        let mut remote = Vec::new();
        let mut peer_flag = DevicePtr(0);
        if staged {
            let n = r.u32()? as usize;
            if n > MAX_BUFFERS {
                return Err(CommError::Protocol(format!("peer named {n} buffers")));
            }
            for _ in 0..n {
                remote.push((DevicePtr(0), r.u64()? as usize));
            }
            let slot = r.u64()? as usize;
            let fd = fds
                .pop()
                .ok_or_else(|| CommError::Protocol("port channel: no lane from the peer".into()))?;
            part.lanes.push(lane::Lane::open(a, fd, slot)?);
        } else {
            let mut open = |wire: &[u8], off: u64| -> Result<DevicePtr> {
                let h = IpcMemHandle::from_wire(wire)?;
                let base = a.ipc_open_handle(&h)?;
                part.opened.push(base);
                Ok(DevicePtr(base.0 + off))
            };
            let fw = r.bytes()?;
            let foff = r.u64()?;
            peer_flag = open(fw, foff)?;
            let n = r.u32()? as usize;
            if n > MAX_BUFFERS {
                return Err(CommError::Protocol(format!("peer named {n} buffers")));
            }
            for _ in 0..n {
                let wire = r.bytes()?;
                let off = r.u64()?;
                let len = r.u64()? as usize;
                remote.push((open(wire, off)?, len));
            }
        }
        r.end()?;

        let local: Vec<(DevicePtr, usize)> = buffers.iter().map(|b| (b.ptr(), b.len())).collect();
        let table = super::buffer_table(&local, &remote, staged);
        // SAFETY: the table fits the device words' allocation (at most TABLE_BYTES past
        // TABLE_OFF); `table` outlives the synchronize that follows.
        unsafe {
            a.memcpy_h2d_async(
                DevicePtr(words.0 + super::TABLE_OFF),
                table.as_ptr(),
                table.len(),
                part.streams[0],
            )?
        };
        a.stream_synchronize(part.streams[0])?;
        let proxy = self
            .ports
            .get_or_init(|| Arc::new(PortProxy::<A>::new(self.rank, self.config.timeout)))
            .clone()
            .downcast::<PortProxy<A>>()
            .map_err(|_| CommError::Protocol("the port proxy slot holds another type".into()))?;
        let link = if staged {
            let inb = part.lanes.pop().expect("opened above");
            let out = part.lanes.pop().expect("created above");
            Some(lane::StagedLink {
                out,
                inb,
                stream: part.streams[2],
                published: AtomicU64::new(0),
            })
        } else {
            None
        };
        let ch = Arc::new(Channel {
            adaptor: a.clone(),
            id: proxy.next_id(),
            peer,
            depth,
            control: part.control.take().expect("made above"),
            words,
            stream: part.streams[0],
            ctl: part.streams[1],
            local,
            remote,
            peer_flag,
            staged: link,
            error: Mutex::new(None),
            triggers_done: AtomicU64::new(0),
            bytes_put: AtomicU64::new(0),
            boot: self._boot.clone(),
            shared: self.shared.clone(),
        });
        part.words = None;
        part.streams.clear();
        let opened = std::mem::take(&mut part.opened);
        proxy.add(ch.clone(), crate::numa::adaptor_cpus(a))?;
        Ok(PortChannel {
            ch,
            proxy,
            _buffers: buffers.iter().map(|&b| b.clone()).collect(),
            opened,
            done: false,
        })
    }
}
