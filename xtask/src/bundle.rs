//! `cargo xtask bundle --vendor cuda`: everything a GPU host without Rust needs to run the
//! vendor's suites — release binaries (debug information stripped, symbols kept) and a `run.sh`
//! that runs them all, writes full logs, prints a short table last and exits non-zero on any
//! failure or skip.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{cargo, root, Result};

/// Capabilities the CUDA conformance suite must find on a GPU node (all of them on the H200).
const EXPECTED_CAPS: &str = "ipc_bytes,ipc_fd,host_register,host_pin,peer_access,host_functions,\
stream_mem_ops,stream_mem_ops_64,capture_mode,sized_copy";

/// One thing `run.sh` runs: a label, a log name, extra env, and the command. For test
/// binaries `args` is empty and the command is `bin/<file>`; otherwise `args` is the command.
struct Entry {
    label: String,
    file: String,
    env: Vec<(String, String)>,
    args: Vec<String>,
    /// On a node with two or more GPUs, run it in both placements: every rank on GPU 0
    /// (`CUDA_VISIBLE_DEVICES=0`), and ranks spread over the GPUs (the default device is the
    /// local rank modulo the count: one rank per GPU for two ranks, two per GPU for four).
    placements: bool,
}

/// A run of the facade's test binary `file` (`target`: conformance, p2p or reliability) with
/// OpenCL ranks, on the platform `run.sh` finds (`$icd`); skipped visibly where there is none.
fn opencl_entry(file: &str, target: &str, vendor: &str) -> Entry {
    let mut env = vec![("OCL_ICD_VENDORS".to_string(), "\"$icd\"".to_string())];
    let mut args = vec![format!("\"$here/bin/{file}\"")];
    match target {
        "conformance" => env.push(("FLAGCX_VENDOR".into(), "opencl".into())),
        "p2p" => {
            env.push(("FLAGCX_P2P_TEST_VENDORS".into(), "opencl".into()));
            env.push(("FLAGCX_P2P_TEST_MIXED".into(), format!("{vendor},opencl")));
            args.push("--skip net_".into());
        }
        _ => {
            env.push(("FLAGCX_P2P_TEST_VENDORS".into(), "opencl".into()));
            args.push("--skip direct --skip failed_registration_keeps_the_ring".into());
        }
    }
    Entry {
        label: format!("flagcx::{target} (opencl ranks)"),
        file: format!("{file}-opencl"),
        env,
        args,
        placements: false,
    }
}

