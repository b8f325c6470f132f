//! Device-initiated transfers on CUDA: kernels drive a port channel through
//! `include/flagcx/device.cuh` (kernels in `examples/port/port_kernels.cu`, loaded as PTX at
//! run time), and every byte they move is checked.
//!
//! ```sh
//! nvcc -ptx -arch=compute_75 -I crates/flagcx-p2p/include \
//!      -o /tmp/port.ptx examples/port/port_kernels.cu          # or use the shipped PTX
//! flagcx-run -n 2 -- target/release/examples/port_pingpong [/tmp/port.ptx]
//! ```
//!
//! Prints, for rank 0: the 8 B put-with-signal/wait ping-pong round trip between the two
//! kernels, and the same with the 8 bytes carried in the trigger (`put_value_with_signal`); the time per trigger until the device sees the proxy took it (which bounds the
//! pick-up time from above) and per flush; and the bandwidth of back-to-back 4 MiB puts next
//! to the same copies issued from the host (the copy engine's ceiling on this placement).

use std::ffi::c_void;
use std::process::ExitCode;

use flagcx::cuda::kernel::Module;
use flagcx::cuda::CudaAdaptor;
use flagcx::p2p::port::PortRaw;
use flagcx::{Comm, DeviceAdaptor, DeviceBuffer, Stream};
use flagcx_adaptor::{Event, WaitCondition};

type Error = Box<dyn std::error::Error>;

/// The kernels' PTX, as shipped (built from `examples/port/port_kernels.cu`).
const SHIPPED_PTX: &str = include_str!("port/port_kernels.ptx");

const BIG: usize = 4 << 20;

fn pattern(size: usize, salt: u8) -> Vec<u8> {
    (0..size)
        .map(|i| (i as u8).wrapping_mul(131).wrapping_add(salt) ^ (i >> 9) as u8)
        .collect()
}

fn main() -> ExitCode {
    flagcx::init_logging();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("port_pingpong: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Launches `name` with one thread; `params` point at the kernel's arguments in order.
fn launch(
    module: &Module,
    name: &std::ffi::CStr,
    stream: &Stream<CudaAdaptor>,
    params: &mut [*mut c_void],
) -> Result<(), Error> {
    let f = module.function(name)?;
    // SAFETY: each kernel's parameters are listed by its caller in the declared order and
    // types (PortRaw is PortChannelHandle's layout); the buffers outlive the synchronize that
    // follows every launch.
    unsafe { module.launch(f, 1, 1, stream.handle(), params)? };
    Ok(())
}

/// Times `bus_echo`: µs per round trip of a word through host memory and a spinning thread.
fn bus_echo(
    a: &CudaAdaptor,
    module: &Module,
    stream: &Stream<CudaAdaptor>,
    read_out: &dyn Fn() -> Result<(u64, u64), Error>,
    out_ptr: &mut u64,
) -> Result<f64, Error> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    // Two words 64 bytes apart in a page of registered host memory.
    let page = Box::leak(Box::new([0u64; 512]));
    let host = page.as_mut_ptr().cast::<u8>();
    // SAFETY: a live, leaked allocation of 4096 bytes; unregistered below.
    let dev = unsafe { a.host_register(host, 4096)? };
    // SAFETY: aligned words of the leaked page, touched only atomically from here on.
    let (ping, pong) = unsafe {
        (
            &*(host as *const AtomicU64),
            &*(host.add(64) as *const AtomicU64),
        )
    };
    let stop = AtomicBool::new(false);
    let n = 1000u32;
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            let mut last = 0;
            while !stop.load(Ordering::Relaxed) {
                let v = ping.load(Ordering::Acquire);
                if v != last {
                    pong.store(v, Ordering::Release);
                    last = v;
                }
                std::hint::spin_loop();
            }
        });
        let (mut p, mut q, mut n) = (dev.0, dev.0 + 64, n);
        let r = launch(
            module,
            c"bus_echo",
            stream,
            &mut [arg(&mut p), arg(&mut q), arg(&mut n), arg(out_ptr)],
        )
        .and_then(|()| Ok(stream.synchronize()?));
        stop.store(true, Ordering::Relaxed);
        r
    });
    // SAFETY: the kernel finished (synchronized) and nothing else uses the page.
    unsafe { a.host_unregister(host)? };
    r?;
    Ok(read_out()?.0 as f64 / 1e3 / f64::from(n))
}

fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

