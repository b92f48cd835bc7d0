#!/usr/bin/env bash
# The device calls of a GPU session, each inside one 10-minute call, in this order (the tuned winners
# live in the machine's user DB, /tmp/kg-cache/tuning.db, so the calls must follow each other while it
# stays warm; each tuning call also returns them as $OUT/winners.db):
#   source .device/with-site.sh && PART=tests bash tools/gpu_session.sh   # GPU tests (both backends)
#   source .device/with-site.sh && PART=tune bash tools/gpu_session.sh    # tune a32k, b, c, c_dense; TPE vs grid on b
#   source .device/with-site.sh && PART=bench bash tools/gpu_session.sh   # benchmark with the anchors + overhead
set -u
OUT=${OUT:-/tmp/out}
PART=${PART:-tests}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=/tmp/kg-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null
if [ "$PART" = tests ]; then
  echo "== GPU tests (Triton and TileLang files in two processes: compiles overlap)"
  T=${TEST_TIMEOUT:-200}
  timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tilelang_fwd.py > "$OUT/gpu_tests_tilelang.log" 2>&1 &
  timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_fwd.py > "$OUT/gpu_tests_triton.log" 2>&1
  wait
  for f in "$OUT"/gpu_tests_*.log; do echo "-- $f"; grep -E "passed|failed|error|FAILED|Error" "$f" | tail -12; done
fi
if [ "$PART" = tune ]; then
  timeout ${TUNE_TIMEOUT:-560} python3 tools/tune_benchmarks.py --shapes a32k,b,c,c_dense --compare \
    2>&1 | tee "$OUT/tune.log" | grep -v "^$"
fi
if [ "$PART" = bench ]; then
  echo "== bench (rows also appended to $OUT/bench.jsonl as measured)"
  timeout ${BENCH_TIMEOUT:-470} python3 -m kernelgen.bench --out "$OUT" --overhead "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^$"
fi
