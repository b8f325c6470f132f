//! `flagcx-perf`: nccl-tests-style performance sweeps of point-to-point transfers, each size
//! reported next to a ceiling measured in the same run.
//!
//! ```text
//! flagcx-perf [-t sendrecv|pingpong|pairs] [-b 8] [-e 64M] [-f 2] [-n 20] [-w 5] [-c]
//!             [-N 2] [--vendor V | --vendors A,B] [--transport ipc|staged|auto]
//!             [--json] [--json-file FILE] [--plot FILE.svg|FILE.png]
//! ```
//!
//! `flagcx-perf --help` explains every option.
//!
//! Outside a job (no rank from `flagcx-run`, torchrun, `mpirun` or `srun`) it starts `-N` ranks
//! of itself (like `flagcx-run`). Rank 0 prints, per
//! size: bytes, time (µs), algorithm and bus bandwidth (GB/s), wrong bytes (with `-c`), and the
//! ceiling — the vendor's bare copy for that size measured just before in the same traffic
//! pattern (device-to-device for IPC: within the device, or for a pair on two devices a peer
//! copy into the other rank's buffer, the placement the header names; the slower of pinned
//! device→host and host→device for staging; a memcpy for the host vendor; every rank copying
//! at once for `sendrecv` and `pairs`, one copy at a time for `pingpong`) — with our
//! bandwidth as a fraction of it. Reduction rows add `reduce_us`: the slowest rank's own
//! combining of the `(n − 1) / n` of the bytes a ring combines on each rank, in one step on its
//! device (the other bound of a pair whose device combines slower than the pair moves data).

// tidy: long file: the perf tool's options and its one timed loop over every traffic pattern; the patterns' own logic lives in collective.rs, ceiling.rs and nccl.rs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use flagcx::p2p::config::parse_size;
use flagcx::p2p::launch::{launch, LaunchSpec};
use flagcx::{Adaptor, Comm, DeviceAdaptor, DeviceBuffer, Stream, TransportKind};

use clap::{CommandFactory as _, FromArgMatches as _, Parser};
use serde::Serialize;

mod ceiling;
mod collective;
mod nccl;
mod plot;
mod progress;

use collective::{collective_wrong, is_collective, run_collective};
use progress::Progress;

type Error = Box<dyn std::error::Error>;

