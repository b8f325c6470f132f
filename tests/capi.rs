//! The C ABI from C: the programs of `tests/capi/` compiled against the installed library
//! (`cargo xtask capi`, which `cargo xtask test` runs first and names in
//! `FLAGCX_CAPI_PREFIX`) and run as real jobs: a ring on 2 and 4 ranks, mixed host and
//! OpenCL ranks where the library has OpenCL, a killed peer, and the unique id passed by
//! MPI_Bcast under `mpirun` where Open MPI is installed; and every name of FlagCX's header
//! checked at compile time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use flagcx_adaptor::conformance::report_skip_reason;

/// The install prefix, or a reported skip.
fn prefix(test: &str) -> Option<PathBuf> {
    match std::env::var_os("FLAGCX_CAPI_PREFIX") {
        Some(p) => Some(p.into()),
        None => {
            report_skip_reason(
                test,
                "host",
                "FLAGCX_CAPI_PREFIX is not set: run through `cargo xtask test`, which installs \
                 libflagcx first (`cargo xtask capi`)",
            );
            None
        }
    }
}

fn src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/capi")
        .join(name)
}

/// Compiles `tests/capi/<name>` with `compiler` against the library, with the flags
/// `pkg-config` gives for it (`flagcx`, or `flagcx-cxx` for C++; the prefix's own flags where
/// pkg-config is missing).
fn compile(prefix: &Path, compiler: &str, name: &str) -> PathBuf {
    let lib = prefix.join("lib");
    let cxx = name.ends_with(".cpp");
    let mut flags = vec![
        format!("-I{}", prefix.join("include").display()),
        format!("-L{}", lib.display()),
        format!("-Wl,-rpath,{}", lib.display()),
        if cxx { "-lflagcx_cxx" } else { "-lflagcx" }.to_string(),
    ];
    if cxx {
        flags.extend(["-std=c++17", "-lpthread", "-ldl", "-lm"].map(str::to_string));
    }
    let package = if cxx { "flagcx-cxx" } else { "flagcx" };
    if let Ok(out) = Command::new("pkg-config")
        .args(["--cflags", "--libs", package])
        .env("PKG_CONFIG_PATH", lib.join("pkgconfig"))
        .output()
    {
        if out.status.success() {
            let pc = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(pc.contains("-lflagcx"), "pkg-config {package} says {pc:?}");
            flags = pc.split_whitespace().map(str::to_string).collect();
        }
    }
    // Under cargo's per-target scratch folder: nothing is left in /tmp.
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("capi");
    std::fs::create_dir_all(&out_dir).expect("scratch dir");
    // One file per compilation: tests compiling the same program run in parallel.
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let exe = out_dir.join(format!("{}-{k}", name.split('.').next().unwrap_or(name)));
    let status = Command::new(compiler)
        .args(["-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-o"])
        .arg(&exe)
        .arg(src(name))
        .args(&flags)
        .status()
        .unwrap_or_else(|e| panic!("{compiler}: {e}"));
    assert!(status.success(), "{compiler} {name} failed");
    exe
}

