//! `flagcx-perf`: nccl-tests-style performance sweeps of point-to-point transfers, each size
//! reported next to a ceiling measured in the same run.
//!
//! ```text
//! flagcx-perf [-t sendrecv|pingpong|pairs] [-b 8] [-e 64M] [-f 2] [-n 20] [-w 5] [-c]
//!             [-N 2] [--vendor V | --vendors A,B] [--transport ipc|staged|auto]
//!             [--json] [--plot FILE.svg]
//! ```
//!
//! Without `FLAGCX_RANK` it starts `-N` ranks of itself (like `flagcx-run`). Rank 0 prints, per
//! size: bytes, time (µs), algorithm and bus bandwidth (GB/s), wrong bytes (with `-c`), and the
//! ceiling — the vendor's bare copy for that size measured just before in the same traffic
//! pattern (device-to-device for IPC, the slower of pinned device→host and host→device for
//! staging, a memcpy for the host vendor; every rank copying at once for `sendrecv` and `pairs`,
//! one copy at a time for `pingpong`) — with our bandwidth as a fraction of it.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use flagcx::p2p::config::parse_size;
use flagcx::p2p::launch::{launch, LaunchSpec};
use flagcx::{Adaptor, Comm, DeviceAdaptor, DeviceBuffer, PinnedBuffer, Stream, TransportKind};

type Error = Box<dyn std::error::Error>;

#[derive(Debug, Clone)]
struct Opts {
    test: String,
    min: usize,
    max: usize,
    factor: usize,
    iters: usize,
    warmup: usize,
    check: bool,
    nranks: usize,
    vendors: Vec<String>,
    transport: String,
    json: bool,
    plot: Option<String>,
}

const USAGE: &str =
    "usage: flagcx-perf [-t sendrecv|pingpong|pairs] [-b MIN] [-e MAX] [-f FACTOR] \
[-n ITERS] [-w WARMUP] [-c] [-N RANKS] [--vendor V | --vendors A,B] [--transport ipc|staged|auto] \
[--json] [--plot FILE.svg]";

