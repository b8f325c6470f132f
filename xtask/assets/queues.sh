#!/bin/sh
# Copied into the GPU bundle by `cargo xtask bundle`: whether a caller's stream that waits on a
# word (a join: `FLAGCX_STREAM_JOIN=memop`) can hold up copies enqueued after it on another
# stream when both land in one hardware queue. CUDA gives a process CUDA_DEVICE_MAX_CONNECTIONS
# queues (8 by default); with 1, every stream of the process shares one. A join waits for a word
# the engine writes once the proxy's copy completed: if that copy queues behind the wait, neither
# moves. The hypothesis behind the lower copier stopping under MPS (2026-12-04, docs/
# performance.md at 7ff18bc): there, clients share the server's queues. Every run has a 5 s operation
# timeout and a 90 s limit, so a stall shows as a failure, not a stuck call. One GPU suffices.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}/queues
mkdir -p "$logs"
perf="$here/bin/flagcx-perf"
# try NAME COMMAND...: one line, "completed" or why not.
try() {
  name=$1; shift
  printf '%-34s ' "$name"
  if timeout 90 env FLAGCX_TIMEOUT_MS=5000 "$@" > "$logs/$name.log" 2>&1; then
    echo "completed ($(grep -c '^ *[0-9]' "$logs/$name.log") sizes; $(grep -m1 'wrong bytes in all' "$logs/$name.log"))"
  else
    rc=$?
    why=$(grep -m1 -iE 'timed out|no progress|error' "$logs/$name.log")
    [ -n "$why" ] || why=$(tail -n 1 "$logs/$name.log")
    echo "FAILED (exit $rc): $(echo "$why" | cut -c1-160)"
  fi
}
# The same without flagcx code (benches/probes/queue_join.c): which streams a wait holds up,
# by queue count, stream count, priority and context. A measurement: a failure to build it is
# reported, not fatal.
cuda_inc=$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include
if cc -O2 -I "$cuda_inc" -o "$logs/queue_join" "$here/queue_join.c" -ldl 2> "$logs/queue_join.build"; then
  for c in 1 8; do
    CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 60 "$logs/queue_join" > "$logs/queue_join-$c.log" 2>&1
    echo "queue_join, $c queue(s): $(grep -c ' ran ' "$logs/queue_join-$c.log") variants ran beside the wait, $(grep -c ' HELD ' "$logs/queue_join-$c.log") held; $(grep -m1 -E 'second context copies|skipped' "$logs/queue_join-$c.log" | sed 's/.*after its event: //')"
  done
else
  echo "queue_join: not built ($(head -n 1 "$logs/queue_join.build"))"
fi
export FLAGCX_VENDOR=cuda
# Every operation through the proxy (no posting-thread copies on the caller's stream), each
# iteration enqueued behind the last, so streams are busy at posting and join. With one queue
# the pair copies late by default (the header says so) and must complete; with late copies off
# (and for staged and CUDA+host pairs, which cannot copy late) the posts wait for what the
# proxy copies instead of a stream join, and must complete too (before `Comm::posts_wait` they stalled).
for c in 8 1; do
  try "proxy, $c queue(s)" env CUDA_DEVICE_MAX_CONNECTIONS=$c FLAGCX_P2P_IPC_CALLER=off \
    "$perf" -t sendrecv --transport ipc -b 4K -e 4M -f 32 -n 50 -w 5 -c
done
try "1 queue, late off (posts wait)" env CUDA_DEVICE_MAX_CONNECTIONS=1 FLAGCX_P2P_LATE_COPY=off \
  FLAGCX_P2P_IPC_CALLER=off "$perf" -t sendrecv --transport ipc -b 4K -e 4M -f 32 -n 50 -w 5 -c
for c in 8 1; do
  for t in sendrecv pingpong; do
    try "staged $t, $c queue(s)" env CUDA_DEVICE_MAX_CONNECTIONS=$c FLAGCX_P2P_DISABLE=1 \
      "$perf" -t $t -b 8 -e 64M -f 8 -n 30 -w 5 -c
    try "cuda+host $t, $c queue(s)" env CUDA_DEVICE_MAX_CONNECTIONS=$c \
      "$perf" -t $t --vendors cuda,host -b 8 -e 64M -f 8 -n 30 -w 5 -c
  done
done
# Everyday traffic with one queue (late copies) against the default eight (the table in
# git show 7ff18bc:docs/performance.md, "Late copies"), every byte checked; the logs hold the rows.
for c in 8 1; do
  for t in sendrecv pingpong alltoall; do
    try "$t, $c queue(s)" env CUDA_DEVICE_MAX_CONNECTIONS=$c \
      "$perf" -t $t -b 8 -e 64M -f 8 -n 50 -w 5 -c
  done
done
echo "µs per call at 8 B / 4 KiB / 256 KiB / 16 MiB:"
for t in sendrecv pingpong alltoall "staged sendrecv" "staged pingpong" "cuda+host sendrecv" "cuda+host pingpong"; do
  for c in 8 1; do
    f="$logs/$t, $c queue(s).log"
    [ -f "$f" ] || continue
    printf '  %-10s %s queue(s): %s\n' "$t" "$c" \
      "$(awk '$1 ~ /^(8|4096|262144|16777216|67108864)$/ { printf "%s ", $2 }' "$f")"
  done
done
# Under MPS: the lower copier, forced, with the default queues and with 32 per client.
if command -v nvidia-cuda-mps-control >/dev/null; then
  mps=$(mktemp -d /tmp/flagcx-mps.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY="$mps/pipe" CUDA_MPS_LOG_DIRECTORY="$mps/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    sleep 1
    for c in 8 32; do
      try "MPS, lower copier, $c queues" env CUDA_DEVICE_MAX_CONNECTIONS=$c FLAGCX_P2P_IPC_COPIER=lower \
        "$perf" -t sendrecv -b 8 -e 4K -f 8 -n 300 -w 10 --blocking -c
    done
    echo quit | nvidia-cuda-mps-control
    sleep 1
  else
    echo "MPS: the control daemon did not start here; its rows did not run"
  fi
  rm -rf "$mps"
fi
