#!/bin/sh
# Copied into the GPU bundle by `cargo xtask bundle`: a CUDA rank and an OpenCL rank (NVIDIA's
# platform) on one GPU, the staging ring in device memory (FLAGCX_P2P_DEVICE_RING=auto: the
# OpenCL rank maps the CUDA rank's export) against the ring in pinned host memory (off), in
# alternating rounds, every byte checked; then the checks that the device ring is taken and
# right (the facade's cross-runtime import test, p2p's mixed jobs and device-ring jobs), and
# the probe of the same pair without flagcx code (copies taking turns, by kind and size), and
# small messages by how the OpenCL rank waits for its copies (FLAGCX_OPENCL_SYNC). One
# GPU suffices (~1 min per round). Logs in $FLAGCX_BUNDLE_LOGS/hetero; a table of µs per call and GB/s last.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}/hetero
mkdir -p "$logs"
rounds=${ROUNDS:-2}
. "$here/nvidia-icd.sh"
export OCL_ICD_VENDORS="$icd"
perf="$here/bin/flagcx-perf"
failed=0
# run NAME COMMAND...: the command's output in NAME.log; one status line.
run() {
  name=$1; shift
  if timeout 240 "$@" > "$logs/$name.log" 2>&1; then
    echo "$name: ok ($(grep -m1 'wrong bytes in all' "$logs/$name.log" || grep -E '^test result' "$logs/$name.log" | tail -n 1))"
  else
    echo "$name: FAILED (exit $?): $(grep -m1 -iE 'panicked|error|FAILED' "$logs/$name.log" | cut -c1-200)"
    failed=1
  fi
}
for r in $(seq 1 "$rounds"); do
  for ring in auto off; do
    for t in pingpong sendrecv; do
      run "$t-$ring-$r" env FLAGCX_P2P_DEVICE_RING=$ring FLAGCX_DEBUG=info "$perf" -t $t \
        --vendors cuda,opencl -b 8 -e 512M -f 4 -n 20 -w 5 -c
    done
  done
done
for ring in auto off; do
  for t in allgather alltoall; do
    run "$t-$ring" env FLAGCX_P2P_DEVICE_RING=$ring "$perf" -t $t --vendors cuda,opencl \
      -b 2M -e 512M -f 4 -n 10 -w 5 -c
  done
done
# How an OpenCL rank's eager copies are waited for (FLAGCX_OPENCL_SYNC): clFinish against polling
# the queue's last command (the default on GPUs), small messages, alternating rounds; first the
# platform's own 8 B copy waited for each way (benches/probes/ocl_roundtrip.c, no flagcx code).
if cc -O2 -o "$logs/roundtrip" "$here/ocl_roundtrip.c" -lOpenCL > "$logs/roundtrip.build" 2>&1; then
  timeout 60 "$logs/roundtrip" 1000 > "$logs/roundtrip.log" 2>&1
  sed -n 2,5p "$logs/roundtrip.log"
else
  echo "ocl_roundtrip: not built ($(head -n 1 "$logs/roundtrip.build"))"
fi
for r in $(seq 1 "$rounds"); do
  for m in finish auto; do
    run "sync-$m-$r" env FLAGCX_OPENCL_SYNC=$m "$perf" -t sendrecv --vendors opencl,host -b 8 -e 4K \
      -f 8 -n 300 -w 30 -c
    run "sync-cuda-$m-$r" env FLAGCX_OPENCL_SYNC=$m "$perf" -t sendrecv --vendors cuda,opencl -b 8 \
      -e 512 -f 8 -n 300 -w 30 -c
  done
done
run conformance-import "$here/bin/flagcx-conformance" --exact opencl_maps_a_cuda_export --nocapture
run p2p-mixed env FLAGCX_P2P_TEST_MIXED=cuda,opencl "$here/bin/flagcx-p2p" --exact mixed_vendor_job
run p2p-devring-cuda env FLAGCX_P2P_TEST_VENDORS=cuda "$here/bin/flagcx-p2p" --exact staged_through_device_rings
# The same pair with no flagcx code (benches/probes/ocl_cuda_extmem.c): what each copy costs
# when the two processes take turns on the GPU, by kind and size. A failure to build it is
# reported, not fatal.
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if "$nvcc" -O2 -o "$logs/extmem" "$here/ocl_cuda_extmem.c" -lcuda -lOpenCL > "$logs/extmem.build" 2>&1; then
  timeout 120 "$logs/extmem" > "$logs/extmem.log" 2>&1
  grep -E 'taking turns|wrong' "$logs/extmem.log"
else
  echo "ocl_cuda_extmem: not built ($(head -n 1 "$logs/extmem.build"))"
fi
echo "device ring taken (rank lines): $(grep -h 'device memory' "$logs"/pingpong-auto-1.log | wc -l) in auto, $(grep -h 'device memory' "$logs"/pingpong-off-1.log | wc -l) in off"
echo "µs per call (pingpong: round trip) and algbw GB/s; ratio = against the slower side's pinned copy"
printf '%-16s %s\n' "run" "8B | 32KiB | 2MiB | 8MiB (ratio) | 32MiB (ratio) | 512MiB GB/s (ratio)"
for f in "$logs"/pingpong-auto-*.log "$logs"/sendrecv-auto-*.log "$logs"/*-off-*.log "$logs"/allgather-*.log "$logs"/alltoall-*.log; do
  [ -f "$f" ] || continue
  printf '%-16s %s\n' "$(basename "$f" .log)" "$(awk '
    $1 == 8 || $1 == 32768 || $1 == 2097152 { printf "%s | ", $2 }
    $1 == 8388608 || $1 == 33554432 { printf "%s (%s) | ", $2, $8 }
    $1 == 536870912 { printf "%s (%s)", $3, $8 }' "$f")"
done
echo "µs per call at 8 B / 64 B / 512 B / 4 KiB, by how OpenCL waits for its copies (FLAGCX_OPENCL_SYNC)"
for f in "$logs"/sync-*.log; do
  printf '%-22s %s\n' "$(basename "$f" .log)" "$(awk '$1 ~ /^[0-9]+$/ { printf "%s (%s) ", $2, $9 }' "$f")"
done
exit $failed