pub(crate) fn bundle(vendors: &Option<Vec<String>>) -> Result {
    let vendor = match vendors.as_deref() {
        Some([v]) if v == "cuda" => v.clone(),
        _ => return Err("bundle supports exactly one GPU vendor: --vendor cuda".into()),
    };
    let out = root().join(format!("target/bundle-{vendor}"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.join("bin")).map_err(|e| e.to_string())?;

    // Test binaries: the vendor's own conformance suite and the facade on that vendor, with
    // OpenCL compiled in too (loaded at run time) for the OpenCL-rank suites below.
    let tests = build_tests(&[
        "-p",
        &format!("flagcx-{vendor}"),
        "-p",
        "flagcx",
        "--features",
        &format!("flagcx/{vendor},flagcx/opencl"),
    ])?;
    let mut opencl = Vec::new();
    let mut entries = Vec::new();
    for (krate, target, exe) in tests {
        let wanted = [
            (format!("flagcx-{vendor}"), "conformance"),
            ("flagcx".to_string(), "conformance"),
            ("flagcx".to_string(), "p2p"),
            ("flagcx".to_string(), "reliability"),
        ];
        if !wanted.iter().any(|(k, t)| *k == krate && *t == target) {
            continue;
        }
        let file = format!("{}-{}", krate.replace('-', "_"), target);
        copy_stripped(&exe, &out.join("bin").join(&file))?;
        if krate == "flagcx" {
            opencl.push(opencl_entry(&file, &target, &vendor));
        }
        let env = if target == "p2p" {
            // Same-vendor jobs on the GPU vendor, and the mixed shape with a host-vendor rank.
            vec![
                ("FLAGCX_P2P_TEST_VENDORS".into(), vendor.clone()),
                ("FLAGCX_P2P_TEST_MIXED".into(), format!("{vendor},host")),
            ]
        } else {
            vec![
                ("FLAGCX_VENDOR".into(), vendor.clone()),
                // A GPU node must really have these (see the conformance docs).
                ("FLAGCX_EXPECT_CAPS".into(), EXPECTED_CAPS.into()),
            ]
        };
        if target == "reliability" {
            // Faults, stopped peers, aborts and the launcher (the bundle's `flagcx-run`, found
            // beside the test binary) on GPU ranks. The forced direct pair is a host-vendor
            // case by construction: it runs on host ranks beside them.
            let bin = format!("\"$here/bin/{file}\"");
            entries.push(Entry {
                label: format!("{krate}::{target}"),
                file: file.clone(),
                env: vec![("FLAGCX_P2P_TEST_VENDORS".into(), vendor.clone())],
                args: vec![
                    bin.clone(),
                    "--skip direct --skip failed_registration_keeps_the_ring".into(),
                ],
                placements: false,
            });
            entries.push(Entry {
                label: format!("{krate}::{target} host direct"),
                file: format!("{file}-host-direct"),
                env: vec![("FLAGCX_P2P_TEST_VENDORS".into(), "host".into())],
                args: vec![bin, "direct failed_registration_keeps_the_ring".into()],
                placements: false,
            });
            continue;
        }
        // The network transport's jobs are host-vendor ranks in network namespaces with UCX:
        // CI's, not a GPU node's.
        let args = if target == "p2p" {
            vec![format!("\"$here/bin/{file}\""), "--skip net_".into()]
        } else {
            vec![]
        };
        entries.push(Entry {
            label: format!("{krate}::{target}"),
            file,
            env,
            args,
            placements: target == "p2p",
        });
    }
    if entries.len() != 5 || opencl.len() != 3 {
        return Err(format!(
            "expected 4 test binaries (5 entries, and 3 with OpenCL ranks), got {} and {}",
            entries.len(),
            opencl.len()
        ));
    }
    // The same suites with OpenCL ranks on the node's GPU (NVIDIA's platform: `$icd`).
    entries.extend(opencl);
    // The launcher, the main-job example and the perf tool, run on the GPU vendor.
    for (kind, name) in [
        ("--bin", "flagcx-run"),
        ("--example", "pingpong"),
        ("--bin", "flagcx-perf"),
        ("--example", "port_pingpong"),
        ("--example", "slot_pingpong"),
    ] {
        // OpenCL too (loaded at run time), for trying a CUDA rank next to an OpenCL rank.
        let exe = build_binary(kind, name, &format!("flagcx/{vendor},flagcx/opencl"))?;
        copy_stripped(&exe, &out.join("bin").join(name))?;
    }
    for source in ["pingpong", "alltoall"] {
        std::fs::copy(
            root().join(format!("benches/mpi/{source}.c")),
            out.join(format!("mpi-{source}.c")),
        )
        .map_err(|e| format!("copy the MPI peer ({source}): {e}"))?;
    }
    for probe in [
        "ipc_floor.c",
        "staged_floor.c",
        "queue_join.c",
        "ocl_cuda_extmem.c",
        "ocl_roundtrip.c",
        "pageable_calls.c",
        // FlagCX's own torch plugin over libflagcx (needs a FlagCX checkout carried beside).
        "flagcx_plugin.sh",
        "flagcx_plugin.py",
    ] {
        std::fs::copy(root().join("benches/probes").join(probe), out.join(probe))
            .map_err(|e| format!("copy the probe {probe}: {e}"))?;
    }
    // The C ABI on the GPU: libflagcx with this vendor, and tests/capi/ring.c built against
    // it here (the GPU host has no Rust), found at run time through an $ORIGIN rpath.
    let prefix = crate::capi::capi(std::slice::from_ref(&vendor))?;
    std::fs::create_dir_all(out.join("lib")).map_err(|e| e.to_string())?;
    std::fs::copy(
        prefix.join("lib/libflagcx.so.0"),
        out.join("lib/libflagcx.so.0"),
    )
    .map_err(|e| format!("copy libflagcx: {e}"))?;
    let status = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-pthread", "-o"])
        .arg(out.join("bin/capi-ring"))
        .arg(root().join("tests/capi/ring.c"))
        .arg(format!("-I{}", prefix.join("include").display()))
        .arg(out.join("lib/libflagcx.so.0"))
        .arg("-Wl,-rpath,$ORIGIN/../lib")
        .status()
        .map_err(|e| format!("cc: {e}"))?;
    if !status.success() {
        return Err("building the C ring for the bundle failed".into());
    }
    // The C++ ring through flagcx::Comm (libflagcx_cxx.a with this vendor, linked in).
    let status = std::process::Command::new("c++")
        .args(["-std=c++17", "-O2", "-Wall", "-Werror", "-o"])
        .arg(out.join("bin/cxx-ring"))
        .arg(root().join("tests/capi/ring.cpp"))
        .arg(format!("-I{}", prefix.join("include").display()))
        .arg(prefix.join("lib/libflagcx_cxx.a"))
        .args(["-lpthread", "-ldl", "-lm", "-lrt", "-lutil"])
        .status()
        .map_err(|e| format!("c++: {e}"))?;
    if !status.success() {
        return Err("building the C++ ring for the bundle failed".into());
    }
    // The MPI ring is compiled there, with that host's mpicc (its Open MPI), from these.
    std::fs::create_dir_all(out.join("capi")).map_err(|e| e.to_string())?;
    for (from, to) in [
        (root().join("tests/capi/mpi_ring.c"), "mpi_ring.c"),
        (root().join("tests/capi/client_cuda.c"), "client_cuda.c"),
        (root().join("tests/capi/common.h"), "common.h"),
        (
            root().join("tests/capi/port_pingpong.cu"),
            "port_pingpong.cu",
        ),
        (prefix.join("include/flagcx.h"), "flagcx.h"),
    ] {
        std::fs::copy(&from, out.join("capi").join(to))
            .map_err(|e| format!("copy {}: {e}", from.display()))?;
    }
    std::fs::write(
        out.join("capi-ring.sh"),
        r#"#!/bin/sh
# The C ring (tests/capi/ring.c) on two ranks of the GPU vendor, through libflagcx.
here=$(cd "$(dirname "$0")" && pwd)
id=$(mktemp -u /tmp/flagcx-capi-id.XXXXXX)
FLAGCX_RANK=0 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=0 FLAGCX_TEST_ID_FILE=$id "$here/bin/capi-ring" & a=$!
FLAGCX_RANK=1 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=1 FLAGCX_TEST_ID_FILE=$id "$here/bin/capi-ring" & b=$!
wait $a; ra=$?; wait $b; rb=$?; rm -f "$id"
[ $ra -eq 0 ] && [ $rb -eq 0 ] || exit 1
# The C++ ring (tests/capi/ring.cpp) through flagcx::Comm.
FLAGCX_RANK=0 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=0 FLAGCX_TEST_ID_FILE=$id "$here/bin/cxx-ring" & a=$!
FLAGCX_RANK=1 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=1 FLAGCX_TEST_ID_FILE=$id "$here/bin/cxx-ring" & b=$!
wait $a; ra=$?; wait $b; rb=$?; rm -f "$id"
[ $ra -eq 0 ] && [ $rb -eq 0 ] || exit 1
# The way torch's process groups call libflagcx (tests/capi/client_cuda.c): their own stream
# ordered by events, tensors at offsets in cudaMalloc segments freed and allocated again, a
# cudaMallocAsync pool, a segment mapped with cuMemCreate/cuMemMap; built against this host's
# CUDA runtime.
cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include cuda_lib=${CUDA_HOME:-/usr/local/cuda}/lib64
if [ -f "$cuda_inc/cuda_runtime.h" ]; then
  logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}; mkdir -p "$logs"
  cc -O2 -I"$here/capi" -I"$cuda_inc" -o "$logs/client-cuda" "$here/capi/client_cuda.c" \
    "$here/lib/libflagcx.so.0" -L"$cuda_lib" -lcudart -ldl -Wl,-rpath,"$here/lib" -Wl,-rpath,"$cuda_lib" || exit 1
  FLAGCX_RANK=0 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=0 FLAGCX_DEVICE=0 FLAGCX_TEST_ID_FILE=$id "$logs/client-cuda" & a=$!
  FLAGCX_RANK=1 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=1 FLAGCX_DEVICE=0 FLAGCX_TEST_ID_FILE=$id "$logs/client-cuda" & b=$!
  wait $a; ra=$?; wait $b; rb=$?; rm -f "$id"
  [ $ra -eq 0 ] && [ $rb -eq 0 ] || exit 1
else
  echo "skipped: no CUDA runtime headers at $cuda_inc: the torch-pattern client did not run"
  [ -n "${FLAGCX_SKIP_LOG:-}" ] && printf 'cuda\tcapi::client_cuda\tno cuda_runtime.h\n' >> "$FLAGCX_SKIP_LOG"
fi
# The unique id through MPI_Bcast (tests/capi/mpi_ring.c), built with this host's mpicc.
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}; mkdir -p "$logs"
  mpicc -O2 -I"$here/capi" -o "$logs/mpi-ring" "$here/capi/mpi_ring.c" "$here/lib/libflagcx.so.0" \
    -Wl,-rpath,"$here/lib" || exit 1
  mpirun --allow-run-as-root --oversubscribe -n 2 "$logs/mpi-ring" || exit 1
else
  echo "skipped: mpicc or mpirun not found: the MPI ring did not run"
  [ -n "${FLAGCX_SKIP_LOG:-}" ] && printf 'cuda\tcapi::mpi_ring\tmpicc or mpirun not found\n' >> "$FLAGCX_SKIP_LOG"
fi
"#,
    )
    .map_err(|e| e.to_string())?;
    // Device-initiated transfers: the example kernels, rebuilt to PTX with the host's nvcc
    // when it has one (else the shipped PTX), driven by two ranks.
    std::fs::create_dir_all(out.join("port/flagcx")).map_err(|e| e.to_string())?;
    for (from, to) in [
        ("examples/port/port_kernels.cu", "port/port_kernels.cu"),
        (
            "crates/flagcx-p2p/include/flagcx/device.cuh",
            "port/flagcx/device.cuh",
        ),
        ("benches/probes/port_floor.c", "port/port_floor.c"),
        ("benches/probes/port_floor.cu", "port/port_floor.cu"),
    ] {
        std::fs::copy(root().join(from), out.join(to)).map_err(|e| format!("copy {from}: {e}"))?;
    }
    std::fs::write(
        out.join("port.sh"),
        r#"#!/bin/sh
# Port channels: kernels put, signal, flush and wait through include/flagcx/device.cuh.
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}; mkdir -p "$logs"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
ptx=
if [ -x "$nvcc" ]; then
  "$nvcc" -ptx -arch=compute_75 -I "$here/port" -o "$logs/port_kernels.ptx"     "$here/port/port_kernels.cu" || exit 1
  ptx="$logs/port_kernels.ptx"
