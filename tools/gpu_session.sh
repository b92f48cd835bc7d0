#!/usr/bin/env bash
# The device calls of a GPU session, each inside one 10-minute call, in this order (tuned winners live
# in the machine's user DB, /tmp/kg-cache/tuning.db, and come back as $OUT/winners.db: copy that to
# tuning_db/winners.db to bundle them, which is what a bench on a fresh machine then serves):
#   source .device/with-site.sh && PART=tune bash tools/gpu_session.sh    # GPU tests (both backends), then tune
#   source .device/with-site.sh && PART=tune-tilelang bash tools/gpu_session.sh  # tune the TileLang forward (grids)
#   source .device/with-site.sh && PART=bench bash tools/gpu_session.sh   # benchmark with the anchors + overhead
#   source .device/with-site.sh && PART=tune-gluon bash tools/gpu_session.sh     # tune the Gluon forward (grids)
#   PART=tests (every GPU test: each backend's, and the prepared-lists tests), PART=tests-tilelang (TileLang's only),
#   PART=probe (tools/tilelang_probe.py [--variants ...])
set -u
OUT=${OUT:-/tmp/out}
PART=${PART:-tune}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=/tmp/kg-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# GPU tests of tests/test_$1.py in $2 pytest processes sharing the GPU (TileLang's are nvcc-bound), tests
# dealt round-robin; logs $OUT/gpu_tests_<name>_<shard>.log
gpu_tests() {
  local ids
  ids=$(python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only "tests/test_$1.py" | grep "::")
  for i in $(seq 0 $(($2 - 1))); do
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider \
      $(echo "$ids" | awk -v n=$2 -v i=$i 'NR % n == i') > "$OUT/gpu_tests_$1_$i.log" 2>&1 &
  done
}
if [ "$PART" = tests ] || [ "$PART" = tune ] || [ "$PART" = tests-tilelang ]; then
  echo "== GPU tests (TileLang in ${SHARDS:-4} shards)"
  gpu_tests tilelang_fwd ${SHARDS:-4}
  [ "$PART" = tests-tilelang ] || gpu_tests triton_fwd 1
  [ "$PART" = tests-tilelang ] || gpu_tests gluon_fwd 2
  [ "$PART" = tests-tilelang ] || gpu_tests block_lists 1
  wait
  for f in "$OUT"/gpu_tests_*.log; do echo "-- $f"; grep -E "passed|failed|skipped|FAILED|rror" "$f" | tail -8; done
fi
if [ "$PART" = probe ]; then
  timeout ${PROBE_TIMEOUT:-330} python3 tools/tilelang_probe.py --out "$OUT" "$@" 2>&1 | grep -v "\[TileLang" | tee "$OUT/probe.log"
fi
if [ "$PART" = tune ]; then
  echo "== tune"
  timeout ${TUNE_TIMEOUT:-420} python3 tools/tune_benchmarks.py ${TUNE_ARGS:---shapes a32k,b,c,c_dense --compare} \
    2>&1 | tee "$OUT/tune.log" | grep -v "^$"
fi
if [ "$PART" = tune-tilelang ]; then
  timeout ${TUNE_TIMEOUT:-500} python3 tools/tune_benchmarks.py --shapes ${TUNE_SHAPES:-a32k,b,c,c_dense} --backends tilelang \
    --select-shapes "" 2>&1 | tee "$OUT/tune_tilelang.log" | grep -v "^$"
fi
if [ "$PART" = tune-gluon ]; then
  timeout ${TUNE_TIMEOUT:-300} python3 tools/tune_benchmarks.py --shapes ${TUNE_SHAPES:-a32k,b,c,c_dense} --backends gluon \
    --select-shapes "" 2>&1 | tee "$OUT/tune_gluon.log" | grep -v "^$"
fi
if [ "$PART" = bench ]; then
  echo "== bench (rows also appended to $OUT/bench.jsonl as measured)"
  timeout ${BENCH_TIMEOUT:-470} python3 -m kernelgen.bench --out "$OUT" --overhead "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^$"
fi
