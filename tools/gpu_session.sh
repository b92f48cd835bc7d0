#!/usr/bin/env bash
# Maintainers: the GPU work of a release on one CUDA machine, in parts that each fit a 10-minute slot.
#   PART=tests bash tools/gpu_session.sh    every GPU test (pytest -m gpu), TileLang's in $SHARDS processes
#   PART=tune  bash tools/gpu_session.sh    kernelgen tune --preset bench (every backend, the benchmark shapes)
#   PART=bench bash tools/gpu_session.sh    kernelgen bench with the anchors and the dispatch overhead
#   PART=more  bash tools/gpu_session.sh    bench --backward, --kv-centric (fla-core from $FLA if set) and
#                                           --context-parallel
#   PART=examples bash tools/gpu_session.sh examples/quality_tiny.py and examples/hf_llama_sparse.py
# Logs and results go to $OUT (default /tmp/out); the user DB a tune fills is copied there as winners.db,
# which `kernelgen db bundle $OUT/winners.db` merges into the bundled tuning_db/winners.db.
set -u
OUT=${OUT:-/tmp/out}
PART=${PART:-tests}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-/tmp/kg-cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git rev-parse --short HEAD 2>/dev/null
# GPU tests of tests/test_$1.py in $2 pytest processes sharing the GPU (TileLang's are nvcc-bound), tests
# dealt round-robin; logs $OUT/gpu_tests_<name>_<shard>.log
gpu_tests() {
  local ids
  ids=$(python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only "tests/test_$1.py" | grep "::")
  for i in $(seq 0 $(($2 - 1))); do
    timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -m gpu -p no:cacheprovider \
      $(echo "$ids" | awk -v n=$2 -v i=$i 'NR % n == i') > "$OUT/gpu_tests_$1_$i.log" 2>&1 &
  done
}
if [ "$PART" = tests ]; then
  gpu_tests tilelang_fwd ${SHARDS:-4}
  gpu_tests triton_fwd 1
  gpu_tests gluon_fwd 2
  gpu_tests block_lists 1
  gpu_tests lookup 1
  wait
  for f in backward kv_centric kv_backward index_selector kv_index_selector decode transformers distributed; do
    gpu_tests $f 1
  done
  wait
  for f in "$OUT"/gpu_tests_*.log; do echo "-- $f"; grep -E "passed|failed|skipped|FAILED|rror" "$f" | tail -8; done
fi
if [ "$PART" = tune ]; then
  timeout ${TUNE_TIMEOUT:-540} python3 -m kernelgen.cli tune --arch "$(python3 -c 'from kernelgen.device import current_arch; print(current_arch())')" \
    --preset bench ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log"
  cp "$KERNELGEN_CACHE_DIR/tuning.db" "$OUT/winners.db"
fi
if [ "$PART" = bench ]; then
  timeout ${BENCH_TIMEOUT:-540} python3 -m kernelgen.cli bench --out "$OUT" --overhead ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
if [ "$PART" = more ]; then
  [ -n "${FLA:-}" ] && export PYTHONPATH=$FLA${PYTHONPATH:+:$PYTHONPATH}
  for what in backward kv-centric context-parallel; do
    timeout ${BENCH_TIMEOUT:-180} python3 -m kernelgen.cli bench --$what --out "$OUT" 2>&1 | tee "$OUT/bench_$what.log" \
      | grep -vE "Warning|^ *$" | tail -20
  done
fi
if [ "$PART" = examples ]; then
  timeout ${EXAMPLE_TIMEOUT:-240} python3 examples/quality_tiny.py --out "$OUT/quality" 2>&1 | tee "$OUT/quality.log" | tail -25
  timeout ${EXAMPLE_TIMEOUT:-240} python3 examples/hf_llama_sparse.py --out "$OUT/hf_llama_sparse.json" 2>&1 \
    | tee "$OUT/hf_llama_sparse.log" | tail -15
fi
