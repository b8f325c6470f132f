//! What one stream-ordered small message costs the device, with no second process: two streams
//! of one device bounce a message through two slots in registered host memory (as stream-ordered
//! pairs do, `FLAGCX_P2P_STREAM=on`), every step enqueued up front and synchronized once, so
//! the time per round trip is the device's chain of waits, copies and writes alone. Each size
//! runs as `DeviceAdaptor::stream_slot_steps` runs a call (one kernel per step on CUDA), as
//! separate stream operations (`slot_steps_in_order`: a wait, a copy and two writes, or a wait
//! and a sized copy), and (CUDA) with the slots in device memory instead, or with inboxes in
//! device memory beside the host slots (as stream-ordered IPC pairs run), alternating; every
//! byte of the last echo is checked.
//!
//! ```sh
//! FLAGCX_VENDOR=cuda cargo run --release --example slot_pingpong
//! ```

use std::process::ExitCode;
use std::time::Instant;

use flagcx::{Adaptor, DeviceAdaptor, DeviceBuffer, DevicePtr, SlotInbox, SlotStep, Stream};

type Error = Box<dyn std::error::Error>;

/// Bytes per slot (the stream-ordered path's largest message).
const SLOT: usize = 32 << 10;

fn main() -> ExitCode {
    flagcx::init_logging();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("slot_pingpong: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Page-aligned host memory, unmapped on drop.
struct HostPages {
    ptr: *mut u8,
    len: usize,
}

impl HostPages {
    fn new(len: usize) -> Result<Self, Error> {
        // SAFETY: an anonymous private mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(HostPages { ptr: p.cast(), len })
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // SAFETY: mapped by `new` with `len` bytes; unregistered before this runs.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn run() -> Result<(), Error> {
    let a = Adaptor::from_env()?;
    // Page 0: per direction a status word and a size word; then one slot per direction.
    let pages = HostPages::new(4096 + 2 * SLOT)?;
    // SAFETY: `pages` outlives the unregister below.
    let base = unsafe { a.host_register(pages.ptr, pages.len) }?;
    let r = bounce(&a, &pages, base);
    // SAFETY: every stream using the mapping was synchronized (or dropped) by `bounce`.
    let u = unsafe { a.host_unregister(pages.ptr) };
    r.and(u.map_err(Into::into))
}

/// The three ways a round trip is run.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Slots in registered host memory, `stream_slot_steps`.
    OneCall,
    /// The same slots, `slot_steps_in_order`.
    InOrder,
    /// Slots in device memory, `stream_slot_steps` (CUDA: kernels polling device memory).
    DeviceSlots,
    /// Slots in host memory with inboxes in device memory, `stream_slot_steps`: what
    /// stream-ordered IPC pairs do (the put writes the slot, then the inbox; the take polls
    /// the inbox).
    Inbox,
}

fn bounce(a: &Adaptor, pages: &HostPages, host_base: DevicePtr) -> Result<(), Error> {
    let (ping, pong) = (Stream::new(a)?, Stream::new(a)?);
    let bufs = [DeviceBuffer::new(a, SLOT)?, DeviceBuffer::new(a, SLOT)?];
    let dev_slots = DeviceBuffer::new(a, 4096 + 2 * SLOT)?;
    dev_slots.fill(0, &ping)?;
    // Only a kernel reaches device-memory slots: the in-order form copies through the host.
    let device_mode = a.vendor() == flagcx::Vendor::Cuda;
    // Direction d: status word at 64 d, size word at 64 d + 8, slot at 4096 + d × SLOT.
    let inbox = |d: usize| {
        let at = |off: usize| DevicePtr(dev_slots.ptr().0 + off as u64);
        SlotInbox {
            slot: at(4096 + d * SLOT),
            len_at: at(64 * d + 8),
            status: at(64 * d),
        }
    };
    let put = |base: DevicePtr, ib: bool, d: usize, src: DevicePtr, n: usize, k: u64| {
        let at = |off: usize| DevicePtr(base.0 + off as u64);
        SlotStep::Put {
            wait: None,
            src,
            len: n,
            slot_host: {
                // SAFETY: slot `d` lies within the host mapping (used by the in-order form,
                // which only ever runs on the host slots).
                unsafe { pages.ptr.add(4096 + d * SLOT) }
            },
            slot: at(4096 + d * SLOT),
            writes: [(at(64 * d + 8), n as u64), (at(64 * d), k)],
            inbox: ib.then(|| inbox(d)),
        }
    };
    let take = |base: DevicePtr, ib: bool, d: usize, dst: DevicePtr, n: usize, k: u64| {
        let at = |off: usize| DevicePtr(base.0 + off as u64);
        SlotStep::Take {
            wait: (at(64 * d), k),
            slot: at(4096 + d * SLOT),
            len_at: at(64 * d + 8),
            dst,
            cap: n,
            inbox: ib.then(|| inbox(d)),
            // As the library's takes: a word written after the copy, which its engine polls.
            done: Some((at(64 * d + 24), k)),
        }
    };
    println!(
        "slot_pingpong: {} device {}, two streams; µs per round trip (and of it, the host's enqueueing)",
        a.vendor(),
        a.device()
    );
    println!(
        "{:>8} {:>8} {:>22} {:>22} {:>22} {:>22}",
        "bytes",
        "iters",
        "host slots, one call",
        "host slots, in order",
        "device slots, one call",
        "host slots + inbox"
    );
    let iters = 2000u64;
    let mut seq = 0u64;
    for n in [8usize, 512, 4096, SLOT] {
        let data: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(29) ^ 0x5A).collect();
        let modes = [Mode::OneCall, Mode::InOrder, Mode::DeviceSlots, Mode::Inbox];
        let mut best = [(f64::MAX, 0.0); 4];
        for round in 0..3 * modes.len() {
            let mode = modes[round % modes.len()];
            if matches!(mode, Mode::DeviceSlots | Mode::Inbox) && !device_mode {
                continue;
            }
            let ib = mode == Mode::Inbox;
            let base = match mode {
                Mode::DeviceSlots => dev_slots.ptr(),
                _ => host_base,
            };
            bufs[0].write(0, &data, &ping)?;
            bufs[1].fill(0, &pong)?;
            ping.synchronize()?;
            pong.synchronize()?;
            let enqueue = |s: &Stream<Adaptor>, step: SlotStep| -> Result<(), Error> {
                // SAFETY: the steps' words and slots are in the registered mapping or the
                // device buffer, the buffers live until both streams are synchronized below;
                // messages fit their slots.
                unsafe {
                    match mode {
                        Mode::InOrder => flagcx::slot_steps_in_order(a, s.handle(), &[step])?,
                        _ => a.stream_slot_steps(s.handle(), &[step])?,
                    }
                }
                Ok(())
            };
            let t0 = Instant::now();
            for _ in 0..iters {
                seq += 1;
                // Statuses only grow, so each wait is for this round trip's message.
                enqueue(&ping, put(base, ib, 0, bufs[0].ptr(), n, seq))?;
                enqueue(&pong, take(base, ib, 0, bufs[1].ptr(), n, seq))?;
                enqueue(&pong, put(base, ib, 1, bufs[1].ptr(), n, seq))?;
                enqueue(&ping, take(base, ib, 1, bufs[0].ptr(), n, seq))?;
            }
            let enq = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
            ping.synchronize()?;
            pong.synchronize()?;
            let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
            let i = round % modes.len();
            if us < best[i].0 {
                best[i] = (us, enq);
            }
            let mut echo = vec![0u8; n];
            bufs[0].read(0, &mut echo, &ping)?;
            if echo != data {
                return Err(format!("{n} bytes: the echo differs from what was sent").into());
            }
        }
        let cell = |b: (f64, f64)| match b.0 {
            f64::MAX => "-".to_string(),
            _ => format!("{:.2} ({:.2})", b.0, b.1),
        };
        println!(
            "{n:>8} {iters:>8} {:>22} {:>22} {:>22} {:>22}",
            cell(best[0]),
            cell(best[1]),
            cell(best[2]),
            cell(best[3])
        );
    }
    Ok(())
}