else
  echo "nvcc not found: the shipped PTX runs"
fi
"$here/bin/flagcx-run" -n 2 -- "$here/bin/port_pingpong" $ptx || exit 1
# The same over a staged pair: puts through the shared-memory lanes (crates/flagcx-p2p/src/port/lane.rs).
FLAGCX_P2P_DISABLE=1 "$here/bin/flagcx-run" -n 2 -- "$here/bin/port_pingpong" $ptx || exit 1
# The same from CUDA C++ through the C ABI (tests/capi/port_pingpong.cu), built here.
if [ -x "$nvcc" ]; then
  "$nvcc" -O2 -arch=native -I "$here/capi" -I "$here/port" -o "$logs/capi-port-pingpong" \
    "$here/capi/port_pingpong.cu" -Xlinker "$here/lib/libflagcx.so.0" -Xlinker -rpath -Xlinker "$here/lib" \
    || exit 1
  id=$(mktemp -u /tmp/flagcx-port-id.XXXXXX)
  export FLAGCX_VENDOR=cuda
  FLAGCX_RANK=0 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=0 FLAGCX_TEST_ID_FILE=$id "$logs/capi-port-pingpong" & a=$!
  FLAGCX_RANK=1 FLAGCX_NRANKS=2 FLAGCX_LOCAL_RANK=1 FLAGCX_TEST_ID_FILE=$id "$logs/capi-port-pingpong" & b=$!
  wait $a; ra=$?; wait $b; rb=$?; rm -f "$id"
  [ $ra -eq 0 ] && [ $rb -eq 0 ] || exit 1
  # The floor of both halves with no flagcx code (benches/probes/port_floor.c): a measurement,
  # so a failure here is reported, not fatal.
  if "$nvcc" -ptx -arch=compute_75 -o "$logs/port_floor.ptx" "$here/port/port_floor.cu" &&
     cc -O2 -I "$(dirname "$nvcc")/../include" -o "$logs/port_floor" "$here/port/port_floor.c" -ldl -lpthread; then
    "$logs/port_floor" "$logs/port_floor.ptx" 20000 || echo "port floor probe failed (exit $?)"
  else
    echo "port floor probe: not built"
  fi
