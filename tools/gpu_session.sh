#!/usr/bin/env bash
# Device calls of a GPU session: PART=tests (GPU tests, both backends, ~5 min), PART=bench (benchmark with
# the anchors and dispatch overhead, ~6 min), PART=all (both; may not fit one 10-minute call).
# Usage on the GPU machine:  source .device/with-site.sh && PART=tests bash tools/gpu_session.sh
#                            source .device/with-site.sh && PART=bench bash tools/gpu_session.sh --shapes a32k,b,c,c_dense,a128k
# Tuning (issue 3):          source .device/with-site.sh && python3 tools/tune_benchmarks.py
set -u
OUT=${OUT:-/tmp/out}
PART=${PART:-all}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=/tmp/kg-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  echo "== GPU tests"
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -m gpu --maxfail=6 tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  echo "== bench (rows also appended to $OUT/bench.jsonl as measured)"
  timeout ${BENCH_TIMEOUT:-500} python3 -m kernelgen.bench --out "$OUT" --overhead "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^$"
fi