fn run() -> Result<(), Error> {
    let ptx = match std::env::args().nth(1) {
        Some(path) => std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?,
        None => SHIPPED_PTX.to_string(),
    };
    let local: usize = std::env::var("FLAGCX_LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let probe = CudaAdaptor::open(0)?;
    let device = match std::env::var("FLAGCX_DEVICE") {
        Ok(d) => d.parse()?,
        Err(_) => local % probe.device_count()?,
    };
    drop(probe);
    let a = CudaAdaptor::open(device)?;
    let comm = Comm::from_env(a.clone())?;
    if comm.nranks() != 2 {
        return Err("port_pingpong needs exactly two ranks".into());
    }
    let me = comm.rank();
    let peer = 1 - me;
    let stream = Stream::new(&a)?;
    let src = DeviceBuffer::new(&a, BIG)?;
    let dst = DeviceBuffer::new(&a, BIG)?;
    let scratch = DeviceBuffer::new(&a, BIG)?;
    let out = DeviceBuffer::new(&a, 24)?;
    src.write(0, &pattern(BIG, me as u8), &stream)?;
    dst.fill(0, &stream)?;
    stream.synchronize()?;
    let (rs, rd) = (
        comm.register(src.ptr(), BIG)?,
        comm.register(dst.ptr(), BIG)?,
    );
    let t0 = std::time::Instant::now();
    let ch = comm.port_channel(peer, &[&rs, &rd], 64)?;
    let setup = t0.elapsed();
    let module = Module::load_ptx(&a, &ptx)?;
    let mut raw: PortRaw = ch.raw();
    let mut out_ptr = out.ptr().0;
    let read_out = || -> Result<(u64, u64), Error> {
        let mut b = [0u8; 16];
        out.read(0, &mut b, &stream)?;
        let ns = u64::from_le_bytes(b[..8].try_into()?);
        let code = u64::from_le_bytes(b[8..].try_into()?);
        if code != 0 {
            return Err(format!("kernel failed with port code {code}: {:?}", ch.check()).into());
        }
        Ok((ns, code))
    };
    let barrier = |comm: &Comm<CudaAdaptor>| -> Result<(), Error> {
        comm.barrier(stream.handle())?;
        stream.synchronize()?;
        Ok(())
    };

    // 1. Ping-pong of 8 B between the two kernels.
    let (warm, iters) = (100u32, 1000u32);
    let (mut first, mut w, mut n, mut bytes, mut seen) =
        ((me == 0) as i32, warm, iters, 8u64, 0u64);
    launch(
        &module,
        c"port_pingpong",
        &stream,
        &mut [
            arg(&mut raw),
            arg(&mut first),
            arg(&mut w),
            arg(&mut n),
            arg(&mut bytes),
            arg(&mut seen),
            arg(&mut out_ptr),
        ],
    )?;
    stream.synchronize()?;
    let (ns, _) = read_out()?;
    let mut got = [0u8; 8];
    dst.read(0, &mut got, &stream)?;
    if got[..] != pattern(8, peer as u8)[..] {
        return Err(format!("ping-pong: rank {me} got {got:?} from rank {peer}").into());
    }
    let rtt_us = ns as f64 / 1e3 / iters as f64;
    let mut signals = u64::from(warm + iters);
    barrier(&comm)?;

    // 1b. The same with 8-byte values carried in the triggers (put_value_with_signal).
    let (mut first, mut w, mut n, mut seen, mut mine) =
        ((me == 0) as i32, warm, iters, signals, dst.ptr().0);
    out.fill(0, &stream)?;
    launch(
        &module,
        c"port_pingpong_value",
        &stream,
        &mut [
            arg(&mut raw),
            arg(&mut first),
            arg(&mut w),
            arg(&mut n),
            arg(&mut seen),
            arg(&mut mine),
            arg(&mut out_ptr),
        ],
    )?;
    stream.synchronize()?;
    let (ns, _) = read_out()?;
    let mut wrong = [0u8; 8];
    out.read(16, &mut wrong, &stream)?;
    let wrong = u64::from_le_bytes(wrong);
    if wrong != 0 {
        return Err(format!("value ping-pong: rank {me} saw {wrong} wrong values").into());
    }
    let value_rtt_us = ns as f64 / 1e3 / iters as f64;
    signals += u64::from(warm + iters);
    barrier(&comm)?;

    // 2. Pick-ups and flushes (rank 0 only).
    let (mut pickup_us, mut flush_us) = (0.0, 0.0);
    if me == 0 {
        for (name, us) in [
            (c"port_pickups", &mut pickup_us),
            (c"port_flushes", &mut flush_us),
        ] {
            let mut n = 1000u32;
            launch(
                &module,
                name,
                &stream,
                &mut [arg(&mut raw), arg(&mut n), arg(&mut out_ptr)],
            )?;
            stream.synchronize()?;
            *us = read_out()?.0 as f64 / 1e3 / f64::from(n);
        }
    }
    barrier(&comm)?;

    // The bus alone: the device writes host memory, a spinning CPU thread echoes it back.
    let mut echo_us = 0.0;
    if me == 0 {
        echo_us = bus_echo(&a, &module, &stream, &read_out, &mut out_ptr)?;
    }
    barrier(&comm)?;

    // 3. Back-to-back 4 MiB puts from rank 0's kernel; rank 1 waits for each round's final
    //    signal on its stream. Alternating with them, the ceiling: the same copies issued from
    //    the host, into the same destination. Medians of three rounds of each.
    let (puts, rounds) = (200u32, 3u64);
    // The ceiling copies where the puts do: into the peer's buffer through its mapping (an IPC
    // pair; across two GPUs, the link between them), else into local memory (a staged pair).
    let (ceiling_dst, ceiling_kind) = match ch.peer_buffer(1) {
        Some(p) => (p, "host-issued copies into the peer"),
        None => (scratch.ptr(), "host-issued copies within this GPU"),
    };
    let (mut ours, mut host) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if me == 0 {
            let (mut n, mut bytes) = (puts, BIG as u64);
            launch(
                &module,
                c"port_puts",
                &stream,
                &mut [
                    arg(&mut raw),
                    arg(&mut n),
                    arg(&mut bytes),
                    arg(&mut out_ptr),
                ],
            )?;
            stream.synchronize()?;
            ours.push((BIG as f64 * f64::from(puts)) / read_out()?.0 as f64);
            let (e0, e1) = (Event::new(&a, true)?, Event::new(&a, true)?);
            e0.record(&stream)?;
            for _ in 0..puts {
                // SAFETY: both are live allocations of BIG bytes (the peer's stays mapped until
                // the channel closes, and holds the bytes the puts write too); synchronized
                // below.
                unsafe { a.memcpy_d2d_async(ceiling_dst, src.ptr(), BIG, stream.handle())? };
            }
            e1.record(&stream)?;
            e1.synchronize()?;
            host.push((BIG as f64 * f64::from(puts)) / (e1.elapsed_ms_since(&e0)? as f64 * 1e6));
        } else {
            // SAFETY: the flag is this channel's live device word.
            unsafe {
                a.stream_wait_value64(
                    stream.handle(),
                    flagcx::DevicePtr(raw.flag),
                    signals + round + 1,
                    WaitCondition::Geq,
                )?
            };
            stream.synchronize()?;
        }
    }
    if me == 1 {
        let mut all = vec![0u8; BIG];
        dst.read(0, &mut all, &stream)?;
        if all != pattern(BIG, peer as u8) {
            return Err("puts: the 4 MiB buffer differs from rank 0's".into());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (gbs, ceiling) = (median(&mut ours), median(&mut host));
    barrier(&comm)?;
    let (triggers, moved) = ch.stats();
    let path = if ch.is_staged() {
        "staged pair: puts through shared-memory lanes"
    } else {
        "IPC pair: puts are one copy into the peer"
    };
    ch.close()?;
    if me == 0 {
        println!(
            "port: rank 0 on cuda device {device}, rank 1 on device {}, {path} (channel setup {:.1} ms)",
            comm.peer_info(peer).map_or(0, |p| p.device),
            setup.as_secs_f64() * 1e3
        );
        println!("port pingpong 8 B: {rtt_us:.2} us round trip ({iters} rounds, kernel to kernel)");
        println!("port pingpong 8 B value: {value_rtt_us:.2} us round trip (put_value_with_signal; every value checked)");
        println!("port pick-up: {pickup_us:.2} us per trigger (device write -> proxy -> tail seen by the device)");
        println!("bus echo: {echo_us:.2} us (device write -> a spinning CPU thread -> device; the floor of the line above)");
        println!("port flush: {flush_us:.2} us per flush (trigger -> proxy -> stream write -> flushed word)");
        println!(
            "port puts 4 MiB x{puts}: {gbs:.1} GB/s; {ceiling_kind} {ceiling:.1} GB/s; ratio {:.3} (medians of {rounds})",
            gbs / ceiling
        );
        println!("port ok: {triggers} triggers, {moved} bytes put, every byte checked");
    } else {
        println!("port ok: rank 1 checked {BIG} bytes");
    }
    Ok(())
}