fi
# FLAGCX_PORT_MPS=1 (run.sh sets it): the IPC ping-pongs again under MPS, where both processes'
# kernels run at once on one GPU (without it they take time slices of milliseconds): the
# kernel-to-kernel round trip that two GPUs would show, less the link. Starts and stops its own
# daemon (short socket paths under /tmp); where none can start, says so and goes on.
if [ "${FLAGCX_PORT_MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  mps=$(mktemp -d /tmp/flagcx-mps.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY="$mps/pipe" CUDA_MPS_LOG_DIRECTORY="$mps/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    sleep 1
    echo "under MPS:"
    "$here/bin/flagcx-run" -n 2 -- "$here/bin/port_pingpong" $ptx; rc=$?
    # Stream-ordered messages as one kernel per call (inboxes, taken words), every byte
    # checked: on one GPU only MPS lets both processes' kernels run at once.
    for t in sendrecv alltoall; do
      echo "stream-ordered $t under MPS, one kernel per call:"
      FLAGCX_VENDOR=cuda FLAGCX_P2P_STREAM=on FLAGCX_P2P_STREAM_KERNEL=on FLAGCX_P2P_IPC_COPIER=sender FLAGCX_TIMEOUT_MS=10000 \
        "$here/bin/flagcx-perf" -t $t -b 8 -e 32K -f 8 -n 200 -w 20 -c > "$logs/mps-stream-$t.log" 2>&1 || rc=1
      grep -vE '^(progress|# [a-z])' "$logs/mps-stream-$t.log" | tail -n 8
    done
    echo quit | nvidia-cuda-mps-control
    sleep 1
    rm -rf "$mps"
    [ $rc -eq 0 ] || exit 1
  else
    echo "MPS: the control daemon did not start here; the ping-pongs under MPS did not run"
    rm -rf "$mps"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
"#,
    )
    .map_err(|e| e.to_string())?;
    write_perf_script(&out, &vendor)?;
    // The open issues' one-rank-per-GPU targets in one call on a two-GPU node, with a verdict
    // table (`targets.py`, standard-library Python: the GPU hosts have no Rust); and
    // `queues.sh`, whether stream joins can hold up copies that share their hardware queue; and
    // `hang.sh`, how often two communicators per rank stop, with the stuck threads' frames;
    // `hetero.sh`, a CUDA and an OpenCL rank on one GPU through the device ring and the host's;
    // `nvidia-icd.sh`, which they source for NVIDIA's OpenCL platform.
    for f in [
        "targets.sh",
        "targets.py",
        "queues.sh",
        "hang.sh",
        "hetero.sh",
        "nvidia-icd.sh",
        "python.sh",
    ] {
        std::fs::copy(root().join("xtask/assets").join(f), out.join(f))
            .map_err(|e| format!("copy {f}: {e}"))?;
    }
    let pingpong = |label: &str, env: Vec<(String, String)>, launcher: Option<&str>| Entry {
        label: label.into(),
        file: label.replace([' ', '+', '/'], "-"),
        env,
        args: match launcher {
            None => vec!["\"$here/bin/pingpong\"".into(), "1024".into()],
            Some(vendors) => vec![
                "\"$here/bin/flagcx-run\"".into(),
                "-n 2 --vendors".into(),
                vendors.into(),
                "-- \"$here/bin/pingpong\" 1024".into(),
            ],
        },
        placements: false,
    };
    entries.push(pingpong(
        &format!("pingpong {vendor} ipc"),
        vec![("FLAGCX_VENDOR".into(), vendor.clone())],
        None,
    ));
    entries.push(pingpong(
        &format!("pingpong {vendor} staged"),
        vec![
            ("FLAGCX_VENDOR".into(), vendor.clone()),
            ("FLAGCX_P2P_DISABLE".into(), "1".into()),
        ],
        None,
    ));
    entries.push(pingpong(
        &format!("pingpong {vendor}+host"),
        vec![],
        Some(&format!("{vendor},host")),
    ));
    // The device's own cost of a stream-ordered message: one process, two streams, one kernel
    // per step against separate stream operations (every byte of the last echo checked).
    entries.push(Entry {
        label: format!("slot ping-pong ({vendor})"),
        file: "slot-pingpong".into(),
        env: vec![("FLAGCX_VENDOR".into(), vendor.clone())],
        args: vec!["\"$here/bin/slot_pingpong\"".into()],
        placements: false,
    });
    entries.push(Entry {
        label: format!("port channels ({vendor} kernels)"),
        file: "port".into(),
        env: vec![("FLAGCX_PORT_MPS".into(), "1".into())],
        args: vec!["sh".into(), "\"$here/port.sh\"".into()],
        placements: true,
    });
    bundle_python(&out)?;
    entries.push(Entry {
        label: format!("Python and torch ({vendor} ranks, the host's torch)"),
        file: "python".into(),
        env: vec![],
        args: vec!["sh".into(), "\"$here/python.sh\"".into()],
        placements: false,
    });
    entries.push(Entry {
        label: format!("C, C++, MPI rings ({vendor})"),
        file: "capi-ring".into(),
        env: vec![("FLAGCX_VENDOR".into(), vendor.clone())],
        args: vec!["sh".into(), "\"$here/capi-ring.sh\"".into()],
        placements: false,
    });
    write_script(&out, &entries)?;
    let size: u64 = std::fs::read_dir(out.join("bin"))
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "bundle: {} ({} entries, {:.1} MiB); run it with {}/run.sh",
        out.display(),
        entries.len(),
        size as f64 / (1 << 20) as f64,
        out.display()
    );
    if size > 64 << 20 {
        return Err(format!(
            "the bundle is {size} bytes, over the 64 MiB budget"
        ));
    }
    Ok(())
}