/// nccl-tests-style sweeps of point-to-point transfers, each size next to a ceiling measured in
/// the same run and traffic pattern.
///
/// Outside a job (no rank from flagcx-run, torchrun, mpirun or srun) it starts -N ranks of itself;
/// under a launcher (flagcx-run, torchrun, mpirun) each process is one rank. Rank 0 prints one
/// row per size: bytes, time (µs), algorithm and bus bandwidth (GB/s), wrong bytes (with -c),
/// the ceiling — the vendor's bare copy of that size, measured just before in the same traffic
/// pattern — and our bus bandwidth as a fraction of it, and the path the bytes took; reduction
/// rows add reduce_us, the slowest rank's own combining of its share of the bytes on its device.
#[derive(Parser, Debug, Clone)]
#[command(name = "flagcx-perf", after_help = AFTER_HELP)]
struct Opts {
    /// Traffic pattern: sendrecv (a ring: each rank sends to the next and receives from the
    /// previous, in one group), pingpong (two ranks, round trips), pairs (every rank
    /// exchanges with every other at once), or a collective (rooted at -r where it has a
    /// root): broadcast, gather, scatter, allgather, alltoall, alltoallv (seeded random
    /// counts). For collectives the size is the whole buffer (nranks blocks), as nccl-tests
    /// count it, and bus bandwidth uses nccl-tests' factors.
    #[arg(short = 't', long = "test", default_value = "sendrecv",
          value_parser = ["sendrecv", "pingpong", "pairs", "broadcast", "gather", "scatter",
                          "allgather", "alltoall", "alltoallv", "allreduce", "reducescatter",
                          "reduce"])]
    test: String,
    /// Element type of the reductions (allreduce, reducescatter, reduce): int8, uint8, int32,
    /// uint32, int64, uint64, float16 (half), float32 (float), float64 (double), bfloat16.
    /// Sizes are rounded down to whole elements (reducescatter: to whole elements per rank).
    #[arg(short = 'd', long = "datatype", default_value = "float", value_parser = datatype_arg)]
    datatype: flagcx::DataType,
    /// Operator of the reductions: sum, prod, max, min, avg.
    #[arg(short = 'o', long = "op", default_value = "sum", value_parser = op_arg)]
    op: flagcx::ReduceOp,
    /// Smallest message size (bytes; K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = size_arg("-b"))]
    min: usize,
    /// Largest message size (bytes; K, M, G suffixes).
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = size_arg("-e"))]
    max: usize,
    /// Multiply the size by this much from one row to the next.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(2..))]
    factor: u64,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Untimed iterations before them.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u64,
    /// Check every received byte (the "wrong" column counts mismatches; any fails the run).
    #[arg(short = 'c', long = "check")]
    check: bool,
    /// Wait for each iteration on the host before posting the next. By default every
    /// iteration is enqueued back to back on the stream and waited for once at the end, as
    /// nccl-tests times it (sendrecv, pairs, collectives); pingpong always waits per round trip.
    #[arg(long)]
    blocking: bool,
    /// The root of broadcast, gather and scatter (nccl-tests' -r), for NCCL too.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Run collectives in place, as nccl-tests' second column: a broadcast's, gather's or
    /// scatter's root passes one buffer for both sides; all-gather ranks find their own block
    /// already in the receive buffer (no local copy). Not for all-to-all, which has no
    /// in-place form.
    #[arg(long)]
    in_place: bool,
    /// Also time NCCL (libnccl.so.2, loaded at run time) right after us on the same buffers,
    /// stream and sizes, in columns nccl_us, nccl_gbs and vs_nccl (our bus bandwidth ÷ NCCL's);
    /// `n/a` with the reason where it cannot run (not all CUDA ranks, two ranks on one GPU,
    /// no library). sendrecv, pingpong, pairs, allgather, broadcast, alltoall and the
    /// reductions (with -d and -o).
    #[arg(long)]
    vs_nccl: bool,
    /// Ranks to start when not under a launcher.
    #[arg(short = 'N', long = "nranks", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(2..))]
    nranks: u64,
    /// Vendor of each rank, cycled over ranks (host, cuda, hip, opencl; "cuda,host"
    /// alternates); without it each rank opens FLAGCX_VENDOR or the first vendor with a
    /// device.
    #[arg(long = "vendor", visible_alias = "vendors", value_delimiter = ',',
          value_parser = vendor_arg)]
    vendors: Vec<String>,
    /// ipc: require IPC between every pair (fails where a pair cannot); staged: force the
    /// staging ring (as FLAGCX_P2P_DISABLE=1 does); auto: what each pair can do best.
    #[arg(long, default_value = "auto", value_parser = ["ipc", "staged", "auto"])]
    transport: String,
    /// Print one JSON object per size on stdout and nothing else (fields: docs/performance.md).
    #[arg(long)]
    json: bool,
    /// Write the JSON rows to FILE and keep the table on stdout.
    #[arg(long, value_name = "FILE")]
    json_file: Option<PathBuf>,
    /// Plot bus bandwidth and the ceiling against size (log-log) to FILE: SVG, or PNG when
    /// the name ends in .png. Needs a TrueType font installed (e.g. fonts-dejavu-core).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Print a completion script for SHELL (bash, zsh, fish, elvish, powershell) and exit.
    #[arg(long, value_name = "SHELL", hide_short_help = true)]
    completions: Option<clap_complete::Shell>,
}

const AFTER_HELP: &str = "Environment: FLAGCX_VENDOR, FLAGCX_DEVICE, FLAGCX_SPIN_US, \
FLAGCX_P2P_* and the rest of README.md's table apply to every rank; FLAGCX_RANK, \
FLAGCX_NRANKS and FLAGCX_UNIQUE_ID (or torchrun's and Open MPI's variables) make this process \
one rank of a job started elsewhere.

Examples:
  flagcx-perf -t pingpong -b 8 -e 1G -f 4 -c
  flagcx-perf --json | jq .busbw_gbs
  flagcx-run -n 2 --vendors cuda,host -- flagcx-perf -t sendrecv -c";

