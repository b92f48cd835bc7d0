#!/usr/bin/env bash
# One device call: GPU tests, then the benchmark (optionally with the attention-config sweep).
# Usage on the GPU machine:  source .device/with-site.sh && bash tools/gpu_session.sh [bench args...]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=/tmp/kg-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 150 python3 -m pytest -q -m gpu --maxfail=4 tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "== bench"
timeout ${BENCH_TIMEOUT:-330} python3 -m kernelgen.bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^$"
echo "== tilelang"; timeout ${TL_TIMEOUT:-240} python3 tools/tilelang_gpu_check.py 2>&1 | tee "$OUT/tilelang.log" | grep -v "^$" | tail -20
