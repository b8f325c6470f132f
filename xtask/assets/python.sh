#!/bin/sh
# Copied into the GPU bundle by `cargo xtask bundle`: the Python package and its torch backend
# with the GPU host's torch, used as training programs use them — torch's caching allocator,
# the legacy default stream (and a stream of the program's own), results read with .item():
# torch's every op and DDP on a CUDA rank + a CPU rank, on two CUDA ranks, and on two CUDA
# ranks under MPS where its daemon can be started. Exit status: 0 when every job passed,
# 1 when one failed; "skipped: <reason>" and 0 where no Python with torch and CUDA is found.
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${FLAGCX_BUNDLE_LOGS:-$here/logs}/python
mkdir -p "$logs"
py=${FLAGCX_BUNDLE_PYTHON:-}
for c in "$py" /opt/torch/.venv/bin/python python3; do
  if [ -n "$c" ] && "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then py=$c; break; fi
  py=
done
if [ -z "$py" ]; then echo "skipped: no Python with torch and CUDA (set FLAGCX_BUNDLE_PYTHON)"; exit 0; fi
wheel=$(ls "$here"/python/*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then echo "skipped: the bundle was built without the wheel (no maturin)"; exit 0; fi
site=$(mktemp -d)
"$py" -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$wheel" "$site"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" NO_COLOR=1
"$py" -c "import torch, flagcx; print('python', '$py', 'torch', torch.__version__, 'flagcx', flagcx.version())"
failed=0
# job NAME VENDORS TIMEOUT SCRIPT ARGS...: one job through launch.py, its output in NAME.log.
job() {
  name=$1 vendors=$2 t=$3; shift 3
  if (cd "$here/python" && FLAGCX_TIMEOUT_MS=${FLAGCX_TIMEOUT_MS:-10000} "$py" launch.py --timeout "$t" --vendors "$vendors" -- "$@" > "$logs/$name.log" 2>&1); then
    echo "   ok: $name ($vendors) $(grep -m1 -o 'losses: .*' "$logs/$name.log")"
  else
    echo "   FAILED: $name ($vendors)"; grep -v "Warning\|warn(\|return func" "$logs/$name.log" | tail -n 6; failed=1
  fi
}
for v in cuda,host cuda,cuda; do
  job "ops-$v" $v 90 torch_ranks.py ops
  job "late-peer-$v" $v 90 torch_ranks.py late_peer
  job "ddp-$v" $v 90 ddp.py --check --steps 12
  job "ddp-side-$v" $v 90 ddp.py --check --steps 12 --side-stream
done
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  if nvidia-cuda-mps-control -d; then
    job ops-mps cuda,cuda 90 torch_ranks.py ops
    job late-peer-mps cuda,cuda 90 torch_ranks.py late_peer
    job ddp-mps cuda,cuda 90 ddp.py --check --steps 12
    echo quit | nvidia-cuda-mps-control
  else
    echo "   skipped: MPS (its daemon did not start)"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  echo "   skipped: MPS (no nvidia-cuda-mps-control)"
fi
rm -rf "$site"
exit $failed