/// Builds one release binary or example of the facade with `features`; returns its path.
/// The Python package for `python.sh`: the wheel (abi3, for glibc 2.28 and later through zig
/// where `ziglang` is installed: GPU hosts run older systems than this one), the launcher, the
/// torch cases and the DDP example. Without maturin the bundle says so and `python.sh` skips.
fn bundle_python(out: &Path) -> Result {
    let dir = out.join("python");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let py = root().join("crates/flagcx-py");
    for (from, to) in [
        ("tests/launch.py", "launch.py"),
        ("tests/torch_ranks.py", "torch_ranks.py"),
        ("examples/ddp.py", "ddp.py"),
    ] {
        std::fs::copy(py.join(from), dir.join(to)).map_err(|e| format!("copy {from}: {e}"))?;
    }
    let has = |m: &str| {
        Command::new("python3")
            .args(["-c", &format!("import {m}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !has("maturin") {
        eprintln!("xtask: no maturin: the bundle has no wheel (python.sh will skip)");
        return Ok(());
    }
    let mut build = Command::new("python3");
    build
        .current_dir(&py)
        .args(["-m", "maturin", "build", "--release", "-o"]);
    build.arg(&dir);
    if has("ziglang") {
        build.args(["--zig", "--compatibility", "manylinux_2_28"]);
    }
    let status = build.status().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("maturin build of the wheel failed ({status})"));
    }
    Ok(())
}

fn build_binary(kind: &str, name: &str, features: &str) -> Result<PathBuf> {
    eprintln!("xtask: building {kind} {name}");
    let output = cargo()
        .args([
            "build",
            "--release",
            "--message-format=json",
            "-p",
            "flagcx",
        ])
        .args([kind, name, "--features", features])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(format!("building {name} failed"));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| format!("cargo did not report an executable for {name}"))
}

/// Builds release test binaries; returns (crate, target, executable) for each test target.
fn build_tests(args: &[&str]) -> Result<Vec<(String, String, PathBuf)>> {
    eprintln!("xtask: building release test binaries {args:?}");
    let output = cargo()
        .args(["test", "--release", "--no-run", "--message-format=json"])
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err("building the test binaries failed".into());
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let krate = msg["package_id"]
            .as_str()
            .and_then(package_name)
            .unwrap_or_default();
        let target = msg["target"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        found.push((krate, target, PathBuf::from(exe)));
    }
    Ok(found)
}

