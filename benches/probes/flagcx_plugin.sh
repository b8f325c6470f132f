#!/bin/bash
# FlagCX's own PyTorch plugin over our libflagcx, as its users run it: the plugin built from a
# FlagCX checkout against our flagcx.h and libflagcx, then flagcx_plugin.py on two CUDA ranks of
# one GPU (every op the plugin maps, four rounds, segments freed between them).
#
#   benches/probes/flagcx_plugin.sh FLAGCX_CHECKOUT BUNDLE [PYTHON]
#
# FLAGCX_CHECKOUT: a FlagCX source tree (github.com/FlagOpen/FlagCX; its plugin/torch is used
# unchanged, except that a plugin older than API 0.13 passes &handler->uniqueId to
# flagcxGetUniqueId, which 0.13 takes by value: that one call is adapted). BUNDLE: the folder
# `cargo xtask bundle --vendor cuda` made (its lib/libflagcx.so.0 and capi/flagcx.h). PYTHON:
# one with torch and CUDA (default /opt/torch/.venv/bin/python). Needs the CUDA toolkit's
# headers and a C++ compiler. Exit status 0 when both ranks got every byte right.
# FLAGCX_PLUGIN_WORK: a folder to build in and keep; a later run with the same folder skips
# the build (repeated runs of one bundle).
set -u
src=$1 bundle=$(cd "$2" && pwd) py=${3:-/opt/torch/.venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
work=${FLAGCX_PLUGIN_WORK:-$(mktemp -d)}
built=$(find "$work/plugin" -name "*.so" 2>/dev/null | head -n 1)
mkdir -p "$work/plugin" "$work/flagcx/include" "$work/build/lib"
if [ -z "$built" ]; then
cp -r "$src/plugin/torch" "$work/plugin/"
cp "$bundle/capi/flagcx.h" "$work/flagcx/include/"
cp "$bundle/lib/libflagcx.so.0" "$work/build/lib/"
ln -s libflagcx.so.0 "$work/build/lib/libflagcx.so"
sed -i 's/flagcxGetUniqueId(&handler_->uniqueId)/flagcxGetUniqueId(handler_->uniqueId)/' \
  "$work/plugin/torch/flagcx/src/backend_flagcx.cpp"
cuda=${CUDA_HOME:-/usr/local/cuda}
(cd "$work/plugin/torch" && LIBRARY_PATH="$cuda/lib64/stubs:$cuda/lib64" "$py" setup.py build_ext --inplace > "$work/build.log" 2>&1) ||
  { echo "the plugin did not build (log: $work/build.log)"; grep -m5 error "$work/build.log"; exit 1; }
fi
export PYTHONPATH="$work/plugin/torch" FLAGCX_VENDOR=cuda FLAGCX_DEVICE=0 WORLD_SIZE=2 \
  MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29533} FLAGCX_TIMEOUT_MS=${FLAGCX_TIMEOUT_MS:-20000}
RANK=0 timeout 120 "$py" "$here/flagcx_plugin.py" > "$work/rank0.log" 2>&1 & a=$!
RANK=1 timeout 120 "$py" "$here/flagcx_plugin.py" > "$work/rank1.log" 2>&1 & b=$!
wait $a; ra=$?; wait $b; rb=$?
for r in 0 1; do
  echo "rank $r: $(grep -cE ': ok$' "$work/rank$r.log") ops ok; $(tail -n 1 "$work/rank$r.log")"
  grep -E 'WRONG|ERROR' "$work/rank$r.log" | head -5
done
[ -n "${OUT:-}" ] && cp "$work"/rank*.log "$OUT/" 2>/dev/null
[ $ra -eq 0 ] && [ $rb -eq 0 ]
