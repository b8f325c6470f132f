//! `cargo xtask`: the project's tasks, runnable anywhere with just cargo.
//!
//! - `test [--vendor host|cuda|hip|opencl|all]` — the vendor suites (default: every vendor this machine
//!   can build); vendors without a device report their skips, never a silent pass.
//! - `ci` — exactly what CI runs: fmt check, clippy `-D warnings`, docs, then `test`.
//! - `bundle --vendor cuda` — stripped release test binaries plus a `run.sh`, for a GPU host with
//!   no Rust toolchain (see README).

// tidy: long file: every xtask command's driver in one place (test, ci, bench, soak, fuzz), each a short sequence of cargo and tool runs.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

mod bundle;
mod capi;
mod netbench;
mod perfpage;
mod pybench;

/// Suites beside the vendors': the Python package (`crates/flagcx-py`) under pytest.
const SUITES: [&str; 5] = ["host", "cuda", "hip", "opencl", "python"];

/// The project's tasks, runnable anywhere with just cargo.
#[derive(clap::Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(clap::Subcommand)]
enum Task {
    /// Run the vendor suites (default: every vendor this machine can build); each ends with
    /// a table of passed and skipped tests, skips with their reasons.
    Test {
        /// host, cuda, hip, opencl, python (the Python package under pytest) or all; a
        /// list with commas.
        #[arg(long, visible_alias = "vendors", value_delimiter = ',',
              value_parser = ["host", "cuda", "hip", "opencl", "python", "all"])]
        vendor: Vec<String>,
    },
    /// What CI runs: fmt check, clippy -D warnings, docs with warnings denied, then test.
    Ci,
    /// Stripped release test binaries plus run.sh and perf.sh under `target/bundle-VENDOR`,
    /// for a GPU host without Rust.
    Bundle {
        /// The GPU vendor (cuda).
        #[arg(long, visible_alias = "vendors", value_delimiter = ',', required = true,
              value_parser = ["cuda"])]
        vendor: Vec<String>,
    },
    /// The 8-rank random stress job, long form.
    Soak {
        /// Random groups per transport.
        #[arg(default_value_t = 2000)]
        iters: u64,
    },
    /// cargo-fuzz the wire decoders, then run their property tests with 50k cases.
    Fuzz {
        /// Seconds of fuzzing.
        #[arg(default_value_t = 60)]
        secs: u64,
    },
    /// Criterion benches, a host-vendor flagcx-perf sweep and, with --vs-mpi, Open MPI's
    /// ping-pong, 4-rank all-to-all (1 KiB to 256 MiB) and all-reduce (8 B to 128 MiB) on the
    /// same machine.
    Bench {
        /// Also run Open MPI's ping-pong, all-to-all and all-reduce (needs mpicc and mpirun).
        #[arg(long)]
        vs_mpi: bool,
        /// With --vs-mpi: only the tests whose name contains this (e.g. "all-reduce"), and no
        /// criterion benches.
        #[arg(long)]
        only: Option<String>,
        /// Instead: the network transport between two network namespaces next to
        /// `ucx_perftest` (tag_lat, tag_bw) in the same run (needs root, ucx-utils).
        #[arg(long)]
        net: bool,
        /// Instead: the Python package against the Rust API, and the torch backend against
        /// the package and gloo (needs maturin and torch).
        #[arg(long)]
        python: bool,
        /// Also write the run's rows to docs/perf/runs/NAME.json (with --vs-mpi or
        /// --python), the data `perf-page` builds docs/performance.md from.
        #[arg(long, value_name = "NAME")]
        record: Option<String>,
    },
    /// Generate docs/performance.md from docs/perf (the runs' rows and the targets); with
    /// --check, fail where the committed page differs.
    PerfPage {
        /// Compare instead of writing.
        #[arg(long)]
        check: bool,
    },
    /// cargo-deny: bans, licenses, sources (deny.toml), then advisories.
    Audit,
    /// Shell completion scripts for flagcx-perf, flagcx-run and cargo xtask under
    /// target/completions/{bash,zsh,fish}.
    Completions,
    /// Build libflagcx (the FlagCX-compatible C ABI) and install it with flagcx.h and a
    /// pkg-config file under target/flagcx.
    Capi {
        /// Vendors compiled in besides host (cuda, hip, opencl); a list with commas.
        #[arg(long, visible_alias = "vendors", value_delimiter = ',',
              value_parser = ["host", "cuda", "hip", "opencl"])]
        vendor: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = <Cli as clap::Parser>::parse();
    let result = match cli.task {
        Task::Test { vendor } => parse_vendors(&vendor).and_then(|v| test(&v, false)),
        Task::Ci => ci(),
        Task::Bundle { vendor } => parse_vendors(&vendor).and_then(|v| bundle::bundle(&v)),
        Task::Soak { iters } => soak(iters),
        Task::Fuzz { secs } => fuzz(secs),
        Task::Bench { net: true, .. } => netbench::bench_net(),
        Task::Bench {
            python: true,
            record,
            ..
        } => pybench::bench_python(record.as_deref()),
        Task::Bench {
            vs_mpi,
            only,
            record,
            ..
        } => bench(vs_mpi, only.as_deref(), record.as_deref()),
        Task::PerfPage { check } => perfpage::perf_page(check),
        Task::Audit => audit(),
        Task::Capi { vendor } => capi::capi(&vendor).map(|_| ()),
        Task::Completions => completions(),
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
fn parse_vendors(values: &[String]) -> Result<Option<Vec<String>>> {
    if values.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for v in values {
        let v = v.trim().to_ascii_lowercase();
        if v == "all" {
            out.extend(SUITES.iter().map(|s| s.to_string()));
        } else if SUITES.contains(&v.as_str()) {
            out.push(v);
        } else {
            return Err(format!(
                "unknown vendor {v:?}; expected host, cuda, hip, opencl or all"
            ));
        }
    }
    out.dedup();
    Ok(Some(out))
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
        .unwrap_or_else(|| SUITES.iter().map(|s| s.to_string()).collect());
    let skip_dir = root().join("target/xtask");
    std::fs::create_dir_all(&skip_dir).map_err(|e| e.to_string())?;
    let mut outcomes = Vec::new();
    let mut failed = false;
    let mut capi_prefix = None;
    for v in &list {
        if v == "python" {
            let o = python_suite(strict_all || explicit);
            failed |= o.status == "FAILED";
            outcomes.push(o);
            continue;
        }
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
        // The C programs of tests/capi.rs link the installed libflagcx (host and OpenCL): the
        // one this selection's test build makes (the facade has OpenCL there, which
        // `flagcx-py` turns on), installed before any test runs. A release build of its own
        // took a minute of a fresh run.
        if (v == "host" || v == "opencl") && capi_prefix.is_none() {
            let mut build = cargo();
            build
                .arg("test")
                .args(SHARED)
                .args(["--no-run", "--message-format=json-render-diagnostics"]);
            eprintln!("xtask: building the test binaries and libflagcx: {build:?}");
            let out = build
                .stderr(Stdio::inherit())
                .output()
                .map_err(|e| format!("cargo test --no-run: {e}"))?;
            if !out.status.success() {
                return Err(format!("cargo test --no-run failed ({})", out.status));
            }
            capi_prefix = Some(capi::capi_from_test_build(&String::from_utf8_lossy(
                &out.stdout,
            ))?);
        }
        for mut cmd in vendor_commands(v) {
            cmd.env("FLAGCX_SKIP_LOG", &log);
            if let Some(p) = &capi_prefix {
                cmd.env("FLAGCX_CAPI_PREFIX", p)
                    .env("FLAGCX_CAPI_VENDORS", "host,opencl");
            }
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

/// The Python package's suite: the wheel built with maturin (debug profile: the test
/// binaries' artifacts are reused where they can be), installed into `target/xtask/python`
/// (not into the interpreter's site-packages), and `crates/flagcx-py/tests` under pytest,
/// whose passed and skipped counts (skips with their reasons) join the summary. Where python3
/// lacks maturin, pytest or numpy the suite is one visible skip — unless `strict` (CI, or
/// `--vendor python`), which fails instead.
fn python_suite(strict: bool) -> Outcome {
    let outcome = |status, passed, skipped, note: String| Outcome {
        vendor: "python".into(),
        status,
        passed,
        skipped,
        note,
    };
    let missing: Vec<&str> = ["maturin", "pytest", "numpy"]
        .into_iter()
        .filter(|m| {
            !Command::new("python3")
                .args(["-c", &format!("import {m}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    if !missing.is_empty() {
        let why = format!(
            "python3 lacks {} (`python3 -m pip install maturin pytest numpy`, and torch for \
             the backend's tests)",
            missing.join(", ")
        );
        if strict {
            eprintln!("xtask: python: {why}");
            return outcome("FAILED", 0, vec![], why);
        }
        return outcome("skipped", 0, vec![("python".into(), why)], String::new());
    }
    let site = root().join("target/xtask/python");
    if let Err(e) = build_wheel(false, &root().join("target/wheels"), &site) {
        eprintln!("xtask: python: {e}");
        return outcome("FAILED", 0, vec![], e);
    }
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(root().join("crates/flagcx-py/tests"))
        .env("PYTHONPATH", &site);
    eprintln!("xtask: python: {cmd:?}");
    let out = match cmd.stderr(Stdio::inherit()).output() {
        Ok(o) => o,
        Err(e) => return outcome("FAILED", 0, vec![], format!("pytest: {e}")),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    let (passed, skipped) = pytest_counts(&text);
    let status = if out.status.success() { "ok" } else { "FAILED" };
    outcome(status, passed, skipped, String::new())
}

/// Builds the Python package's wheel with maturin into `wheels` (debug, or `release`) and
/// installs it into `site` (for `PYTHONPATH`; the interpreter's site-packages are left alone),
/// both emptied first. The test suite and `bench --python` share it.
pub(crate) fn build_wheel(release: bool, wheels: &Path, site: &Path) -> Result {
    let _ = std::fs::remove_dir_all(wheels);
    let _ = std::fs::remove_dir_all(site);
    let mut maturin = Command::new("python3");
    maturin.args(["-m", "maturin", "build"]);
    if release {
        maturin.arg("--release");
    }
    maturin
        .args(["--compatibility", "linux", "-o"])
        .arg(wheels)
        .arg("-m")
        .arg(root().join("crates/flagcx-py/Cargo.toml"));
    run("python: build the wheel", &mut maturin)?;
    let wheel = std::fs::read_dir(wheels)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("maturin made no wheel")?;
    run(
        "python: install the wheel",
        Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(site)
            .arg(wheel),
    )
}

/// Passed count and skips (test, reason) from pytest's `-q -rs` output: the summary line
/// (`12 passed, 2 skipped in 3.1s`) and the `SKIPPED [n] file:line: reason` lines.
fn pytest_counts(text: &str) -> (usize, Vec<(String, String)>) {
    let mut passed = 0;
    let mut skipped = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("SKIPPED [") {
            if let Some((n, rest)) = rest.split_once("] ") {
                let (place, reason) = rest.split_once(": ").unwrap_or((rest, ""));
                for _ in 0..n.parse::<usize>().unwrap_or(1) {
                    skipped.push((place.to_string(), reason.to_string()));
                }
            }
        }
        if line.contains(" in ") && (line.contains("passed") || line.contains("failed")) {
            for part in line.split([',', '=']) {
                if let Some(n) = part.trim().strip_suffix(" passed") {
                    passed = n.trim().parse().unwrap_or(passed);
                }
                if let Some((n, _)) = part.trim().split_once(" passed in ") {
                    passed = n.trim().parse().unwrap_or(passed);
                }
            }
        }
    }
    (passed, skipped)
}

/// The cargo invocations that make up one vendor's suite.
fn vendor_commands(vendor: &str) -> Vec<Command> {
    let mut cmds = Vec::new();
    match vendor {
        "host" => {
            // Everything vendor-neutral plus the host vendor, and the facade on the host vendor.
            let mut c = cargo();
            c.arg("test").args(SHARED).env("FLAGCX_VENDOR", "host");
            cmds.push(c);
            // Faults, aborts and lost peers again with frees that wait for every stream, as
            // CUDA's do: the library must not free while a stream waits for it on any of
            // those paths (docs/reliability.md).
            let mut c = cargo();
            c.arg("test")
                .args(SHARED)
                .args(["--test", "reliability", "--"])
                // Bootstrap, launcher and id tests free no device memory: the first run is
                // theirs (6 s of this run's 28 s on 2 cores).
                .args(FREE_SYNC_SKIPS.iter().flat_map(|t| ["--skip", t]))
                .env("FLAGCX_VENDOR", "host")
                .env("FLAGCX_HOST_FREE_SYNC", "1");
            cmds.push(c);
        }
        other => {
            let mut c = cargo();
            c.args(["test", "-p", &format!("flagcx-{other}")]);
            cmds.push(c);
            // The facade's suites on this vendor: the host suite's own binaries (built with
            // every vendor but HIP, whose library must be installed to link) where they serve;
            // for HIP the same selection with the facade's `hip` feature added, so only the
            // facade and the test rebuild (`-p flagcx --features hip` resolved every crate's
            // features anew and rebuilt the workspace's crates: 2.6 minutes of a fresh run).
            let facade = |c: &mut Command, test: &str| {
                c.arg("test")
                    .args(SHARED)
                    .args(["--exclude", "flagcx-host"]);
                if other == "hip" {
                    c.args(["--features", "flagcx/hip"]);
                }
                c.args(["--test", test]);
            };
            let mut c = cargo();
            facade(&mut c, "conformance");
            c.env("FLAGCX_VENDOR", other);
            cmds.push(c);
            if other == "opencl" {
                // No GPU in CI: OpenCL (PoCL) is the second real runtime, so its p2p jobs run
                // here — OpenCL ranks alone, and mixed with host-vendor ranks.
                let mut c = cargo();
                facade(&mut c, "p2p");
                c.env("FLAGCX_P2P_TEST_VENDORS", other)
                    .env("FLAGCX_P2P_TEST_MIXED", format!("host,{other}"));
                cmds.push(c);
                // Faults, aborts and timeouts with OpenCL ranks: their streams join at gates,
                // which an abort, a timeout and a lost peer must open.
                let mut c = cargo();
                facade(&mut c, "reliability");
                c.env("FLAGCX_P2P_TEST_VENDORS", other);
                cmds.push(c);
                // The C ABI with host and OpenCL ranks mixed.
                let mut c = cargo();
                facade(&mut c, "capi");
                c.args(["--", "opencl"]);
                cmds.push(c);
            }
        }
    }
    cmds
}

/// Reliability tests that free no device memory, left out of the host suite's second run
/// (frees that wait for every stream).
const FREE_SYNC_SKIPS: [&str; 9] = [
    "forged_secret_is_refused_and_logged",
    "silent_peer_times_out_a_bootstrap_exchange",
    "garbage_and_strangers_do_not_stop_the_job",
    "tcp_bootstrap_drops_garbage_and_wrong_secrets",
    "launcher_",
    "ranks_die_with_a_killed_launcher",
    "truncated_unique_id_is_a_config_error",
    "unique_id_carries_a_root_address",
    "ranks_with_different_ring_settings_refuse_each_other",
];

/// The package selection of the host suite, which every other suite's facade tests reuse (the
/// same selection resolves the same features, so one build serves all of them; `flagcx-py`
/// turns on the facade's CUDA and OpenCL features). The vendor crates' own tests run per suite.
const SHARED: [&str; 7] = [
    "--workspace",
    "--exclude",
    "flagcx-hip",
    "--exclude",
    "flagcx-cuda",
    "--exclude",
    "flagcx-opencl",
];

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
            if !note.is_empty() {
                note.push_str("; ");
            }
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
fn soak(iters: u64) -> Result {
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
fn fuzz(secs: u64) -> Result {
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
/// `--vs-mpi`, our Open MPI programs on the same machine in the same run.
///
/// The comparison alternates: three rounds, each running every segment of sizes (the small
/// sizes, then each large one) by us and right after by Open MPI; each row gives both sides'
/// medians with their ranges and the median of the rounds' ratios, in Open MPI's traffic
/// pattern (each all-to-all waited for before the next; ping-pongs wait per round trip anyway). A small VM swings both sides by 2–3×
/// between sittings (an 8 B Open MPI round trip took 0.20 µs in one and 0.70 µs a few minutes
/// later on the 2-core machine), so only numbers taken side by side compare.
fn bench(vs_mpi: bool, only: Option<&str>, record: Option<&str>) -> Result {
    if only.is_none() {
        run(
            "criterion benches (benches/pieces.rs)",
            cargo().args(["bench", "-p", "flagcx", "--bench", "pieces"]),
        )?;
    }
    run(
        "building flagcx-perf",
        cargo().args(["build", "--release", "-p", "flagcx", "--bin", "flagcx-perf"]),
    )?;
    let perf = root().join("target/release/flagcx-perf");
    // Each sweep with Open MPI's programs' iteration counts (benches/mpi): ping-pong 1000 up to
    // 1 MiB, then 2 GiB's worth; all-to-all 200 up to 1 MiB, then 1 GiB's worth. Ten calls of
    // a 1 MiB all-to-all measured mostly the first calls after a sweep's setup (184-394 us,
    // against 155-219 for a hundred), so the large sizes run one per sweep.
    let pingpong_small = [
        "-t", "pingpong", "-b", "8", "-e", "524288", "-f", "4", "-n", "1000", "-w", "50",
    ];
    // Our all-to-alls are waited for one by one (`--blocking`), as `MPI_Alltoall` returns
    // with the call done: the same traffic pattern. Enqueued back to back (nccl-tests'
    // pattern) they overlap calls, which Open MPI's program cannot.
    let one_size = |test: &str, ranks: u32, bytes: u64, iters: u64| -> Vec<String> {
        let wait = if test == "alltoall" {
            " --blocking"
        } else {
            ""
        };
        format!("-t {test} -N {ranks} -b {bytes} -e {bytes} -n {iters} -w 5{wait}")
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let pingpong_large: Vec<Vec<String>> = (0..4)
        .map(|i| 2u64 << 20 << (2 * i))
        .map(|b| one_size("pingpong", 2, b, ((2048 << 20) / b).max(10)))
        .collect();
    // All-to-all of 4 ranks (whole buffers, 4 blocks): 1 KiB .. 256 KiB, many calls (a
    // mixture-of-experts layer's token exchange is this small), then 1 MiB .. 256 MiB.
    let alltoall_small: Vec<&str> =
        "-t alltoall -N 4 -b 1024 -e 262144 -f 4 -n 1000 -w 50 --blocking"
            .split_whitespace()
            .collect();
    let alltoall_large: Vec<Vec<String>> = (0..5)
        .map(|i| 1u64 << 20 << (2 * i))
        .map(|b| {
            let iters = if b <= 1 << 20 { 200 } else { (1 << 30) / b };
            one_size("alltoall", 4, b, iters.max(5))
        })
        .collect();
    // All-reduce (sum, float32 and int32; 2 and 4 ranks): each call waited for
    // (`--blocking`), as `MPI_Allreduce` returns with it done; Open MPI's iteration counts.
    let allreduce = |ranks: u32, dtype: &str| -> Vec<Vec<String>> {
        let small = format!(
            "-t allreduce -N {ranks} -d {dtype} -b 8 -e 524288 -f 16 -n 1000 -w 50 --blocking"
        );
        std::iter::once(small.split_whitespace().map(String::from).collect())
            .chain([8u64 << 20, 128 << 20].into_iter().map(|b| {
                let mut a = one_size("allreduce", ranks, b, ((2048 << 20) / b).max(5));
                a.extend(["-d", dtype, "--blocking"].map(String::from));
                a
            }))
            .collect()
    };
    let (ar_f2, ar_i2, ar_f4) = (
        allreduce(2, "float"),
        allreduce(2, "int32"),
        allreduce(4, "float"),
    );
    fn args(v: &[Vec<String>]) -> Vec<Vec<&str>> {
        v.iter()
            .map(|a| a.iter().map(String::as_str).collect())
            .collect()
    }
    let (pingpong_large, alltoall_large) = (args(&pingpong_large), args(&alltoall_large));
    let (ar_f2, ar_i2, ar_f4) = (args(&ar_f2), args(&ar_i2), args(&ar_f4));
    if !vs_mpi {
        for args in
            std::iter::once(&pingpong_small[..]).chain(pingpong_large.iter().map(Vec::as_slice))
        {
            run(
                "flagcx-perf: host-vendor ping-pong",
                Command::new(&perf).args(args).env("FLAGCX_VENDOR", "host"),
            )?;
        }
        return Ok(());
    }
    let have = Command::new("mpicc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        return Err(
            "--vs-mpi needs Open MPI: sudo apt-get install openmpi-bin libopenmpi-dev".into(),
        );
    }
    for source in ["pingpong", "alltoall", "allreduce"] {
        run(
            &format!("mpicc benches/mpi/{source}.c"),
            Command::new("mpicc")
                .args(["-O2", "-o"])
                .arg(root().join(format!("target/mpi-{source}")))
                .arg(root().join(format!("benches/mpi/{source}.c"))),
        )?;
    }
    // Each test's sizes in segments, each segment run by us and then at once by Open MPI's
    // program over the same sizes: the two sides of a row are measured seconds apart, not a
    // whole sweep apart (this VM's speed changes between minutes; see the doc comment).
    // Every sweep gives its sizes in bytes, so they pass to Open MPI's program as they are.
    let segment = |args: &[&str]| -> [String; 2] {
        ["-b", "-e"].map(|f| {
            args.iter()
                .position(|a| *a == f)
                .map(|i| args[i + 1].to_string())
                .unwrap_or_default()
        })
    };
    // (name, our sweeps, Open MPI's program, ranks, its extra arguments)
    type Tests<'a> = [(&'a str, Vec<&'a [&'a str]>, &'a str, &'a str, &'a str); 5];
    let tests: Tests = [
        (
            "ping-pong",
            std::iter::once(&pingpong_small[..])
                .chain(pingpong_large.iter().map(Vec::as_slice))
                .collect(),
            "pingpong",
            "2",
            "",
        ),
        (
            "all-to-all, 4 ranks",
            std::iter::once(&alltoall_small[..])
                .chain(alltoall_large.iter().map(Vec::as_slice))
                .collect(),
            "alltoall",
            "4",
            "",
        ),
        (
            "all-reduce f32, 2 ranks",
            ar_f2.iter().map(Vec::as_slice).collect(),
            "allreduce",
            "2",
            "float",
        ),
        (
            "all-reduce i32, 2 ranks",
            ar_i2.iter().map(Vec::as_slice).collect(),
            "allreduce",
            "2",
            "int",
        ),
        (
            "all-reduce f32, 4 ranks",
            ar_f4.iter().map(Vec::as_slice).collect(),
            "allreduce",
            "4",
            "float",
        ),
    ];
    // (test, bytes) -> per round (ours, theirs), one time in µs each.
    type Rows = std::collections::BTreeMap<(usize, u64), Vec<(f64, f64)>>;
    let mut rows: Rows = Default::default();
    const ROUNDS: usize = 5;
    for round in 1..=ROUNDS {
        for (t, (name, sweeps, source, ranks, extra)) in tests.iter().enumerate() {
            if only.is_some_and(|o| !name.contains(o)) {
                continue;
            }
            for args in sweeps {
                let ours = capture(
                    &format!("round {round}/{ROUNDS}: flagcx-perf, host-vendor {name}"),
                    Command::new(&perf)
                        .args(*args)
                        .arg("--json")
                        .env("FLAGCX_VENDOR", "host"),
                )?;
                let [lo, hi] = segment(args);
                let mut mpirun = Command::new("mpirun");
                // Open MPI refuses to run as root unless told to; CI runs as root.
                if std::env::var("USER").map(|u| u == "root").unwrap_or(true) {
                    mpirun.arg("--allow-run-as-root");
                }
                let theirs = capture(
                    &format!("round {round}/{ROUNDS}: Open MPI {name} (shared-memory transport)"),
                    mpirun
                        .args(["--oversubscribe", "-n", ranks])
                        .arg(root().join(format!("target/mpi-{source}")))
                        .args([&lo, &hi])
                        .args((!extra.is_empty()).then_some(extra)),
                )?;
                // Our JSON rows and MPI's table rows (bytes, time in µs, …), joined on bytes.
                let mpi: std::collections::HashMap<u64, f64> = theirs
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .filter_map(|l| {
                        let mut c = l.split_whitespace();
                        Some((c.next()?.parse().ok()?, c.next()?.parse().ok()?))
                    })
                    .collect();
                for v in ours
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                {
                    let (Some(bytes), Some(us)) = (v["bytes"].as_u64(), v["time_us"].as_f64())
                    else {
                        continue;
                    };
                    if let Some(&m) = mpi.get(&bytes) {
                        rows.entry((t, bytes)).or_default().push((us, m));
                    }
                }
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        format!("{lo:.2}-{hi:.2}")
    };
    println!(
        "# same run, medians of {ROUNDS} alternating rounds (range in brackets); times in µs; \
         mpi/ours is the median of each round's ratio (the two sides of a round run seconds apart)"
    );
    println!(
        "  {:<22} {:>11} {:>10} {:>21} {:>10} {:>21} {:>9} {:>13}",
        "test", "bytes", "flagcx", "", "mpi", "", "mpi/ours", ""
    );
    let recorded = rows.clone();
    for ((t, bytes), pairs) in rows {
        let ours: Vec<f64> = pairs.iter().map(|p| p.0).collect();
        let theirs: Vec<f64> = pairs.iter().map(|p| p.1).collect();
        let ratios: Vec<f64> = pairs.iter().map(|(o, m)| m / o).collect();
        println!(
            "  {:<22} {bytes:>11} {:>10.2} {:>21} {:>10.2} {:>21} {:>9.2} {:>13}",
            tests[t].0,
            median(&ours),
            format!("[{}]", range(&ours)),
            median(&theirs),
            format!("[{}]", range(&theirs)),
            median(&ratios),
            format!("[{}]", range(&ratios)),
        );
    }
    println!("# mpi/ours above 1: flagcx-rs is faster (time ratio; for bandwidth the same number)");
    if let Some(name) = record {
        let data = recorded
            .into_iter()
            .map(|((t, bytes), pairs)| {
                let (name, _, _, ranks, extra) = &tests[t];
                serde_json::json!({
                    "test": name,
                    "ranks": ranks.parse::<u32>().unwrap_or(0),
                    "dtype": extra,
                    "bytes": bytes,
                    "ours_us": pairs.iter().map(|p| p.0).collect::<Vec<_>>(),
                    "peer_us": pairs.iter().map(|p| p.1).collect::<Vec<_>>(),
                })
            })
            .collect();
        let command = match only {
            Some(o) => format!("cargo xtask bench --vs-mpi --only '{o}'"),
            None => "cargo xtask bench --vs-mpi".into(),
        };
        let peer = format!(
            "{} (shared-memory transport, its own tuning; mpirun binds ranks), run seconds \
             after ours in each round",
            perfpage::mpi_version()
        );
        let meta = [
            ("labels", serde_json::json!({"peer": "Open MPI"})),
            ("references", serde_json::json!({ "peer": peer })),
        ];
        perfpage::record(name, &command, &meta, data)?;
    }
    Ok(())
}

/// Runs `cmd`, echoing its stdout, and returns that stdout.
fn capture(what: &str, cmd: &mut Command) -> std::result::Result<String, String> {
    eprintln!("xtask: {what}");
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{what}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{what} failed ({})", out.status))
    }
}

/// Completion scripts: the tools print their own (`--completions SHELL`), xtask writes its.
fn completions() -> Result {
    run(
        "building flagcx-perf and flagcx-run",
        cargo().args(["build", "--release", "-p", "flagcx", "--bins"]),
    )?;
    for (shell, dir) in [
        (clap_complete::Shell::Bash, "bash"),
        (clap_complete::Shell::Zsh, "zsh"),
        (clap_complete::Shell::Fish, "fish"),
    ] {
        let out = root().join("target/completions").join(dir);
        std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
        for tool in ["flagcx-perf", "flagcx-run"] {
            let o = Command::new(root().join("target/release").join(tool))
                .args(["--completions", dir])
                .output()
                .map_err(|e| format!("{tool}: {e}"))?;
            if !o.status.success() || o.stdout.is_empty() {
                return Err(format!("{tool} --completions {dir} failed"));
            }
            std::fs::write(out.join(tool), o.stdout).map_err(|e| e.to_string())?;
        }
        let mut f = std::fs::File::create(out.join("cargo-xtask")).map_err(|e| e.to_string())?;
        let mut cmd = <Cli as clap::CommandFactory>::command();
        clap_complete::generate(shell, &mut cmd, "cargo-xtask", &mut f);
    }
    println!(
        "completions: {} (bash: source target/completions/bash/flagcx-perf)",
        root().join("target/completions").display()
    );
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
    perfpage::perf_page(true)?;
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

#[cfg(test)]
mod pytest_tests {
    use super::pytest_counts;

    #[test]
    fn counts_from_pytest_output() {
        let text = "....s\nSKIPPED [2] tests/test_comm.py:70: no opencl device: gone\n\
                    =========== 23 passed, 2 skipped in 3.10s ===========\n";
        let (passed, skipped) = pytest_counts(text);
        assert_eq!(passed, 23);
        assert_eq!(skipped.len(), 2);
        assert_eq!(skipped[0].1, "no opencl device: gone");
        assert_eq!(pytest_counts("25 passed in 24.95s").0, 25);
        assert_eq!(pytest_counts("1 failed, 4 passed in 2.00s").0, 4);
    }
}