/// The package name in a cargo package id (`path+file:///…/cuda#flagcx-cuda@0.1.0` or
/// `flagcx-cuda 0.1.0 (path+…)`).
fn package_name(id: &str) -> Option<String> {
    if let Some((_, rest)) = id.rsplit_once('#') {
        let name = rest.split('@').next()?;
        // `…/flagcx#0.1.0` has no name part: the name is the last path segment.
        if name.chars().next()?.is_ascii_digit() {
            return id
                .rsplit_once('#')?
                .0
                .rsplit('/')
                .next()
                .map(str::to_string);
        }
        return Some(name.to_string());
    }
    id.split(' ').next().map(str::to_string)
}

/// Copies a binary without its debug information but with its symbol table, so that the
/// frames the tests print on the GPU hosts (`FLAGCX_TEST_STACKS`, panics) name their functions.
fn copy_stripped(from: &Path, to: &Path) -> Result {
    std::fs::copy(from, to).map_err(|e| format!("copy {}: {e}", from.display()))?;
    let status = std::process::Command::new("strip")
        .arg("--strip-debug")
        .arg(to)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!("xtask: warning: could not strip {}", to.display());
    }
    Ok(())
}

fn write_script(out: &Path, entries: &[Entry]) -> Result {
    let mut s = String::from(
        r#"#!/bin/sh
# Generated by `cargo xtask bundle`. Runs every suite in this bundle on this machine.
# Full logs go to $FLAGCX_BUNDLE_LOGS (default: ./logs next to this script); the table is last.
# Exit status: 0 only if every suite passed and none was skipped but the host suite's tests
# (ALLOW_SKIP=1 tolerates skips).
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}
mkdir -p "$logs"
fail=0
table=""
run() {
  label=$1; file=$2; shift 2
  log="$logs/$file.log"; skips="$logs/$file.skips"; rm -f "$skips"
  start=$(date +%s)
  if env FLAGCX_SKIP_LOG="$skips" "$@" >"$log" 2>&1; then status=ok; else status=FAILED; fail=1; fi
  secs=$(( $(date +%s) - start ))
  # The test binaries' own summaries only: a failing job echoes its ranks' summaries
  # ("[1] test result: ...") and the launcher's "rank 1 failed first", which are not tests.
  passed=$(grep '^test result:' "$log" | grep -o '[0-9]* passed' | awk '{s+=$1} END {print s+0}')
  failed=$(grep '^test result:' "$log" | grep -o '[0-9]* failed' | awk '{s+=$1} END {print s+0}')
  # Tests made only of host-rank jobs are the host suite's (CI runs them): skipped here by
  # design ("the host suite runs them"), they do not fail the bundle.
  skipped=0; hosts=0
  if [ -f "$skips" ]; then
    skipped=$(wc -l < "$skips"); hosts=$(grep -c 'the host suite runs them' "$skips")
  fi
  if [ $((skipped - hosts)) -gt 0 ] && [ "${ALLOW_SKIP:-0}" != 1 ]; then status=SKIPPED; fail=1; fi
  echo "== $label: $status (passed $passed, failed $failed, skipped $skipped, ${secs}s)"
  [ "$status" = ok ] || tail -n 40 "$log"
  table="$table$(printf '%-34s %-8s %6s %6s %7s %5ss' "$label" "$status" "$passed" "$failed" "$skipped" "$secs")
"
}
"#,
    );
    s.push_str("gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')\n");
    // The node's ICD loader may list only PoCL: the OpenCL-rank suites get NVIDIA's platform
    // through a vendors directory of their own (empty, and the suites skip, where it is absent).
    s.push_str(". \"$here/nvidia-icd.sh\"\n");
    for e in entries {
        let env: String = e.env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
        let command = if e.args.is_empty() {
            format!("\"$here/bin/{}\"", e.file)
        } else {
            e.args.join(" ")
        };
        if e.placements {
            let (l, f) = (&e.label, &e.file);
            let _ = writeln!(
                s,
                "if [ \"${{gpus:-0}}\" -ge 2 ]; then\n  \
                 run '{l} (all on GPU 0)' '{f}-one-gpu' env CUDA_VISIBLE_DEVICES=0 {env}{command}\n  \
                 run '{l} (spread over GPUs)' '{f}-spread' env {env}{command}\n\
                 else\n  run '{l}' '{f}' env {env}{command}\nfi"
            );
        } else {
            let _ = writeln!(s, "run '{}' '{}' env {env}{command}", e.label, e.file);
        }
    }
    s.push_str(
        r#"printf '\n%-34s %-8s %6s %6s %7s %6s\n' suite result passed failed skipped time
printf '%s' "$table"
exit $fail
"#,
    );
    let path = out.join("run.sh");
    std::fs::write(&path, s).map_err(|e| e.to_string())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `perf.sh`: the performance matrix of docs/performance.md, with each sweep's full output in