fn size_arg(name: &'static str) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |v| match parse_size(name, v) {
        Ok(0) => Err("must be at least 1 byte".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn datatype_arg(v: &str) -> Result<flagcx::DataType, String> {
    let alias = match v {
        "half" => "float16",
        "float" => "float32",
        "double" => "float64",
        "char" => "int8",
        "int" => "int32",
        other => other,
    };
    flagcx::DataType::ALL
        .into_iter()
        .find(|t| t.name() == alias)
        .ok_or_else(|| format!("unknown type {v:?}"))
}

fn op_arg(v: &str) -> Result<flagcx::ReduceOp, String> {
    flagcx::ReduceOp::ALL
        .into_iter()
        .find(|o| o.name() == v)
        .ok_or_else(|| format!("expected sum, prod, max, min or avg, got {v:?}"))
}

fn vendor_arg(v: &str) -> Result<String, String> {
    let v = v.trim();
    v.parse::<flagcx::Vendor>().map_err(|e| e.to_string())?;
    Ok(v.to_string())
}

/// Parses the arguments (clap exits 2 naming a bad value, 0 for --help and --version).
fn parse() -> Opts {
    let version: &'static str = Box::leak(flagcx::version_line().into_boxed_str());
    let m = Opts::command().version(version).get_matches();
    let o = Opts::from_arg_matches(&m).unwrap_or_else(|e| e.exit());
    if let Some(shell) = o.completions {
        clap_complete::generate(
            shell,
            &mut Opts::command(),
            "flagcx-perf",
            &mut std::io::stdout(),
        );
        std::process::exit(0);
    }
    if let Some(path) = &o.plot {
        // Fail before a long sweep, not after it.
        if let Err(e) = plot::check_font() {
            Opts::command()
                .error(
                    clap::error::ErrorKind::ValueValidation,
                    format!("--plot {}: {e}", path.display()),
                )
                .exit();
        }
    }
    if o.in_place && !collective::has_in_place(&o.test) {
        Opts::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                format!(
                    "--in-place: {} has no in-place form (broadcast, gather, scatter and \
                     allgather have)",
                    o.test
                ),
            )
            .exit();
    }
    // Under a launcher the job's size is known only to the ranks, which check it then.
    if o.root as u64 >= o.nranks && !flagcx::p2p::RankEnv::launched() {
        Opts::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("--root {}: the job has {} ranks", o.root, o.nranks),
            )
            .exit();
    }
    if o.max < o.min {
        Opts::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("-e {} is smaller than -b {}", o.max, o.min),
            )
            .exit();
    }
    o
}

fn main() -> ExitCode {
    flagcx::init_logging();
    let o = parse();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if !flagcx::p2p::RankEnv::launched() {
        self_launch(&o, &args)
    } else {
        rank_main(&o)
    };
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
    // Rank 0 prints the table (or JSON) and the progress bar: its output is ours, unprefixed
    // and unbuffered; the others' is prefixed with their rank.
    let out = launch(&LaunchSpec {
        vendors: o.vendors.clone(),
        passthrough: vec![0],
        ..LaunchSpec::new(o.nranks as usize, program)
    })?;
    if out.success() {
        Ok(())
    } else {
        Err(match out.first_failure {
            Some(r) => format!("rank {r} failed"),
            None => "the job was stopped".to_string(),
        }
        .into())
    }
}

fn byte(src: usize, size: usize, i: usize) -> u8 {
    (i as u8).wrapping_mul(151) ^ (src as u8).wrapping_mul(29) ^ (size as u8) ^ (i >> 9) as u8
}

/// An operation of the timed loop still to be waited for.
enum Pending {
    Op(flagcx::Request),
    Collective(flagcx::Collective),
}

