//! The main job: two processes bounce a device buffer back and forth and report latency and
//! bandwidth for each size, checking every byte of the last echo.
//!
//! ```sh
//! cargo run --release --example pingpong                 # starts its own two ranks
//! cargo run --release --example pingpong -- 64           # sizes up to 64 MiB
//! flagcx-run -n 2 --vendors cuda,host -- target/release/examples/pingpong
//! ```
//!
//! Outside a job (no rank from `flagcx-run`, torchrun, `mpirun` or `srun`) it launches itself as two ranks (as `flagcx-run -n 2`
//! would). The vendor is `FLAGCX_VENDOR` or the first one with a device.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use flagcx::p2p::launch::{launch, LaunchSpec};
use flagcx::{Adaptor, Comm, DeviceAdaptor, DeviceBuffer, Stream};

type Error = Box<dyn std::error::Error>;

/// Two processes bounce a device buffer back and forth (sizes 8 B, ×4, up to MAX_MIB MiB) and
/// report round-trip time and bandwidth per size, checking every byte of the last echo.
///
/// Outside a job it starts its own two ranks; under a launcher each process is one rank.
/// The vendor is FLAGCX_VENDOR or the first one with a device.
#[derive(clap::Parser)]
#[command(name = "pingpong")]
struct Args {
    /// Largest size, in MiB.
    #[arg(default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    max_mib: u64,
}

fn main() -> ExitCode {
    flagcx::init_logging();
    let args = <Args as clap::Parser>::parse();
    let result = if !flagcx::p2p::RankEnv::launched() {
        self_launch()
    } else {
        rank_main(args.max_mib as usize)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pingpong: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn self_launch() -> Result<(), Error> {
    let exe = std::env::current_exe()?;
    let mut program = vec![exe.to_string_lossy().into_owned()];
    program.extend(std::env::args().skip(1));
    // Rank 0 prints the table: its output is ours, unprefixed.
    let out = launch(&LaunchSpec {
        passthrough: vec![0],
        ..LaunchSpec::new(2, program)
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

fn pattern(size: usize, salt: u8) -> Vec<u8> {
    (0..size)
        .map(|i| (i as u8).wrapping_mul(167).wrapping_add(salt) ^ (i >> 11) as u8)
        .collect()
}

fn rank_main(max_mib: usize) -> Result<(), Error> {
    let adaptor = Adaptor::from_env()?;
    let comm = Comm::from_env(adaptor.clone())?;
    if comm.nranks() != 2 {
        return Err("pingpong needs exactly two ranks".into());
    }
    let me = comm.rank();
    let peer = 1 - me;
    let stream = Stream::new(&adaptor)?;
    let setup = Instant::now();
    if me == 0 {
        let info = comm.peer_info(peer).expect("peer info");
        println!(
            "pingpong: rank 0 on {} device {} <-> rank 1 on {} device {} via {} transport",
            adaptor.vendor(),
            adaptor.device(),
            info.vendor,
            info.device,
            comm.transport(peer).expect("a transport")
        );
        println!(
            "{:>12} {:>12} {:>12} {:>8}",
            "bytes", "rtt_us", "GB/s", "iters"
        );
    }
    let mut size = 8usize;
    while size <= max_mib << 20 {
        let buf = Arc::new(DeviceBuffer::new(&adaptor, size)?);
        let data = pattern(size, size as u8);
        if me == 0 {
            buf.write(0, &data, &stream)?;
        }
        let iters = if size <= 1 << 20 {
            200
        } else {
            (256usize << 20).div_ceil(size).clamp(5, 50)
        };
        let warmup = 3;
        let mut start = Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                stream.synchronize()?;
                start = Instant::now();
            }
            if me == 0 {
                comm.send(&buf, peer, &stream)?.wait()?;
                comm.recv(&buf, peer, &stream)?.wait()?;
            } else {
                comm.recv(&buf, peer, &stream)?.wait()?;
                comm.send(&buf, peer, &stream)?.wait()?;
            }
        }
        stream.synchronize()?;
        let rtt = start.elapsed().as_secs_f64() / iters as f64;
        if me == 0 {
            let mut echo = vec![0u8; size];
            buf.read(0, &mut echo, &stream)?;
            if echo != data {
                let i = echo
                    .iter()
                    .zip(&data)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                return Err(format!("{size}-byte echo differs at byte {i}").into());
            }
            println!(
                "{:>12} {:>12.2} {:>12.2} {:>8}",
                size,
                rtt * 1e6,
                size as f64 / (rtt / 2.0) / 1e9,
                iters
            );
        }
        size *= 4;
    }
    if me == 0 {
        // Which path the bytes took: a CUDA rank next to a host rank copies directly into the
        // host rank's buffers once they are registered (each size here has a fresh buffer, so
        // its first messages take the staging ring).
        let st = comm.stats();
        println!(
            "pingpong: the last echo of every size checked byte for byte; sweep took {:.2} s; bytes by path: \
             ipc {}, staged ring {}, direct {}, eager {}",
            setup.elapsed().as_secs_f64(),
            st.ipc_bytes,
            st.staged_bytes,
            st.direct_bytes,
            st.eager_bytes
        );
    }
    Ok(())
}