/// `$FLAGCX_BUNDLE_LOGS` and a short summary last.
fn write_perf_script(out: &Path, vendor: &str) -> Result {
    let s = format!(
        r#"#!/bin/sh
# Generated by `cargo xtask bundle`: the performance matrix (docs/performance.md).
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${{FLAGCX_BUNDLE_LOGS:-$here/logs}}
mkdir -p "$logs"
perf="$here/bin/flagcx-perf"
# FLAGCX_PERF_ONLY=<extended regex>: run only the sweeps whose names match.
sweep() {{ name=$1; shift; if [ -n "${{FLAGCX_PERF_ONLY:-}}" ] && ! echo "$name" | grep -Eq "$FLAGCX_PERF_ONLY"; then return; fi; echo "== $name: $*"; "$@" > "$logs/perf-$name.log" 2>&1; echo "   exit $?"; grep -v progress "$logs/perf-$name.log" | tail -n 30; }}
export FLAGCX_VENDOR={vendor}
sweep ipc-sendrecv   "$perf" -t sendrecv --transport ipc -b 8 -e 1G -f 4 -n 20 -w 5 -c --vs-nccl --plot "$logs/ipc-sendrecv.svg"
sweep ipc-pingpong   "$perf" -t pingpong --transport ipc -b 8 -e 1G -f 4 -n 50 -w 10 --vs-nccl
sweep staged-sendrecv "$perf" -t sendrecv --transport staged -b 8 -e 1G -f 4 -n 10 -w 3 -c
sweep staged-pingpong "$perf" -t pingpong --transport staged -b 8 -e 1G -f 8 -n 10 -w 3
for c in 1 8; do FLAGCX_P2P_CHUNKSIZE=${{c}}M FLAGCX_P2P_BUFFSIZE=$((c * 8))M sweep staged-pingpong-${{c}}m "$perf" -t pingpong --transport staged -b 64M -e 1G -f 4 -n 10 -w 3; done
sweep ipc-pingpong-big "$perf" -t pingpong --transport ipc -b 64M -e 1G -f 2 -n 50 -w 10
sweep ipc-sendrecv-big "$perf" -t sendrecv --transport ipc -b 64M -e 1G -f 2 -n 20 -w 5 -c
FLAGCX_P2P_IPC_COPIER=sender sweep ipc-sendrecv-push "$perf" -t sendrecv --transport ipc -b 8 -e 1G -f 4 -n 20 -w 5 -c
FLAGCX_P2P_IPC_COPIER=sender sweep ipc-pingpong-push "$perf" -t pingpong --transport ipc -b 8 -e 1G -f 4 -n 50 -w 10
# Stream-ordered small messages (opt-in until measured with one rank per GPU).
FLAGCX_P2P_STREAM=on FLAGCX_P2P_IPC_COPIER=sender sweep ipc-sendrecv-stream "$perf" -t sendrecv --transport ipc -b 8 -e 1G -f 4 -n 20 -w 5 -c --vs-nccl
FLAGCX_P2P_STREAM=on FLAGCX_P2P_IPC_COPIER=sender sweep ipc-pingpong-stream "$perf" -t pingpong --transport ipc -b 8 -e 1G -f 4 -n 50 -w 10 --vs-nccl
# Small-message IPC latency: moved by the posting threads (default) and by the proxies only.
sweep ipc-latency "$perf" -t pingpong --transport ipc -b 8 -e 64K -f 8 -n 2000 -w 100
FLAGCX_P2P_IPC_CALLER=off sweep ipc-latency-nocaller "$perf" -t pingpong --transport ipc -b 8 -e 64K -f 8 -n 2000 -w 100
FLAGCX_P2P_IPC_CALLER=off sweep ipc-pingpong-big-nocaller "$perf" -t pingpong --transport ipc -b 64M -e 1G -f 2 -n 50 -w 10
FLAGCX_STREAM_JOIN=none sweep ipc-pingpong-nojoin "$perf" -t pingpong --transport ipc -b 8 -e 1G -f 8 -n 50 -w 10
unset FLAGCX_VENDOR
sweep mixed-sendrecv "$perf" -t sendrecv --vendors {vendor},host -b 8 -e 1G -f 4 -n 10 -w 3 -c
sweep mixed-pingpong "$perf" -t pingpong --vendors {vendor},host -b 8 -e 1G -f 8 -n 10 -w 3
FLAGCX_P2P_HOST_DIRECT=off sweep mixed-sendrecv-ring "$perf" -t sendrecv --vendors {vendor},host -b 8 -e 1G -f 4 -n 10 -w 3 -c
FLAGCX_P2P_HOST_DIRECT=off sweep mixed-pingpong-ring "$perf" -t pingpong --vendors {vendor},host -b 8 -e 1G -f 8 -n 10 -w 3
sweep host-pingpong  "$perf" -t pingpong --vendor host -b 8 -e 256M -f 4 -n 100 -w 10
FLAGCX_STREAM_JOIN=none sweep host-pingpong-nojoin "$perf" -t pingpong --vendor host -b 8 -e 256M -f 4 -n 100 -w 10
# Small-message latency needs many iterations; eager path on (default) and off.
sweep host-latency "$perf" -t pingpong --vendor host -b 8 -e 64K -f 2 -n 20000 -w 1000
FLAGCX_P2P_EAGER_MAX=0 sweep host-latency-noeager "$perf" -t pingpong --vendor host -b 8 -e 64K -f 2 -n 20000 -w 1000
for n in 2 4 8; do sweep host-pairs-$n "$perf" -t pairs -N $n --vendor host -b 1M -e 64M -f 8 -n 10 -w 3 -c; done
FLAGCX_VENDOR={vendor} FLAGCX_PROFILE=1 sweep ipc-profile "$perf" -t pingpong --transport ipc -b 8 -e 4K -f 8 -n 200 -w 20
FLAGCX_VENDOR={vendor} FLAGCX_PROFILE=1 sweep staged-profile "$perf" -t pingpong --transport staged -b 8 -e 4K -f 8 -n 200 -w 20
# The floor: the same round trips with no flagcx code (benches/probes/ipc_floor.c).
if command -v cc >/dev/null && cc -O2 -o "$logs/ipc_floor" "$here/ipc_floor.c" -ldl; then
  sweep ipc-floor sh -c "'$logs/ipc_floor' 20000 8; '$logs/ipc_floor' 300 67108864; '$logs/ipc_floor' 100 268435456"
else
  echo "== ipc-floor: skipped: no C compiler"
fi
if command -v cc >/dev/null && cc -O2 -o "$logs/staged_floor" "$here/staged_floor.c" -ldl; then
  sweep staged-floor sh -c "for n in 67108864 134217728 268435456; do '$logs/staged_floor' 10 \$n; done"
fi
if command -v mpicc >/dev/null; then
  mpicc -O2 -o "$logs/mpi-pingpong" "$here/mpi-pingpong.c" &&
  sweep mpi-pingpong mpirun --allow-run-as-root --oversubscribe -n 2 "$logs/mpi-pingpong" 8 268435456
  # The host vendor against Open MPI on this machine's cores: three alternating rounds, as
  # `cargo xtask bench --vs-mpi` does on the development machine.
  if mpicc -O2 -o "$logs/mpi-alltoall" "$here/mpi-alltoall.c"; then
    for r in 1 2 3; do
      sweep host-vs-mpi-pp-$r "$perf" -t pingpong --vendor host -b 8 -e 512K -f 4 -n 1000 -w 50
      sweep host-vs-mpi-pp-large-$r "$perf" -t pingpong --vendor host -b 2M -e 256M -f 4 -n 20 -w 3
      sweep mpi-pp-$r mpirun --allow-run-as-root --oversubscribe -n 2 "$logs/mpi-pingpong" 8 268435456
      sweep host-vs-mpi-a2a-$r "$perf" -t alltoall -N 4 --vendor host -b 1M -e 256M -f 4 -n 10 -w 2 -c --blocking
      sweep mpi-a2a-$r mpirun --allow-run-as-root --oversubscribe -n 4 "$logs/mpi-alltoall" 1048576 268435456
    done
  fi
else
  echo "== mpi-pingpong: skipped: mpicc not found"
fi
# Collectives of a GPU rank and a host rank against the pair's point-to-point (mixed-sendrecv).
for t in allgather alltoall broadcast; do sweep mixed-$t "$perf" -t $t --vendors {vendor},host -b 8 -e 1G -f 8 -n 10 -w 3 -c; done
# In place (no local copy on the host rank), as nccl-tests' second column.
for t in allgather broadcast; do sweep mixed-$t-inplace "$perf" -t $t --vendors {vendor},host -b 8 -e 1G -f 8 -n 10 -w 3 -c --in-place; done
# Device-to-device copies of 1 MiB and more on the SMs instead of the copy engines (CUDA,
# FLAGCX_CUDA_COPY_KERNEL): every byte checked, beside the same sweeps on the engines.
for k in off all; do
  for t in broadcast sendrecv; do FLAGCX_VENDOR={vendor} FLAGCX_CUDA_COPY_KERNEL=$k sweep copy-kernel-$k-$t "$perf" -t $t -b 1M -e 1G -f 4 -n 20 -w 5 -c; done
done
"#
    );
    let path = out.join("perf.sh");
    std::fs::write(&path, s).map_err(|e| e.to_string())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::package_name;

    #[test]
    fn package_names_from_both_id_formats() {
        assert_eq!(
            package_name("path+file:///w/adaptors/cuda#flagcx-cuda@0.1.0").as_deref(),
            Some("flagcx-cuda")
        );
        assert_eq!(
            package_name("path+file:///w/main#flagcx@0.1.0").as_deref(),
            Some("flagcx")
        );
        assert_eq!(
            package_name("path+file:///w/flagcx#0.1.0").as_deref(),
            Some("flagcx")
        );
        assert_eq!(
            package_name("flagcx-cuda 0.1.0 (path+file:///w)").as_deref(),
            Some("flagcx-cuda")
        );
    }
}
