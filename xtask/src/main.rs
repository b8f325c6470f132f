//! `cargo xtask`: the project's tasks, runnable anywhere with just cargo.
//!
//! - `test [--vendor host|cuda|hip|opencl|all]` — the vendor suites (default: every vendor this machine
//!   can build); vendors without a device report their skips, never a silent pass.
//! - `ci` — exactly what CI runs: fmt check, clippy `-D warnings`, docs, then `test`.
//! - `bundle --vendor cuda` — stripped release test binaries plus a `run.sh`, for a GPU host with
//!   no Rust toolchain (see README).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

mod bundle;

const VENDORS: [&str; 4] = ["host", "cuda", "hip", "opencl"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => parse_vendors(&args[1..]).and_then(|v| test(&v, false)),
        Some("ci") => ci(),
        Some("bundle") => parse_vendors(&args[1..]).and_then(|v| bundle::bundle(&v)),
        Some("soak") => soak(&args[1..]),
        Some("fuzz") => fuzz(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("audit") => audit(),
        _ => {
            eprintln!(
                "usage: cargo xtask <task>\n\n\
                 tasks:\n  \
                 test [--vendor host|cuda|hip|opencl|all]   run the vendor suites (default: all buildable)\n  \
                 ci                                  fmt, clippy -D warnings, docs, then test\n  \
                 bundle --vendor cuda                GPU test bundle under target/bundle-cuda\n  \
                 soak [ITERS]                        the 8-rank stress job, long form (default 2000 groups)\n  \
                 fuzz [SECS]                         cargo-fuzz the wire decoders (default 60 s), then 50k proptest cases\n  \
                 bench [--vs-mpi]                    criterion benches, a host-vendor flagcx-perf sweep, and\n                                      \
                 with --vs-mpi Open MPI's ping-pong on the same machine\n  \
                 audit                               cargo-deny: bans, licenses, sources (deny.toml), then advisories"
            );
            Err("no task given".into())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T = ()> = std::result::Result<T, String>;

/// `--vendor a,b` / `--vendor all` / nothing (= None: every buildable vendor).
fn parse_vendors(args: &[String]) -> Result<Option<Vec<String>>> {
    let mut out: Option<Vec<String>> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let value = match a.strip_prefix("--vendor=") {
            Some(v) => v.to_string(),
            None if a == "--vendor" || a == "--vendors" => it
                .next()
                .cloned()
                .ok_or("--vendor needs a value (host, cuda, hip, opencl or all)")?,
            None => return Err(format!("unknown argument {a:?}")),
        };
        for v in value.split(',') {
            let v = v.trim().to_ascii_lowercase();
            if v == "all" {
                out.get_or_insert_with(Vec::new)
                    .extend(VENDORS.iter().map(|s| s.to_string()));
            } else if VENDORS.contains(&v.as_str()) {
                out.get_or_insert_with(Vec::new).push(v);
            } else {
                return Err(format!(
                    "unknown vendor {v:?}; expected host, cuda, hip, opencl or all"
                ));
            }
        }
    }
    if let Some(v) = &mut out {
        v.dedup();
    }
    Ok(out)
}

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

pub(crate) fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(what: &str, cmd: &mut Command) -> Result {
    eprintln!("xtask: {what}");
    let status = cmd.status().map_err(|e| format!("{what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// Where HIP lives, if it is installed (the same places hip-sys's build script looks).
pub(crate) fn hip_root() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(out) = Command::new("hipconfig").arg("-p").output() {
        if out.status.success() {
            candidates.push(String::from_utf8_lossy(&out.stdout).trim().into());
        }
    }
    for var in ["HIP_PATH", "ROCM_PATH"] {
        if let Ok(v) = std::env::var(var) {
            candidates.push(v.into());
        }
    }
    candidates.push("/opt/rocm".into());
    candidates.push("/opt/rocm/hip".into());
    candidates
        .into_iter()
        .find(|p| p.join("include/hip/hip_runtime_api.h").is_file())
}

pub(crate) const HIP_INSTALL_HINT: &str = "HIP is not installed here (no hip/hip_runtime_api.h \
     found via `hipconfig -p`, HIP_PATH, ROCM_PATH or /opt/rocm). Install it with \
     `sudo apt-get install libamdhip64-dev hipcc` (Debian 12 / Ubuntu), or install ROCm and set \
     HIP_PATH; an AMD GPU is not needed to build and run the (skipping) suite";

/// What one vendor's suite did.
struct Outcome {
    vendor: String,
    status: &'static str,
    passed: usize,
    skipped: Vec<(String, String)>,
    note: String,
}

fn test(vendors: &Option<Vec<String>>, strict_all: bool) -> Result {
    let explicit = vendors.is_some();
    let list = vendors
        .clone()
        .unwrap_or_else(|| VENDORS.iter().map(|s| s.to_string()).collect());
    let skip_dir = root().join("target/xtask");
    std::fs::create_dir_all(&skip_dir).map_err(|e| e.to_string())?;
    let mut outcomes = Vec::new();
    let mut failed = false;
    for v in &list {
        if v == "hip" && hip_root().is_none() {
            if explicit || strict_all {
                return Err(format!("cannot build the hip vendor: {HIP_INSTALL_HINT}"));
            }
            outcomes.push(Outcome {
                vendor: v.clone(),
                status: "not built",
                passed: 0,
                skipped: vec![],
                note: "HIP not installed; `cargo xtask test --vendor hip` says how".into(),
            });
            continue;
        }
        let log = skip_dir.join(format!("skips-{v}.log"));
        let _ = std::fs::remove_file(&log);
        let mut passed = 0;
        let mut ok = true;
        for mut cmd in vendor_commands(v) {
            cmd.env("FLAGCX_SKIP_LOG", &log);
            match run_counting(&format!("{v}: {cmd:?}"), &mut cmd) {
                Ok(n) => passed += n,
                Err(e) => {
                    eprintln!("xtask: {e}");
                    ok = false;
                }
            }
        }
        let skipped = read_skips(&log);
        failed |= !ok;
        outcomes.push(Outcome {
            vendor: v.clone(),
            status: if ok { "ok" } else { "FAILED" },
            passed: passed.saturating_sub(skipped.len()),
            skipped,
            note: String::new(),
        });
    }
    print_summary(&outcomes);
    if failed {
        Err("some suites failed".into())
    } else {
        Ok(())
    }
}

/// The cargo invocations that make up one vendor's suite.
fn vendor_commands(vendor: &str) -> Vec<Command> {
    let mut cmds = Vec::new();
    match vendor {
        "host" => {
            // Everything vendor-neutral plus the host vendor, and the facade on the host vendor.
            let mut c = cargo();
            c.args(["test", "--workspace"])
                .args(["--exclude", "flagcx-hip", "--exclude", "flagcx-cuda"])
                .args(["--exclude", "flagcx-opencl"])
                .env("FLAGCX_VENDOR", "host");
            cmds.push(c);
        }
        other => {
            let mut c = cargo();
            c.args(["test", "-p", &format!("flagcx-{other}")]);
            cmds.push(c);
            let mut c = cargo();
            c.args(["test", "-p", "flagcx", "--features", other])
                .args(["--test", "conformance"])
                .env("FLAGCX_VENDOR", other);
            cmds.push(c);
            if other == "opencl" {
                // No GPU in CI: OpenCL (PoCL) is the second real runtime, so its p2p jobs run
                // here — OpenCL ranks alone, and mixed with host-vendor ranks.
                let mut c = cargo();
                c.args(["test", "-p", "flagcx", "--features", other, "--test", "p2p"])
                    .env("FLAGCX_P2P_TEST_VENDORS", other)
                    .env("FLAGCX_P2P_TEST_MIXED", format!("host,{other}"));
                cmds.push(c);
            }
        }
    }
    cmds
}

/// Runs a cargo test command, echoing its output and counting passed tests.
fn run_counting(what: &str, cmd: &mut Command) -> Result<usize> {
    eprintln!("xtask: {what}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let mut passed = 0;
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.map_err(|e| e.to_string())?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            passed += rest
                .split(';')
                .find_map(|p| p.trim().split_once(" passed").map(|(n, _)| n.to_string()))
                .and_then(|n| n.rsplit(' ').next().and_then(|n| n.parse::<usize>().ok()))
                .unwrap_or(0);
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() {
        Ok(passed)
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

fn read_skips(log: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, '\t');
            let (_vendor, test, reason) = (f.next()?, f.next()?, f.next()?);
            Some((test.to_string(), reason.to_string()))
        })
        .collect()
}

fn print_summary(outcomes: &[Outcome]) {
    println!("\n==== flagcx test summary ====");
    println!(
        "{:<8} {:<10} {:>7} {:>8}  notes",
        "vendor", "result", "passed", "skipped"
    );
    for o in outcomes {
        let mut reasons: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, r) in &o.skipped {
            *reasons.entry(r.as_str()).or_default() += 1;
        }
        let mut note = o.note.clone();
        for (r, n) in reasons {
            note.push_str(&format!("skipped: {r} ({n} tests)"));
        }
        println!(
            "{:<8} {:<10} {:>7} {:>8}  {}",
            o.vendor,
            o.status,
            o.passed,
            o.skipped.len(),
            note
        );
    }
}

/// The stress job of `tests/p2p.rs` with many more iterations, both transports.
fn soak(args: &[String]) -> Result {
    let iters: u64 = match args.first() {
        None => 2000,
        Some(a) => a
            .parse()
            .map_err(|_| format!("soak: {a:?} is not an iteration count"))?,
    };
    run(
        &format!("soak: 8 ranks, {iters} random groups per transport"),
        cargo()
            .args(["test", "--release", "-p", "flagcx", "--test", "p2p"])
            .args(["stress_8_ranks_both_transports", "--", "--nocapture"])
            .env("FLAGCX_STRESS_ITERS", iters.to_string()),
    )
}

/// Fuzzes the wire decoders for a bounded time with cargo-fuzz (libFuzzer), then runs the
/// decoder property tests with many cases. cargo-fuzz passes `-Z` flags; `RUSTC_BOOTSTRAP=1` lets
/// the stable toolchain (the only one here) accept them.
fn fuzz(args: &[String]) -> Result {
    let secs: u64 = match args.first() {
        None => 60,
        Some(a) => a
            .parse()
            .map_err(|_| format!("fuzz: {a:?} is not a number of seconds"))?,
    };
    ensure_cargo_tool("fuzz", "cargo-fuzz")?;
    run(
        &format!("cargo fuzz run wire for {secs} s"),
        cargo()
            .current_dir(root().join("fuzz"))
            .args(["fuzz", "run", "wire", "--"])
            .arg(format!("-max_total_time={secs}"))
            .env("RUSTC_BOOTSTRAP", "1"),
    )?;
    run(
        "decoder property tests, 50000 cases each",
        cargo()
            .args([
                "test",
                "--release",
                "-p",
                "flagcx-p2p",
                "--test",
                "decode_props",
            ])
            .env("PROPTEST_CASES", "50000"),
    )
}

/// Criterion benches of the pieces, a host-vendor `flagcx-perf` ping-pong sweep and, with
/// `--vs-mpi`, our Open MPI ping-pong program on the same machine in the same run.
fn bench(args: &[String]) -> Result {
    let vs_mpi = match args {
        [] => false,
        [a] if a == "--vs-mpi" => true,
        _ => return Err("usage: cargo xtask bench [--vs-mpi]".into()),
    };
    run(
        "criterion benches (benches/pieces.rs)",
        cargo().args(["bench", "-p", "flagcx", "--bench", "pieces"]),
    )?;
    run(
        "building flagcx-perf",
        cargo().args(["build", "--release", "-p", "flagcx", "--bin", "flagcx-perf"]),
    )?;
    run(
        "flagcx-perf: host-vendor ping-pong, 8 B .. 256 MiB",
        Command::new(root().join("target/release/flagcx-perf"))
            .args([
                "-t", "pingpong", "-b", "8", "-e", "256M", "-f", "4", "-n", "100", "-w", "10",
            ])
            .env("FLAGCX_VENDOR", "host"),
    )?;
    if vs_mpi {
        let have = Command::new("mpicc")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !have {
            return Err(
                "--vs-mpi needs Open MPI: sudo apt-get install openmpi-bin libopenmpi-dev".into(),
            );
        }
        let exe = root().join("target/mpi-pingpong");
        run(
            "mpicc benches/mpi/pingpong.c",
            Command::new("mpicc")
                .args(["-O2", "-o"])
                .arg(&exe)
                .arg(root().join("benches/mpi/pingpong.c")),
        )?;
        let mut mpirun = Command::new("mpirun");
        // Open MPI refuses to run as root unless told to; CI runs as root.
        if std::env::var("USER").map(|u| u == "root").unwrap_or(true) {
            mpirun.arg("--allow-run-as-root");
        }
        run(
            "Open MPI ping-pong (shared-memory transport), 8 B .. 256 MiB",
            mpirun
                .args(["--oversubscribe", "-n", "2"])
                .arg(&exe)
                .args(["8", "268435456"]),
        )?;
    }
    Ok(())
}

/// Installs `krate` unless `cargo <sub> --version` already works.
fn ensure_cargo_tool(sub: &str, krate: &str) -> Result {
    let have = cargo()
        .args([sub, "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        run(
            &format!("installing {krate}"),
            cargo().args(["install", krate, "--locked"]),
        )?;
    }
    Ok(())
}

/// The dependency check. Bans, licenses and sources work offline (deny.toml); the advisories
/// check needs the RustSec database from GitHub and is reported, not failed, where that is
/// unreachable — say so rather than pass silently.
fn audit() -> Result {
    ensure_cargo_tool("deny", "cargo-deny")?;
    run(
        "cargo deny check bans licenses sources",
        cargo().args(["deny", "check", "bans", "licenses", "sources"]),
    )?;
    if let Err(e) = run(
        "cargo deny check advisories",
        cargo().args(["deny", "check", "advisories"]),
    ) {
        println!(
            "audit: advisories NOT checked ({e}): the RustSec database could not be fetched or \
             reported a problem; see the output above"
        );
        return Err("advisories check did not pass".into());
    }
    Ok(())
}

fn ci() -> Result {
    let hip = hip_root().is_some();
    if !hip {
        return Err(format!("CI builds every vendor: {HIP_INSTALL_HINT}"));
    }
    run("fmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(
        "clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    run(
        "doc",
        cargo()
            .args(["doc", "--workspace", "--no-deps", "--all-features"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    test(&None, true)
}