/// Starts `n` ranks of `exe` (vendors cycled), the id passed through a file.
fn job(exe: &Path, n: usize, vendors: &[&str]) -> Vec<Child> {
    let id = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "id-{}-{}",
        std::process::id(),
        exe.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&id);
    (0..n)
        .map(|r| {
            Command::new(exe)
                .env("FLAGCX_RANK", r.to_string())
                .env("FLAGCX_NRANKS", n.to_string())
                .env("FLAGCX_LOCAL_RANK", r.to_string())
                .env("FLAGCX_VENDOR", vendors[r % vendors.len()])
                .env("FLAGCX_TEST_ID_FILE", &id)
                .env_remove("FLAGCX_UNIQUE_ID")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect()
}

fn finish(c: Child, limit: Duration) -> Output {
    let pid = c.id() as i32;
    let t = Instant::now();
    let waiter = std::thread::spawn(move || c.wait_with_output().expect("wait"));
    while !waiter.is_finished() {
        if t.elapsed() > limit {
            // SAFETY: killing our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    waiter.join().expect("join")
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ring(prefix: &Path, n: usize, vendors: &[&str]) {
    let exe = compile(prefix, "cc", "ring.c");
    run_ranks(&exe, n, vendors, "capi ring ok");
}

fn run_ranks(exe: &Path, n: usize, vendors: &[&str], ok: &str) {
    for (r, c) in job(exe, n, vendors).into_iter().enumerate() {
        let o = finish(c, Duration::from_secs(60));
        let t = text(&o);
        assert!(
            o.status.success() && t.contains(ok),
            "{} rank {r} of {n} ({vendors:?}):\n{t}",
            exe.display()
        );
    }
}

/// The data-movement collectives from C on 2, 3 and 4 host ranks, and host+OpenCL where the
/// library and this binary have OpenCL.
#[test]
fn c_collectives_on_host_ranks() {
    let Some(p) = prefix("capi::c_collectives_on_host_ranks") else {
        return;
    };
    let exe = compile(&p, "cc", "collectives.c");
    for n in [2, 3, 4] {
        run_ranks(&exe, n, &["host"], "capi collectives ok");
    }
}

/// The reductions from C (`tests/capi/reductions.c`): every integer type, float32 and float64,
/// every operator, all-reduce, reduce-scatter and reduce, in place and not, on 2, 3 and 4
/// host ranks; argument errors.
#[test]
fn c_reductions_on_host_ranks() {
    let Some(p) = prefix("capi::c_reductions_on_host_ranks") else {
        return;
    };
    let exe = compile(&p, "cc", "reductions.c");
    for n in [2, 3, 4] {
        run_ranks(&exe, n, &["host"], "capi reductions ok");
    }
}

/// Port channels from C (host ranks drive the FIFO themselves): a put with a signal checked
/// byte for byte, a poisoned channel releasing the peer, the calls' argument errors.
#[test]
fn c_port_channel_on_host_ranks() {
    let Some(p) = prefix("capi::c_port_channel_on_host_ranks") else {
        return;
    };
    let exe = compile(&p, "cc", "port.c");
    run_ranks(&exe, 2, &["host"], "capi port ok");
}

/// The C++ API (`flagcx/comm.hpp`): a ring, exceptions with their kind.
#[test]
fn cxx_ring_on_two_and_four_host_ranks() {
    let Some(p) = prefix("capi::cxx_ring_on_two_and_four_host_ranks") else {
        return;
    };
    let exe = compile(&p, "c++", "ring.cpp");
    run_ranks(&exe, 2, &["host"], "cxx ring ok");
    run_ranks(&exe, 4, &["host"], "cxx ring ok");
}

/// The CMake package: `find_package(Flagcx)` builds both rings, which then run.
#[test]
fn cmake_package_builds_the_c_and_cxx_rings() {
    let test = "capi::cmake_package_builds_the_c_and_cxx_rings";
    let Some(p) = prefix(test) else {
        return;
    };
    if !Command::new("cmake")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        report_skip_reason(test, "host", "cmake is not installed");
        return;
    }
    let build =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cmake-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&build);
    let configure = Command::new("cmake")
        .arg("-S")
        .arg(src(""))
        .arg("-B")
        .arg(&build)
        .arg(format!("-DCMAKE_PREFIX_PATH={}", p.display()))
        .output()
        .expect("cmake");
    assert!(configure.status.success(), "{}", text(&configure));
    let make = Command::new("cmake")
        .arg("--build")
        .arg(&build)
        .output()
        .expect("cmake --build");
    assert!(make.status.success(), "{}", text(&make));
    run_ranks(&build.join("ring_c"), 2, &["host"], "capi ring ok");
    run_ranks(&build.join("ring_cxx"), 2, &["host"], "cxx ring ok");
    let _ = std::fs::remove_dir_all(&build);
}

#[test]
fn c_ring_on_two_and_four_host_ranks() {
    let Some(p) = prefix("capi::c_ring_on_two_and_four_host_ranks") else {
        return;
    };
    ring(&p, 2, &["host"]);
    ring(&p, 4, &["host"]);
}

/// Host and OpenCL ranks mixed, where the library was built with OpenCL
/// (`FLAGCX_CAPI_VENDORS`) and an OpenCL platform is present.
#[test]
fn c_ring_on_host_and_opencl_ranks() {
    let test = "capi::c_ring_on_host_and_opencl_ranks";
    let Some(p) = prefix(test) else {
        return;
    };
    let vendors = std::env::var("FLAGCX_CAPI_VENDORS").unwrap_or_default();
    if !vendors.split(',').any(|v| v == "opencl") {
        report_skip_reason(test, "opencl", "libflagcx was built without OpenCL");
        return;
    }
    #[cfg(feature = "opencl")]
    {
        if let Err(e) = flagcx::Adaptor::open(flagcx::Vendor::OpenCl, 0) {
            flagcx_adaptor::conformance::report_skip(test, &e);
            return;
        }
        ring(&p, 2, &["host", "opencl"]);
        ring(&p, 4, &["host", "opencl"]);
    }
    #[cfg(not(feature = "opencl"))]
    {
        let _ = p;
        report_skip_reason(test, "opencl", "this test binary was built without OpenCL");
    }
}

/// A peer dies: `flagcxCommGetAsyncError` reports it, `flagcxCommAbort` returns.
#[test]
fn c_killed_peer_is_an_async_error() {
    let Some(p) = prefix("capi::c_killed_peer_is_an_async_error") else {
        return;
    };
    let exe = compile(&p, "cc", "killed.c");
    let mut ranks = job(&exe, 2, &["host"]).into_iter();
    let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
    let (o0, o1) = (
        finish(r0, Duration::from_secs(60)),
        finish(r1, Duration::from_secs(60)),
    );
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&o1.status),
        Some(libc::SIGKILL),
        "{}",
        text(&o1)
    );
    let t = text(&o0);
    assert!(
        o0.status.success() && t.contains("capi killed peer ok"),
        "{t}"
    );
}