/// One result row.
struct Row {
    bytes: usize,
    /// NCCL's time (µs) and bus bandwidth in the same run, with `--vs-nccl` where it ran.
    nccl: Option<(f64, f64)>,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: usize,
    ceil_us: f64,
    ceil_bw: f64,
    /// Reductions: the slowest rank's own combining of its share (`ceiling::reduce_time`), µs.
    reduce_us: Option<f64>,
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
    if o.root >= n {
        return Err(format!("-r {}: the job has {n} ranks (0..{n})", o.root).into());
    }
    let transports: Vec<TransportKind> = (0..n)
        .filter(|&q| q != me)
        .filter_map(|q| comm.transport(q))
        .collect();
    let kind = transports[0];
    // The rank that copies on a direct pair (two ranks; with more, each pair has its own).
    let direct = if n == 2 {
        comm.direct_copier(next)
    } else {
        None
    };
    if o.transport == "ipc" && transports.iter().any(|t| *t != TransportKind::Ipc) {
        return Err(
            "--transport ipc: some pair cannot use IPC (different vendors or no IPC handles)"
                .into(),
        );
    }
    // First transfer (a zero-byte ring), to report setup time.
    barrier(&comm, &stream, next, prev)?;
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    let place = ceiling::placement(&comm, me, next);
    let nccl = if o.vs_nccl {
        let red = collective::Red {
            dtype: o.datatype,
            op: o.op,
            forced: comm.config().reduce_algo,
        };
        Some(nccl::Nccl::open(&comm, &stream, &o.test, red)?)
    } else {
        None
    };
    if me == 0 && !o.json {
        let info = comm.peer_info(next).expect("peer");
        let copier = match (comm.ipc_copier(next), comm.direct_copier(next)) {
            _ if comm.copies_late(next) => {
                format!(" ({place}; late copies: the second to post copies)")
            }
            _ if comm.ring_in_device_memory(next) => {
                " (ring in device memory: large messages move device to device)".into()
            }
            (Some(r), _) => format!(" ({place}; rank {r} copies both ways)"),
            (None, _) if kind == TransportKind::Ipc => format!(" ({place}; each sender copies)"),
            (None, Some(r)) => format!(" (direct: rank {r} copies into/out of host buffers)"),
            (None, None) => String::new(),
        };
        // Which physical device each rank uses: its PCI bus id where the runtime says.
        let pci = |p: Option<&str>| p.map_or(String::new(), |p| format!(" ({p})"));
        let mine = adaptor.properties(adaptor.device())?;
        println!(
            "# flagcx-perf {}{} | {} ranks | rank 0: {} device {}{} | rank 1: {} device {}{} | transport {kind}{copier} | setup + first transfer {setup_ms:.1} ms",
            o.test,
            if o.in_place { " (in place)" } else { "" },
            n,
            adaptor.vendor(),
            adaptor.device(),
            pci(mine.pci_bus_id.as_deref()),
            info.vendor,
            info.device,
            pci(info.pci_bus_id.as_deref())
        );
        match &nccl {
            Some(Ok(nc)) => println!(
                "# vs {}: same buffers, stream and timing, run right after ours",
                nc.version
            ),
            Some(Err(why)) => println!("# vs NCCL: n/a: {why}"),
            None => {}
        }
        if let Some(line) = ceiling::queue_note(&comm) {
            println!("{line}");
        }
        print!(
            "# {:>12} {:>11} {:>10} {:>10} {:>7} {:>11} {:>10} {:>7} {:>7}",
            "bytes", "time_us", "algbw", "busbw", "wrong", "ceil_us", "ceil_bw", "ratio", "path"
        );
        if nccl.is_some() {
            print!(" {:>11} {:>10} {:>8}", "nccl_us", "nccl_gbs", "vs_nccl");
        }
        if collective::is_reduction(&o.test) {
            print!(" {:>11}", "reduce_us");
        }
        println!();
    }
    let mut json_file = match (&o.json_file, me) {
        (Some(path), 0) => Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| format!("--json-file {}: {e}", path.display()))?,
        )),
        _ => None,
    };
    let mut rows = Vec::new();
    let mut size = o.min;
    let sizes: Vec<usize> = std::iter::from_fn(|| {
        let s = size;
        size = size.checked_mul(o.factor as usize)?;
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
    // An IPC pair on two devices is measured against a copy into the peer's device.
    let peer_target = ceiling::PeerTarget::new(&comm, &stream, &adaptor, max, next)?;
    let mut progress = (me == 0).then(|| Progress::new(sizes.len()));
    for &size in &sizes {
        if let Some(p) = progress.as_mut() {
            p.start(size);
        }
        // Reductions move whole elements (reduce-scatter: whole elements per rank).
        let size = collective::whole_elements(&o.test, n, size, o.datatype);
        let red = collective::Red {
            dtype: o.datatype,
            op: o.op,
            forced: comm.config().reduce_algo,
        };
        let (sp, rp, result_in_send) = collective::placement(
            &o.test,
            o.in_place,
            me,
            n,
            size,
            o.root,
            (sends[0].ptr(), recvs[0].ptr()),
        );
        let fill = || -> Result<(), Error> {
            let data: Vec<u8> = (0..size).map(|i| byte(me, size, i)).collect();
            if sp == sends[0].ptr() {
                for b in &sends {
                    b.write(0, &data, &stream)?;
                }
            } else {
                // In place: this rank's input sits inside its receive buffer.
                let len = collective::input_bytes(&o.test, me, n, size, o.root);
                recvs[0].write((sp.0 - recvs[0].ptr().0) as usize, &data[..len], &stream)?;
            }
            Ok(())
        };
        if o.check {
            fill()?;
        }
        // The ceiling in the same traffic pattern: for sendrecv and pairs every rank copies at
        // once (on one GPU they share its memory bandwidth); for pingpong one copy at a time.
        // Every rank measures its own copy and the row keeps the slowest: a heterogeneous
        // pair runs at its slower side's speed.
        barrier(&comm, &stream, next, prev)?;
        // On a direct pair only the copier copies, both ways: its copies are the ceiling.
        let counts = direct.map_or(true, |c| c == me);
        let mut mine = 0.0;
        if o.test == "pingpong" {
            for r in 0..n {
                if r == me && counts {
                    mine =
                        ceiling::ceiling(&adaptor, &stream, kind, size, o, peer_target.target())?;
                }
                barrier(&comm, &stream, next, prev)?;
            }
        } else if counts {
            mine = ceiling::ceiling(&adaptor, &stream, kind, size, o, peer_target.target())?;
        }
        let secs = ceiling::slowest(&comm, &stream, mine)?;
        let (ceil_us, ceil_bw) = (secs * 1e6, size as f64 / secs / 1e9);
        let reduce_us = match collective::is_reduction(&o.test) && n > 1 && size > 0 {
            true => {
                let own = ceiling::reduce_time(&adaptor, &stream, size, n, red, o.iters as usize)?;
                Some(ceiling::slowest(&comm, &stream, own)? * 1e6)
            }
            false => None,
        };
        barrier(&comm, &stream, next, prev)?;
        let mut start = Instant::now();
        let mut before = comm.stats();
        let h = stream.handle();
        // What is in flight: waited for per iteration (--blocking) or once at the end.
        let mut inflight: Vec<Pending> = Vec::new();
        // Waits for every operation in flight, failed or not, before reporting the first
        // failure: the buffers below must outlive every operation that names them.
        let settle = |inflight: &mut Vec<Pending>| -> Result<(), Error> {
            let mut first: Option<Error> = None;
            for p in inflight.drain(..) {
                let r = match p {
                    Pending::Op(r) => r.wait().map(|_| ()),
                    Pending::Collective(c) => c.wait(),
                };
                if let Err(e) = r {
                    first.get_or_insert(e.into());
                }
            }
            first.map_or(Ok(()), Err)
        };
        for i in 0..o.warmup + o.iters {
            if i == o.warmup {
                settle(&mut inflight)?;
                stream.synchronize()?;
                start = Instant::now();
                before = comm.stats();
            }
            match o.test.as_str() {
                t if is_collective(t) => {
                    // SAFETY: both buffers hold `max >= size` bytes, every block a collective
                    // of `size` names lies inside them, and they outlive the wait.
                    let c = unsafe { run_collective(&comm, t, sp, rp, size, o.root, red, h) }?;
                    inflight.push(Pending::Collective(c));
                }
                // SAFETY: every buffer holds `max >= size` bytes and outlives each wait. A
                // round trip is measured: every operation is waited for before the next.
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
                    inflight.extend(reqs.into_iter().map(Pending::Op));
                }
            }
            if o.blocking {
                settle(&mut inflight)?;
            } else if i % 64 == 63 {
                // Enqueued back to back, a failure (a peer that stopped, a timeout) would show
                // only at the final wait, millions of posts later: look every 64 iterations,
                // and stop once what is in flight has ended.
                if let Some(e) = comm.async_error() {
                    let _ = settle(&mut inflight);
                    return Err(e.into());
                }
            }
        }
        settle(&mut inflight)?;
        stream.synchronize()?;
        let ops = o.iters as usize
            * if is_collective(&o.test) {
                2 * (n - 1)
            } else {
                sends.len() + recvs.len()
            };
        let path = path_taken(before, comm.stats(), ops);
        let t = start.elapsed().as_secs_f64() / o.iters as f64;
        let mut wrong = 0;
        if o.check && o.in_place && collective::is_reduction(&o.test) {
            // An in-place reduction combined its own result again on every iteration: the
            // input is written afresh and one more call is checked (as nccl-tests does).
            barrier(&comm, &stream, next, prev)?;
            fill()?;
            barrier(&comm, &stream, next, prev)?;
            // SAFETY: as in the timed loop.
            unsafe { run_collective(&comm, &o.test, sp, rp, size, o.root, red, h) }?.wait()?;
            stream.synchronize()?;
        }
        if o.check && is_collective(&o.test) {
            // The result starts at the receive pointer passed (an in-place scatter's root:
            // its own block of the send buffer).
            let result = if result_in_send { &sends[0] } else { &recvs[0] };
            let off = (rp.0 - result.ptr().0) as usize;
            let mut got = vec![0u8; size];
            result.read(off, &mut got[..size - off], &stream)?;
            wrong += collective_wrong(&o.test, &got, me, n, size, o.root, red);
        } else if o.check {
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
        // nccl-tests' bus bandwidth: what each link carries. Gathers, scatters and
        // all-to-alls move (n - 1) / n of the buffer through a rank's links.
        let bus = match o.test.as_str() {
            "gather" | "scatter" | "allgather" | "alltoall" | "alltoallv" | "reducescatter" => {
                (n - 1) as f64 / n as f64
            }
            "allreduce" => 2.0 * (n - 1) as f64 / n as f64,
            _ => 1.0,
        };
        // NCCL after our check (it writes the same receive buffers), with the same formulas.
        let nccl_row = match &nccl {
            Some(Ok(nc)) => {
                let t = nc.time(
                    &o.test,
                    me,
                    n,
                    sp,
                    rp,
                    size,
                    o.root,
                    &stream,
                    o.warmup as usize,
                    o.iters as usize,
                )?;
                let alg = match o.test.as_str() {
                    "pingpong" => size as f64 / (t / 2.0) / 1e9,
                    "pairs" => (size * (n - 1)) as f64 / t / 1e9,
                    _ => size as f64 / t / 1e9,
                };
                Some((t * 1e6, alg * bus))
            }
            _ => None,
        };
        let row = Row {
            bytes: size,
            nccl: nccl_row,
            time_us,
            algbw,
            busbw: algbw * bus,
            wrong,
            ceil_us,
            ceil_bw,
            reduce_us,
            path,
        };
        if me == 0 {
            let json = JsonRow::new(&row, o, kind, n, place);
            if let Some(p) = progress.as_mut() {
                p.suspend(|| print_row(&row, &json, o));
            }
            if let Some(f) = json_file.as_mut() {
                use std::io::Write as _;
                writeln!(f, "{}", serde_json::to_string(&json)?)?;
            }
        }
        rows.push(row);
    }
    // The previous rank maps this rank's ceiling buffer: freed once every rank closed its
    // mapping.
    let mine = peer_target.unmap();
    barrier(&comm, &stream, next, prev)?;
    drop(mine);
    if let Some(p) = progress.take() {
        p.finish();
    }
    if let Some(mut f) = json_file.take() {
        use std::io::Write as _;
        f.flush()?;
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
            let series: Vec<(usize, f64, f64)> =
                rows.iter().map(|r| (r.bytes, r.busbw, r.ceil_bw)).collect();
            let title = format!("flagcx-perf {} ({kind}, {n} ranks)", o.test);
            plot::draw(path, &title, &series)?;
            eprintln!("# plot written to {}", path.display());
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
        ("net", b.net_bytes - a.net_bytes),
    ];
    let used: Vec<&str> = d.iter().filter(|x| x.1 > 0).map(|x| x.0).collect();
    let caller = b.caller_ops - a.caller_ops;
    match used.as_slice() {
        [] => "-".into(),
        [p @ ("ipc" | "net")] if caller > 0 && ops > 0 => {
            format!("{p} {:.0}% caller", 100.0 * caller as f64 / ops as f64)
        }
        [one] => one.to_string(),
        _ => "mixed".into(),
    }
}

/// One row as `--json` and `--json-file` write it (docs/performance.md lists the fields).
#[derive(Serialize)]
struct JsonRow<'a> {
    test: &'a str,
    ranks: usize,
    transport: String,
    /// An IPC pair's placement: "one device" or "two devices" (null for other transports).
    placement: Option<&'a str>,
    bytes: usize,
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    wrong: usize,
    ceiling_us: f64,
    ceiling_gbs: f64,
    /// Reductions: the slowest rank's time to combine its share of the row once —
    /// `(n − 1) / n` of the bytes in one step reading two buffers and writing a third — on its
    /// own device (what bounds a ring where the device combines slower than the pair moves).
    #[serde(skip_serializing_if = "Option::is_none")]
    reduce_us: Option<f64>,
    ratio: f64,
    path: &'a str,
    /// `--in-place`.
    in_place: bool,
    /// With `--vs-nccl`: NCCL's time and bus bandwidth, and ours ÷ NCCL's (null where NCCL
    /// could not run).
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_us: Option<Option<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_gbs: Option<Option<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_nccl: Option<Option<f64>>,
}

