#!/bin/sh
# Copied into the GPU bundle by `cargo xtask bundle`: the job of p2p's
# `threads_with_a_communicator_each` (two ranks on one GPU, a second communicator each, one
# thread per communicator and direction posting at once, streams joined) run RUNS times per
# setting. On an H100 it stopped in 4-6 of 40-60 runs (rank 0's proxy waiting for CUDA's
# process-wide lock, held by a cuMemFree of the test's own thread: 2026-12-05,
# git show 7ff18bc:docs/performance.md, "Two communicators per rank on CUDA"); since the test frees only between
# runs, every run should pass. Each rank that runs past STACKS_MS prints every thread's frames
# (tests/common/stacks.rs); the first failing run's frames are shown, its whole log kept under
# $logs (FLAGCX_BUNDLE_LOGS=$OUT/logs brings it back from the device tool). One GPU suffices.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}/hang
mkdir -p "$logs"
runs=${RUNS:-40}
stacks_ms=${STACKS_MS:-3000}
vendor=${FLAGCX_P2P_TEST_VENDORS:-cuda}
shown=0
one() {
  timeout 40 env FLAGCX_TEST_SCENARIO=threads_comms FLAGCX_TEST_MARKER="/tmp/flagcx-hang-$$" \
    FLAGCX_TEST_STACKS="$stacks_ms" "$@" "$here/bin/flagcx-run" -n 2 --vendors "$vendor" \
    --timeout 35 -- sh -c 'export FLAGCX_TIMEOUT_MS=$((8000 + 8000 * FLAGCX_RANK)); exec "$@"' \
    sh "$here/bin/flagcx-p2p" --exact rank_worker --ignored --nocapture --test-threads=1
}
# setting LABEL ENV...: RUNS runs, one line.
setting() {
  label=$1; shift
  failed=0
  for i in $(seq 1 "$runs"); do
    if ! one "$@" > "$logs/run.log" 2>&1; then
      failed=$((failed + 1))
      if [ $shown -eq 0 ]; then
        shown=1
        cp "$logs/run.log" "$logs/first-failure-$label.log"
        echo "--- $label, run $i: why, and the frames of both ranks' threads (not the host vendor's stream workers)"
        grep -m3 -E 'took no step|Timeout' "$logs/run.log" | cut -c1-220
        for r in 0 1; do
          awk -v r="[$r]" 'index($0, r " == thread") == 1 {keep = ($0 !~ /flagcx-host-str|test-stacks|cuda-EvtHandlr/)}
            keep && index($0, r) == 1' "$logs/run.log" | grep -vE '^\[[01]\] +at ' | cut -c1-160 | head -150
        done
        echo "---"
      fi
    fi
  done
  printf '%-40s %d of %d runs failed\n' "$label" "$failed" "$runs"
}
setting default
setting ipc-caller-off FLAGCX_P2P_IPC_CALLER=off
setting eager-off FLAGCX_P2P_EAGER_MAX=0
setting join-none FLAGCX_STREAM_JOIN=none
setting copier-sender FLAGCX_P2P_IPC_COPIER=sender