/// The unique id passed by `MPI_Bcast` under `mpirun`, as FlagCX's own tests do it.
#[test]
fn c_ring_with_the_id_from_mpi() {
    let test = "capi::c_ring_with_the_id_from_mpi";
    let Some(p) = prefix(test) else {
        return;
    };
    let have = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !have("mpicc") || !have("mpirun") {
        report_skip_reason(
            test,
            "host",
            "Open MPI is not installed (apt-get install openmpi-bin libopenmpi-dev)",
        );
        return;
    }
    let exe = compile(&p, "mpicc", "mpi_ring.c");
    let mut cmd = Command::new("mpirun");
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    let child = cmd
        .args(["--oversubscribe", "-n", "2"])
        .arg(&exe)
        .env("FLAGCX_VENDOR", "host")
        .env_remove("FLAGCX_RANK")
        .env_remove("FLAGCX_UNIQUE_ID")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    let o = finish(child, Duration::from_secs(120));
    let t = text(&o);
    assert!(
        o.status.success() && t.matches("capi mpi ring ok").count() == 2,
        "{t}"
    );
}

/// `flagcx.h` declares exactly the functions `libflagcx.so` exports, and each declaration
/// follows a comment (the header is the C documentation).
#[test]
fn header_and_library_export_the_same_functions() {
    let Some(p) = prefix("capi::header_and_library_export_the_same_functions") else {
        return;
    };
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(p.join("lib/libflagcx.so.0"))
        .output()
        .expect("nm");
    assert!(out.status.success(), "{}", text(&out));
    let exported: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, kind, name) = (f.next()?, f.next()?, f.next()?);
            (kind == "T" && (name.starts_with("flagcx") || name.starts_with("getFlagcx")))
                .then(|| name.to_string())
        })
        .collect();
    let header = std::fs::read_to_string(p.join("include/flagcx.h")).expect("header");
    let mut declared = std::collections::BTreeSet::new();
    let lines: Vec<&str> = header.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let decl = t
            .strip_prefix("flagcxResult_t ")
            .or_else(|| t.strip_prefix("size_t "))
            .or_else(|| t.strip_prefix("const char *"));
        let Some(name) = decl.and_then(|d| d.split('(').next()) else {
            continue;
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric()) {
            continue;
        }
        declared.insert(name.to_string());
        // A comment ends right above (possibly above sibling declarations of one comment).
        let above = lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .find(|l| {
                !l.is_empty()
                    && !l.starts_with("flagcxResult_t")
                    && !l.ends_with(");")
                    && !l.ends_with(',')
            })
            .unwrap_or("");
        assert!(
            above.ends_with("*/"),
            "{name} in flagcx.h has no comment above it (found {above:?})"
        );
    }
    assert_eq!(exported, declared, "exported vs declared");
    assert!(declared.len() > 30, "{declared:?}");
}

/// Every name of FlagCX's `flagcx.h` (API 0.13, FlagCX commit 0c721293) is in ours with
/// FlagCX's value, layout and signature (`tests/capi/header_names.c` asserts them at compile
/// time and links a pointer to every function), and the calls flagcx-rs does not implement
/// return `flagcxNotSupported` without touching their NULL arguments.
#[test]
fn c_header_declares_every_flagcx_name() {
    let Some(p) = prefix("capi::c_header_declares_every_flagcx_name") else {
        return;
    };
    let exe = compile(&p, "cc", "header_names.c");
    let o = finish(
        Command::new(&exe)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start header_names"),
        Duration::from_secs(60),
    );
    let t = text(&o);
    assert!(
        o.status.success() && t.contains("capi header names ok"),
        "{}:\n{t}",
        exe.display()
    );
}