impl<'a> JsonRow<'a> {
    fn new(r: &'a Row, o: &'a Opts, kind: TransportKind, n: usize, placement: &'a str) -> Self {
        JsonRow {
            test: &o.test,
            ranks: n,
            transport: kind.to_string(),
            placement: (kind == TransportKind::Ipc).then_some(placement),
            bytes: r.bytes,
            time_us: r.time_us,
            algbw_gbs: r.algbw,
            busbw_gbs: r.busbw,
            wrong: r.wrong,
            ceiling_us: r.ceil_us,
            ceiling_gbs: r.ceil_bw,
            reduce_us: r.reduce_us,
            ratio: if r.ceil_bw > 0.0 {
                r.busbw / r.ceil_bw
            } else {
                0.0
            },
            path: &r.path,
            in_place: o.in_place,
            nccl_us: o.vs_nccl.then(|| r.nccl.map(|(us, _)| us)),
            nccl_gbs: o.vs_nccl.then(|| r.nccl.map(|(_, gbs)| gbs)),
            vs_nccl: o
                .vs_nccl
                .then(|| r.nccl.filter(|&(_, g)| g > 0.0).map(|(_, g)| r.busbw / g)),
        }
    }
}

fn print_row(r: &Row, json: &JsonRow<'_>, o: &Opts) {
    if o.json {
        match serde_json::to_string(json) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("flagcx-perf: JSON: {e}"),
        }
    } else {
        print!(
            "  {:>12} {:>11.2} {:>10.2} {:>10.2} {:>7} {:>11.2} {:>10.2} {:>7.3} {:>7}",
            r.bytes, r.time_us, r.algbw, r.busbw, r.wrong, r.ceil_us, r.ceil_bw, json.ratio, r.path
        );
        match (o.vs_nccl, r.nccl, json.vs_nccl.flatten()) {
            (false, ..) => {}
            (true, Some((us, gbs)), Some(v)) => print!(" {us:>11.2} {gbs:>10.2} {v:>8.3}"),
            (true, ..) => print!(" {:>11} {:>10} {:>8}", "n/a", "n/a", "n/a"),
        }
        if let Some(us) = r.reduce_us {
            print!(" {us:>11.2}");
        }
        println!();
    }
}

/// Every rank's `mine` (all ranks pass the same length), in rank order, through the
/// communicator's own all-gather.
pub(crate) fn all_gather_bytes(
    comm: &Comm<Adaptor>,
    stream: &Stream<Adaptor>,
    mine: &[u8],
) -> Result<Vec<u8>, Error> {
    let (n, len) = (comm.nranks(), mine.len());
    let send = DeviceBuffer::new(comm.adaptor(), len)?;
    let recv = DeviceBuffer::new(comm.adaptor(), len * n)?;
    send.write(0, mine, stream)?;
    // SAFETY: `send` holds `len` bytes and `recv` `len` per rank; both outlive the wait and
    // the synchronize below.
    let c = unsafe { comm.all_gather_raw(send.ptr(), recv.ptr(), len, stream.handle())? };
    c.wait()?;
    stream.synchronize()?;
    let mut all = vec![0u8; len * n];
    recv.read(0, &mut all, stream)?;
    Ok(all)
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
