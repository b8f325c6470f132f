#!/bin/sh
# Copied into the GPU bundle by `cargo xtask bundle`: the open issues' targets that need one
# rank per GPU (#17, #19, #23), measured in one go on a node with two or more GPUs, every byte
# checked. Full logs and JSON rows in $FLAGCX_BUNDLE_LOGS/targets; the verdict table is last
# (targets.py). Exit status: 0 when every run completed (whatever the verdicts), 1 when one
# failed, 2 when the node has fewer than two GPUs (TARGETS_ANY_NODE=1 runs anyway, as a trial).
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}/targets
mkdir -p "$logs"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${gpus:-0}" -lt 2 ]; then
  if [ "${TARGETS_ANY_NODE:-0}" != 1 ]; then
    echo "skipped: the targets are for one rank per GPU; this node has ${gpus:-0} GPU(s)"
    exit 2
  fi
  # A trial of the script itself: the ranks share a GPU, NCCL refuses that (its rows say n/a).
  echo "TARGETS_ANY_NODE=1: running on ${gpus:-0} GPU(s); these are not the targets' placement"
fi
# NVIDIA's OpenCL platform for the CUDA<->OpenCL rows (its ICD may not be registered).
. "$here/nvidia-icd.sh"
export OCL_ICD_VENDORS="$icd"
perf="$here/bin/flagcx-perf"
failed=0
# run NAME COMMAND...: flagcx-perf's table in NAME.log, its rows in NAME.json.
run() {
  name=$1; shift
  echo "== $name: $*"
  if "$@" --json-file "$logs/$name.json" > "$logs/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED"; tail -n 5 "$logs/$name.log"; failed=1; fi
}
# #19 (and the point-to-point it rests on): ours next to NCCL, same buffers, stream and timing.
for t in sendrecv allgather alltoall broadcast; do
  run nccl-$t env FLAGCX_VENDOR=cuda "$perf" -t $t -b 8 -e 1G -f 4 -n 20 -w 5 -c --vs-nccl
done
# Broadcast in place: the root makes no local copy beside its transfer. Out of place it was
# 0.75-0.91 of NCCL from 16 MiB in the first run, where sendrecv was 1.22-1.25: if this row is
# at sendrecv's rate, the root's copy into its own buffer is what slows the other.
run bcast-inplace env FLAGCX_VENDOR=cuda "$perf" -t broadcast --in-place -b 16M -e 1G -f 4 -n 20 -w 5 -c
# Out of place again, rooted at rank 1: its proxy pushes with GPU 1's copy engines beside the
# root's local copy on GPU 1 (as rank 0 did above); then with the lower rank copying both
# ways, so GPU 0's engines pull the message and GPU 1's do only the local copy. Faster here
# than the row above: the two copies of one GPU queue behind each other.
run bcast-root1 env FLAGCX_VENDOR=cuda "$perf" -t broadcast -r 1 -b 16M -e 1G -f 4 -n 20 -w 5 -c --vs-nccl
run bcast-root1-pull env FLAGCX_P2P_IPC_COPIER=lower FLAGCX_VENDOR=cuda "$perf" -t broadcast -r 1 -b 16M -e 1G -f 4 -n 20 -w 5 -c --vs-nccl
# The copies on the SMs instead of the copy engines (FLAGCX_CUDA_COPY_KERNEL): only the
# root's local copy (local), then every copy, the transfers over NVLink too (all).
run bcast-copy-kernel env FLAGCX_CUDA_COPY_KERNEL=local FLAGCX_VENDOR=cuda "$perf" -t broadcast -b 16M -e 1G -f 4 -n 20 -w 5 -c --vs-nccl
for t in sendrecv broadcast; do
  run copy-kernel-all-$t env FLAGCX_CUDA_COPY_KERNEL=all FLAGCX_VENDOR=cuda "$perf" -t $t -b 1M -e 1G -f 4 -n 20 -w 5 -c --vs-nccl
