//! A transfer between two processes on the default vendor.
//!
//! The first process allocates a device buffer and exports it through IPC (the byte-form
//! handle); it starts itself again as a second process, which opens the handle, fills a buffer of
//! its own and copies it into the first process's memory with its copy engine. The first process
//! then checks every byte and prints what moved and how fast.
//!
//! ```sh
//! cargo run --release --example transfer [-- <MiB>]
//! FLAGCX_VENDOR=cuda cargo run --release --example transfer --features cuda
//! ```

use std::process::{Command, ExitCode};
use std::time::Instant;

use flagcx::{Adaptor, DeviceAdaptor, DeviceBuffer, IpcMapping, IpcMemHandle, Stream};

const HANDLE_ENV: &str = "FLAGCX_EXAMPLE_HANDLE";

fn byte(i: usize) -> u8 {
    (i as u8).wrapping_mul(131) ^ (i >> 12) as u8
}

/// One process exports a device buffer through IPC; a second process (this program again)
/// opens it and copies MIB MiB into it; the first checks every byte.
#[derive(clap::Parser)]
#[command(name = "transfer")]
struct Args {
    /// Bytes to move, in MiB.
    #[arg(default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    mib: u64,
}

fn main() -> ExitCode {
    let args = <Args as clap::Parser>::parse();
    match run(args.mib as usize) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transfer: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(mib: usize) -> Result<(), Box<dyn std::error::Error>> {
    let bytes = mib << 20;
    let adaptor = Adaptor::from_env()?;
    let stream = Stream::new(&adaptor)?;
    if let Ok(hex) = std::env::var(HANDLE_ENV) {
        return child(&adaptor, &stream, &hex, bytes);
    }
    let props = adaptor.properties(adaptor.device())?;
    println!(
        "transfer: {} device {} ({}), {} MiB",
        adaptor.vendor(),
        adaptor.device(),
        props.name,
        mib
    );
    let target = DeviceBuffer::new(&adaptor, bytes)?;
    target.fill(0, &stream)?;
    let handle = target.ipc_handle()?;
    let hex: String = handle
        .to_wire()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let status = Command::new(std::env::current_exe()?)
        .arg(mib.to_string())
        .env(HANDLE_ENV, hex)
        .env("FLAGCX_VENDOR", adaptor.vendor().name())
        .env("FLAGCX_DEVICE", adaptor.device().to_string())
        .status()?;
    if !status.success() {
        return Err(format!("the second process failed: {status}").into());
    }
    let mut out = vec![0u8; bytes];
    target.read(0, &mut out, &stream)?;
    let wrong = out
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != byte(i))
        .count();
    if wrong > 0 {
        return Err(format!("{wrong} of {bytes} bytes are wrong").into());
    }
    println!(
        "transfer: all {bytes} bytes arrived intact in process {}",
        std::process::id()
    );
    Ok(())
}

fn child(
    adaptor: &Adaptor,
    stream: &Stream<Adaptor>,
    hex: &str,
    bytes: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let wire: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()?;
    let peer = IpcMapping::open(adaptor, &IpcMemHandle::from_wire(&wire)?)?;
    let src = DeviceBuffer::new(adaptor, bytes)?;
    let data: Vec<u8> = (0..bytes).map(byte).collect();
    src.write(0, &data, stream)?;
    // Warm up once, then time a few copies straight into the other process's memory.
    let copy = || -> flagcx::Result<()> {
        // SAFETY: both ranges are live `bytes`-long allocations until the synchronize below.
        unsafe { adaptor.memcpy_d2d_async(peer.ptr(), src.ptr(), bytes, stream.handle())? };
        stream.synchronize()
    };
    copy()?;
    let iters = 10;
    let t = Instant::now();
    for _ in 0..iters {
        copy()?;
    }
    let secs = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "transfer: process {} copied {} MiB into process {}'s memory: {:.1} µs, {:.2} GB/s",
        std::process::id(),
        bytes >> 20,
        std::os::unix::process::parent_id(),
        secs * 1e6,
        bytes as f64 / secs / 1e9
    );
    Ok(())
}