fn parse(args: &[String]) -> Result<Opts, Error> {
    let mut o = Opts {
        test: "sendrecv".into(),
        min: 8,
        max: 64 << 20,
        factor: 2,
        iters: 20,
        warmup: 5,
        check: false,
        nranks: 2,
        vendors: Vec::new(),
        transport: "auto".into(),
        json: false,
        plot: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "-t" => o.test = val()?,
            "-b" => o.min = parse_size("-b", &val()?)?,
            "-e" => o.max = parse_size("-e", &val()?)?,
            "-f" => o.factor = val()?.parse()?,
            "-n" => o.iters = val()?.parse()?,
            "-w" => o.warmup = val()?.parse()?,
            "-c" => o.check = true,
            "-N" => o.nranks = val()?.parse()?,
            "--vendor" | "--vendors" => o.vendors = val()?.split(',').map(str::to_string).collect(),
            "--transport" => o.transport = val()?,
            "--json" => o.json = true,
            "--plot" => o.plot = Some(val()?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    if !["sendrecv", "pingpong", "pairs"].contains(&o.test.as_str()) {
        return Err(format!("unknown test {:?}\n{USAGE}", o.test).into());
    }
    if !["ipc", "staged", "auto"].contains(&o.transport.as_str()) {
        return Err(format!("unknown transport {:?}\n{USAGE}", o.transport).into());
    }
    if o.factor < 2 || o.min == 0 || o.max < o.min || o.iters == 0 || o.nranks < 2 {
        return Err(format!("need -f >= 2, 0 < -b <= -e, -n >= 1, -N >= 2\n{USAGE}").into());
    }
    Ok(o)
}

fn main() -> ExitCode {
    flagcx::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = parse(&args).and_then(|o| {
        if std::env::var_os("FLAGCX_RANK").is_none() {
            self_launch(&o, &args)
        } else {
            rank_main(&o)
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flagcx-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

fn self_launch(o: &Opts, args: &[String]) -> Result<(), Error> {
    let mut program = vec![std::env::current_exe()?.to_string_lossy().into_owned()];
    program.extend(args.iter().cloned());
    let out = launch(&LaunchSpec {
        vendors: o.vendors.clone(),
        ..LaunchSpec::new(o.nranks, program)
    })?;
    if out.success() {
        Ok(())
    } else {
        Err(format!("rank {:?} failed", out.first_failure).into())
    }
}

fn byte(src: usize, size: usize, i: usize) -> u8 {
    (i as u8).wrapping_mul(151) ^ (src as u8).wrapping_mul(29) ^ (size as u8) ^ (i >> 9) as u8
}

/// One result row.
struct Row {
    bytes: usize,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: usize,
    ceil_us: f64,
    ceil_bw: f64,
    /// Which path the timed iterations' bytes took (this rank's view).
    path: String,
}

fn rank_main(o: &Opts) -> Result<(), Error> {
    let adaptor = Adaptor::from_env()?;
    let t0 = Instant::now();
    // `--transport staged` holds however the ranks were started (by this tool or a launcher).
    let mut config = flagcx::p2p::Config::from_env()?;
    if o.transport == "staged" {
        config.p2p_disable = true;
    }
    let env = flagcx::p2p::RankEnv::from_env()?;
    let comm = Comm::init(adaptor.clone(), env.rank, env.nranks, &env.id, config)?;
    let (me, n) = (comm.rank(), comm.nranks());
    let stream = Stream::new(&adaptor)?;
    let next = (me + 1) % n;
    let prev = (me + n - 1) % n;
    if o.test == "pingpong" && n != 2 {
        return Err("pingpong needs exactly two ranks (-N 2)".into());
    }
    let transports: Vec<TransportKind> = (0..n)
        .filter(|&q| q != me)
        .filter_map(|q| comm.transport(q))
        .collect();
    let kind = transports[0];
    if o.transport == "ipc" && transports.iter().any(|t| *t != TransportKind::Ipc) {
        return Err(
            "--transport ipc: some pair cannot use IPC (different vendors or no IPC handles)"
                .into(),
        );
    }
    // First transfer (a zero-byte ring), to report setup time.
    barrier(&comm, &stream, next, prev)?;
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    if me == 0 && !o.json {
        let info = comm.peer_info(next).expect("peer");
        let copier = match (comm.ipc_copier(next), comm.direct_copier(next)) {
            (Some(r), _) => format!(" (rank {r} copies both ways)"),
            (None, _) if kind == TransportKind::Ipc => " (each sender copies)".to_string(),
            (None, Some(r)) => format!(" (direct: rank {r} copies into/out of host buffers)"),
            (None, None) => String::new(),
        };
        println!(
            "# flagcx-perf {} | {} ranks | rank 0: {} device {} | rank 1: {} device {} | transport {kind}{copier} | setup + first transfer {setup_ms:.1} ms",
            o.test, n, adaptor.vendor(), adaptor.device(), info.vendor, info.device
        );
        println!(
            "# {:>12} {:>11} {:>10} {:>10} {:>7} {:>11} {:>10} {:>7} {:>7}",
            "bytes", "time_us", "algbw", "busbw", "wrong", "ceil_us", "ceil_bw", "ratio", "path"
        );
    }
    let mut rows = Vec::new();
    let mut size = o.min;
    let sizes: Vec<usize> = std::iter::from_fn(|| {
        let s = size;
        size = size.checked_mul(o.factor)?;
        (s <= o.max).then_some(s)
    })
    .collect();
    let peers: Vec<usize> = match o.test.as_str() {
        "pairs" => (0..n).filter(|&q| q != me).collect(),
        _ => vec![next],
    };
    let froms: Vec<usize> = match o.test.as_str() {
        "pairs" => (0..n).filter(|&q| q != me).collect(),
        _ => vec![prev],
    };
    // As nccl-tests do: one buffer per peer of the largest size, each size using its prefix.
    // (The direct path maps a host rank's buffer once; fresh buffers per size would measure
    // their first use.)
    let max = sizes.last().copied().unwrap_or(1).max(1);
    let alloc = |_: &usize| DeviceBuffer::new(&adaptor, max).map(Arc::new);
    let sends: Vec<Arc<DeviceBuffer<Adaptor>>> =
        peers.iter().map(alloc).collect::<Result<_, _>>()?;
    let recvs: Vec<Arc<DeviceBuffer<Adaptor>>> =
        froms.iter().map(alloc).collect::<Result<_, _>>()?;
    for (k, &size) in sizes.iter().enumerate() {
        if o.check {
            let data: Vec<u8> = (0..size).map(|i| byte(me, size, i)).collect();
            for b in &sends {
                b.write(0, &data, &stream)?;
            }
        }
        // The ceiling in the same traffic pattern: for sendrecv and pairs every rank copies at
        // once (on one GPU they share its memory bandwidth); for pingpong one copy at a time.
        barrier(&comm, &stream, next, prev)?;
        let (ceil_us, ceil_bw) = if me == 0 || o.test != "pingpong" {
            ceiling(&adaptor, &stream, kind, size, o)?
        } else {
            (0.0, 0.0)
        };
        barrier(&comm, &stream, next, prev)?;
        let mut start = Instant::now();
        let mut before = comm.stats();
        let h = stream.handle();
        for i in 0..o.warmup + o.iters {
            if i == o.warmup {
                stream.synchronize()?;
                start = Instant::now();
                before = comm.stats();
            }
            match o.test.as_str() {
                // SAFETY: every buffer holds `max >= size` bytes and outlives each wait.
                "pingpong" => unsafe {
                    if me == 0 {
                        comm.send_raw(sends[0].ptr(), size, 1, h)?.wait()?;
                        comm.recv_raw(recvs[0].ptr(), size, 1, h)?.wait()?;
                    } else {
                        comm.recv_raw(recvs[0].ptr(), size, 0, h)?.wait()?;
                        comm.send_raw(recvs[0].ptr(), size, 0, h)?.wait()?;
                    }
                },
                _ => {
                    let reqs = comm.group(|| {
                        let mut r = Vec::new();
                        for (b, &p) in sends.iter().zip(&peers) {
                            // SAFETY: as above.
                            r.push(unsafe { comm.send_raw(b.ptr(), size, p, h)? });
                        }
                        for (b, &p) in recvs.iter().zip(&froms) {
                            // SAFETY: as above.
                            r.push(unsafe { comm.recv_raw(b.ptr(), size, p, h)? });
                        }
                        Ok(r)
                    })?;
                    for r in reqs {
                        r.wait()?;
                    }
                }
            }
        }
        stream.synchronize()?;
        let ops = o.iters * (sends.len() + recvs.len());
        let path = path_taken(before, comm.stats(), ops);
        let t = start.elapsed().as_secs_f64() / o.iters as f64;
        let mut wrong = 0;
        if o.check {
            for (b, &src) in recvs.iter().zip(&froms) {
                let mut got = vec![0u8; size];
                b.read(0, &mut got, &stream)?;
                // In pingpong rank 0 gets its own bytes back.
                let src = if o.test == "pingpong" { 0 } else { src };
                wrong += got
                    .iter()
                    .enumerate()
                    .filter(|&(i, &v)| v != byte(src, size, i))
                    .count();
            }
        }
        let (time_us, algbw) = match o.test.as_str() {
            "pingpong" => (t * 1e6, size as f64 / (t / 2.0) / 1e9),
            "pairs" => (t * 1e6, (size * (n - 1)) as f64 / t / 1e9),
            _ => (t * 1e6, size as f64 / t / 1e9),
        };
        let row = Row {
            bytes: size,
            time_us,
            algbw,
            busbw: algbw,
            wrong,
            ceil_us,
            ceil_bw,
            path,
        };
        if me == 0 {
            print_row(&row, o, kind, n);
            eprintln!("progress: {}/{} sizes", k + 1, sizes.len());
        }
        rows.push(row);
    }
    let wrong: usize = rows.iter().map(|r| r.wrong).sum();
    if me == 0 {
        if !o.json {
            println!(
                "# wrong bytes in all: {wrong}{}",
                if o.check {
                    ""
                } else {
                    " (not checked; add -c)"
                }
            );
        }
        if let Some(path) = &o.plot {
            std::fs::write(path, svg(&rows, o, kind))?;
            println!("# plot written to {path}");
        }
    }
    if wrong > 0 {
        return Err(format!("rank {me}: {wrong} wrong bytes").into());
    }
    Ok(())
}

/// Names the path the bytes between two stats snapshots took: one path, or `mixed` (a direct
/// pair whose buffer was still being registered, say).
/// Which path the bytes of a measurement took; for IPC, how many of its operations the
/// posting threads finished themselves (`ipc 96% caller`).
fn path_taken(a: flagcx::PathStats, b: flagcx::PathStats, ops: usize) -> String {
    let d = [
        ("ipc", b.ipc_bytes - a.ipc_bytes),
        ("staged", b.staged_bytes - a.staged_bytes),
        ("direct", b.direct_bytes - a.direct_bytes),
        ("eager", b.eager_bytes - a.eager_bytes),
    ];
    let used: Vec<&str> = d.iter().filter(|x| x.1 > 0).map(|x| x.0).collect();
    let caller = b.caller_ops - a.caller_ops;
    match used.as_slice() {
        [] => "-".into(),
        ["ipc"] if caller > 0 && ops > 0 => {
            format!("ipc {:.0}% caller", 100.0 * caller as f64 / ops as f64)
        }
        [one] => one.to_string(),
        _ => "mixed".into(),
    }
}

fn print_row(r: &Row, o: &Opts, kind: TransportKind, n: usize) {
    let ratio = if r.ceil_bw > 0.0 {
        r.busbw / r.ceil_bw
    } else {
        0.0
    };
    if o.json {
        println!(
            "{{\"test\":\"{}\",\"ranks\":{n},\"transport\":\"{kind}\",\"bytes\":{},\"time_us\":{:.3},\"algbw_gbs\":{:.4},\"busbw_gbs\":{:.4},\"wrong\":{},\"ceiling_us\":{:.3},\"ceiling_gbs\":{:.4},\"ratio\":{:.4},\"path\":\"{}\"}}",
            o.test, r.bytes, r.time_us, r.algbw, r.busbw, r.wrong, r.ceil_us, r.ceil_bw, ratio, r.path
        );
    } else {
        println!(
            "  {:>12} {:>11.2} {:>10.2} {:>10.2} {:>7} {:>11.2} {:>10.2} {:>7.3} {:>7}",
            r.bytes, r.time_us, r.algbw, r.busbw, r.wrong, r.ceil_us, r.ceil_bw, ratio, r.path
        );
    }
}

/// A zero-byte exchange around the ring: everyone is past the previous step.
fn barrier(
    comm: &Comm<Adaptor>,
    stream: &Stream<Adaptor>,
    next: usize,
    prev: usize,
) -> Result<(), Error> {
    let b = Arc::new(DeviceBuffer::new(comm.adaptor(), 1)?);
    let reqs = comm.group(|| {
        // SAFETY: zero bytes move; `b` outlives the waits.
        unsafe {
            Ok(vec![
                comm.send_raw(b.ptr(), 0, next, stream.handle())?,
                comm.recv_raw(b.ptr(), 0, prev, stream.handle())?,
            ])
        }
    })?;
    for r in reqs {
        r.wait()?;
    }
    stream.synchronize()?;
    Ok(())
}

/// The vendor's bare copy for `size` bytes: (µs per copy, GB/s).
fn ceiling(
    a: &Adaptor,
    stream: &Stream<Adaptor>,
    kind: TransportKind,
    size: usize,
    o: &Opts,
) -> Result<(f64, f64), Error> {
    let iters = o.iters.max(5);
    let time = |f: &dyn Fn() -> flagcx::Result<()>| -> Result<f64, Error> {
        f()?;
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        stream.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / iters as f64)
    };
    let src = DeviceBuffer::new(a, size)?;
    let secs = match kind {
        TransportKind::Ipc => {
            let dst = DeviceBuffer::new(a, size)?;
            // SAFETY: both buffers hold `size` bytes and outlive the synchronize in `time`.
            time(&|| unsafe { a.memcpy_d2d_async(dst.ptr(), src.ptr(), size, stream.handle()) })?
        }
        TransportKind::Staged => {
            let host = PinnedBuffer::new(a, size)?;
            let p = host.as_ptr();
            // SAFETY: as above; the pinned buffer holds `size` bytes.
            let d2h = time(&|| unsafe { a.memcpy_d2h_async(p, src.ptr(), size, stream.handle()) })?;
            // SAFETY: as above.
            let h2d = time(&|| unsafe { a.memcpy_h2d_async(src.ptr(), p, size, stream.handle()) })?;
            d2h.max(h2d)
        }
    };
    Ok((secs * 1e6, size as f64 / secs / 1e9))
}

/// Bandwidth (ours and the ceiling) against size, log-log, as a small SVG.
fn svg(rows: &[Row], o: &Opts, kind: TransportKind) -> String {
    let (w, h, m) = (720.0, 420.0, 60.0);
    let xs: Vec<f64> = rows.iter().map(|r| (r.bytes as f64).log2()).collect();
    let ys: Vec<f64> = rows
        .iter()
        .flat_map(|r| [r.busbw, r.ceil_bw])
        .filter(|v| *v > 0.0)
        .map(f64::log10)
        .collect();
    let (x0, x1) = (
        xs.iter().cloned().fold(f64::MAX, f64::min),
        xs.iter().cloned().fold(f64::MIN, f64::max).max(1.0),
    );
    let (y0, y1) = (
        ys.iter().cloned().fold(f64::MAX, f64::min).floor(),
        ys.iter().cloned().fold(f64::MIN, f64::max).ceil(),
    );
    let px = |x: f64| m + (x - x0) / (x1 - x0).max(1e-9) * (w - 2.0 * m);
    let py = |y: f64| h - m - (y - y0) / (y1 - y0).max(1e-9) * (h - 2.0 * m);
    let line = |f: &dyn Fn(&Row) -> f64, color: &str| {
        let pts: String = rows
            .iter()
            .zip(&xs)
            .filter(|(r, _)| f(r) > 0.0)
            .map(|(r, &x)| format!("{:.1},{:.1} ", px(x), py(f(r).log10())))
            .collect();
        format!("<polyline fill='none' stroke='{color}' stroke-width='2' points='{pts}'/>")
    };
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>");
    let _ = write!(s, "<rect width='100%' height='100%' fill='white'/>");
    let _ = write!(s, "<text x='{m}' y='20'>flagcx-perf {} ({kind}): bus bandwidth (blue) and ceiling (grey), GB/s, log-log</text>", o.test);
    let mut d = y0;
    while d <= y1 {
        let _ = write!(s, "<line x1='{m}' x2='{}' y1='{:.1}' y2='{:.1}' stroke='#ddd'/><text x='5' y='{:.1}'>{}</text>", w - m, py(d), py(d), py(d) + 4.0, 10f64.powf(d));
        d += 1.0;
    }
    for (r, &x) in rows.iter().zip(&xs).step_by(2) {
        let _ = write!(
            s,
            "<text x='{:.1}' y='{}' text-anchor='middle'>{}</text>",
            px(x),
            h - m + 18.0,
            human(r.bytes)
        );
    }
    s.push_str(&line(&|r| r.ceil_bw, "#999"));
    s.push_str(&line(&|r| r.busbw, "#1f5fbf"));
    s.push_str("</svg>\n");
    s
}

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 30 => format!("{}G", b >> 30),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}