done
# Small messages stream-ordered (FLAGCX_P2P_STREAM=on: no host thread on a message's path),
# off by default until measured here; the first two-GPU run left the default paths at 25-35
# us per call below 16 MiB where NCCL took 10-13.
for t in sendrecv alltoall allgather broadcast; do
  run stream-$t env FLAGCX_P2P_STREAM=on FLAGCX_VENDOR=cuda "$perf" -t $t -b 8 -e 16M -f 4 -n 20 -w 5 -c --vs-nccl
done
# Late copies (FLAGCX_P2P_LATE_COPY=on; by default only where streams share one queue): the
# second rank to post copies on its stream, one device copy at every size, no host thread and no
# event on a message's path. Measured on the host vendor only so far.
for t in sendrecv alltoall allgather; do
  run late-$t env FLAGCX_P2P_LATE_COPY=on FLAGCX_VENDOR=cuda "$perf" -t $t -b 8 -e 1G -f 8 -n 20 -w 5 -c --vs-nccl
done
# #17: staged CUDA<->CUDA, and a CUDA rank next to an OpenCL rank on the other GPU.
run staged-pingpong env FLAGCX_VENDOR=cuda "$perf" -t pingpong --transport staged -b 64M -e 1G -f 2 -n 10 -w 3 -c
# Smaller chunks (4 MiB at 64 MiB) shorten the pipeline's fill and drain; on one GPU they gained
# 0.03 at 64 MiB under MPS and lost at 8 MiB (git show 7ff18bc:docs/performance.md, seventh sitting).
run staged-pingpong-split16 env FLAGCX_VENDOR=cuda FLAGCX_P2P_SPLIT=16 "$perf" -t pingpong --transport staged -b 64M -e 1G -f 2 -n 10 -w 3 -c
# By default the pair's ring lives on the OpenCL rank's GPU (the CUDA rank's copies cross the
# link into it: FLAGCX_P2P_DEVICE_RING, never run on two GPUs before); the host ring beside it.
run ocl-pingpong env FLAGCX_DEBUG=info "$perf" -t pingpong --vendors cuda,opencl -b 8M -e 1G -f 2 -n 10 -w 3 -c
run ocl-pingpong-hostring env FLAGCX_P2P_DEVICE_RING=off "$perf" -t pingpong --vendors cuda,opencl -b 8M -e 1G -f 2 -n 10 -w 3 -c
echo "   device ring lines in ocl-pingpong: $(grep -c 'device memory' "$logs/ocl-pingpong.log"); not placed: $(grep -m1 -o 'no device ring for rank [0-9]* ([^)]*)' "$logs/ocl-pingpong.log")"
run ocl-small "$perf" -t sendrecv --vendors cuda,opencl -b 8 -e 8 -n 300 -w 30 -c
# #19: mixed jobs against the same pair's point-to-point.
for v in cuda,host cuda,opencl; do
  for t in sendrecv allgather alltoall broadcast; do
    # Warm-ups long enough for a host rank's buffers to be registered (~0.5 ms per MiB).
    run mixed-$(echo $v | tr , -)-$t "$perf" -t $t --vendors $v -b 64M -e 1G -f 4 -n 10 -w 30 -c
  done
done
# #23: kernels driving a port channel between the two GPUs (the shipped PTX where no nvcc).
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
ptx=
if [ -x "$nvcc" ] && "$nvcc" -ptx -arch=compute_75 -I "$here/port" -o "$logs/port_kernels.ptx" "$here/port/port_kernels.cu"; then
  ptx="$logs/port_kernels.ptx"
fi
echo "== port: two ranks, one per GPU"
if "$here/bin/flagcx-run" -n 2 -- "$here/bin/port_pingpong" $ptx > "$logs/port.log" 2>&1; then echo "   ok"; else echo "   FAILED"; tail -n 5 "$logs/port.log"; failed=1; fi
python3 "$here/targets.py" "$logs" || failed=1
exit $failed
