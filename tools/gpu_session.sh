#!/usr/bin/env bash
# Maintainers: the GPU work of a release on one CUDA machine, in parts that each fit a 10-minute slot.
#   PART=tests bash tools/gpu_session.sh    every GPU test (pytest -m gpu), in $WORKERS processes, of $TESTS (default
#                                           tests/; the whole suite takes longer than one slot: run it in halves,
#                                           TESTS='tests/test_[a-k]*.py', then TESTS='tests/test_[l-z]*.py')
#   PART=fuzz  bash tools/gpu_session.sh    tools/fuzz.py's random cases on every backend for $FUZZ_MINUTES
#   PART=tune  bash tools/gpu_session.sh    kernelgen tune --preset bench (every backend, the benchmark shapes)
#   PART=chunked bash tools/gpu_session.sh  kernelgen tune of the prefill-over-a-cache roles ($CHUNKED_ROLES, default
#                                           the paged ones) at `bench --chunked`'s spec, 32k keys
#   PART=bench bash tools/gpu_session.sh    kernelgen bench with the anchors and the dispatch overhead, and $BENCH_ARGS
#                                           (another bench: OVERHEAD= BENCH_ARGS=--chunked, as it takes no --overhead)
#   PART=more  bash tools/gpu_session.sh    bench --backward, --kv-centric (fla-core from $FLA if set) and
#                                           --context-parallel
#   PART=examples bash tools/gpu_session.sh examples/quality_tiny.py, hf_llama_sparse.py and hf_packed_training.py
# Logs and results go to $OUT (default /tmp/out); the user DB a tune fills is copied there as winners.db,
# which `kernelgen db bundle $OUT/winners.db` merges into the bundled tuning_db/winners.db.
set -u
OUT=${OUT:-/tmp/out}
PART=${PART:-tests}
mkdir -p "$OUT"
export KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-/tmp/kg-cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The tree that runs is the working copy, committed or not: name its git tree beside HEAD, so that a figure is
# tied to the commit holding that tree (`git log --format='%h %T'` lists both).
tree=$(idx=$(mktemp -u); GIT_INDEX_FILE=$idx git add -A 2>/dev/null && GIT_INDEX_FILE=$idx git write-tree; rm -f "$idx")
if [ "$tree" = "$(git rev-parse 'HEAD^{tree}' 2>/dev/null)" ]; then echo "commit $(git rev-parse --short HEAD)"
else echo "tree $tree (HEAD $(git rev-parse --short HEAD 2>/dev/null), with changes not committed)"; fi
if [ "$PART" = tests ]; then
  # pytest-xdist processes share the GPU (TileLang's tests are nvcc-bound, so several overlap well)
  timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q -m gpu -n ${WORKERS:-6} -p no:cacheprovider ${TESTS:-tests} 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -vE "Warning|warn" | tail -25
  # the processes share the GPU's memory: on an 80 GB card the longest tests can run out of it side by side, so
  # the failures run once more, one at a time
  failed=$(grep '^FAILED' "$OUT/gpu_tests.log" | awk '{print $2}')
  if [ -n "$failed" ]; then
    echo "again, one process: $(echo $failed | wc -w) tests"
    (set -f; timeout ${RETRY_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider $failed) 2>&1 \
      | tee "$OUT/gpu_tests_again.log" | grep -vE "Warning|warn" | tail -15
  fi
fi
if [ "$PART" = fuzz ]; then
  python3 tools/fuzz.py --device cuda --minutes ${FUZZ_MINUTES:-5} --workers ${WORKERS:-7} --start ${FUZZ_START:-0} \
    --out "$OUT/fuzz" 2>&1 | grep -vE "Warning|Fatal"
fi
if [ "$PART" = tune ]; then
  timeout ${TUNE_TIMEOUT:-540} python3 -m kernelgen.cli tune --arch "$(python3 -c 'from kernelgen.device import current_arch; print(current_arch())')" \
    --preset bench ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log"
  cp "$KERNELGEN_CACHE_DIR/tuning.db" "$OUT/winners.db"
fi
if [ "$PART" = chunked ]; then
  ARCH=$(python3 -c 'from kernelgen.device import current_arch; print(current_arch())')
  SHAPE="--seq 32768 --head-dim 128 --kv-block 128 --gqa-group 4 --causal --top-k 16 --local 2 --sink 1"
  for role in ${CHUNKED_ROLES:-attn_paged kv_attn_paged}; do
    case $role in kv_*) SCHEDULE="--schedule kv_centric" ;; *) SCHEDULE="--q-tile 128" ;; esac
    timeout ${TUNE_TIMEOUT:-270} python3 -m kernelgen.cli tune --arch "$ARCH" $SHAPE $SCHEDULE --role $role \
      --trials ${TRIALS:-20} 2>&1 | tee -a "$OUT/tune.log" | tail -4
  done
  cp "$KERNELGEN_CACHE_DIR/tuning.db" "$OUT/winners.db"
fi
if [ "$PART" = bench ]; then
  timeout ${BENCH_TIMEOUT:-540} python3 -m kernelgen.cli bench --out "$OUT" ${OVERHEAD---overhead} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
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
  timeout ${EXAMPLE_TIMEOUT:-240} python3 examples/hf_packed_training.py --out "$OUT/hf_packed_training.json" 2>&1 \
    | tee "$OUT/hf_packed_training.log" | tail -12
fi
