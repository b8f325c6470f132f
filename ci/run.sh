#!/usr/bin/env bash
# Everything CI needs, installed idempotently, then `cargo xtask ci`
# (fmt check, clippy -D warnings, docs, and the README's test command `cargo xtask test`).
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

need_pkgs=()
# HIP headers and runtime so the hip vendor builds and links (there is no AMD GPU: its suite
# reports skipped with the runtime's reason).
[ -f /usr/include/hip/hip_runtime_api.h ] || need_pkgs+=(libamdhip64-dev)
command -v hipconfig >/dev/null || need_pkgs+=(hipcc)
# OpenCL: the ICD loader and PoCL's CPU device, the second real runtime that gives CI genuine
# heterogeneous (host + OpenCL) p2p jobs.
[ -e /usr/lib/x86_64-linux-gnu/libOpenCL.so ] || need_pkgs+=(ocl-icd-opencl-dev)
[ -e /etc/OpenCL/vendors/pocl.icd ] || need_pkgs+=(pocl-opencl-icd)
# Open MPI: the C ABI's MPI test (the unique id through MPI_Bcast) and `xtask bench --vs-mpi`.
command -v mpicc >/dev/null || need_pkgs+=(openmpi-bin libopenmpi-dev)
# CMake: the C ABI's CMake package test (find_package(Flagcx)).
command -v cmake >/dev/null || need_pkgs+=(cmake)
# UCX and iproute2: the network transport's tests run ranks in network namespaces ("hosts")
# joined by veth pairs, with UCX over TCP between them; ucx_perftest is the peer
# `xtask bench --net` measures against.
[ -e /usr/lib/x86_64-linux-gnu/libucp.so.0 ] || need_pkgs+=(libucx0)
command -v ucx_perftest >/dev/null || need_pkgs+=(ucx-utils)
command -v ip >/dev/null || need_pkgs+=(iproute2)
# A TrueType font: flagcx-perf --plot lays out its labels with it (tests/perf_smoke.rs).
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_pkgs+=(fonts-dejavu-core)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "ci: installing ${need_pkgs[*]}"
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

rustup component add rustfmt clippy >/dev/null 2>&1 || true

# The Python package's suite (`cargo xtask test` builds the wheel with maturin and runs
# crates/flagcx-py/tests under pytest): numpy for host and PoCL ranks, torch from PyPI (the
# only index CI reaches; its CUDA build imports and runs on CPU) for the torch backend.
py_missing=()
for m in maturin pytest numpy torch; do
  python3 -c "import $m" 2>/dev/null || py_missing+=("$m")
done
if [ ${#py_missing[@]} -gt 0 ]; then
  echo "ci: pip installing ${py_missing[*]}"
  python3 -m pip install --quiet --disable-pip-version-check "${py_missing[@]}"
fi

cargo xtask ci
