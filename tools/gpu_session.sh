#!/usr/bin/env bash
# One device call: GPU tests (both backends), then the benchmark with the anchors.
# Usage on the GPU machine:  source .device/with-site.sh && bash tools/gpu_session.sh [bench args...]
# Knobs: SKIP_TESTS=1, BENCH_TIMEOUT (s), TL_TIMEOUT (s). Tuning: python3 tools/tune_benchmarks.py
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=/tmp/kg-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 240 python3 -m pytest -q -m gpu --maxfail=4 tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "== bench"
timeout ${BENCH_TIMEOUT:-330} python3 -m kernelgen.bench --out "$OUT" --overhead "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^$"
