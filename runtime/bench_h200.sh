#!/usr/bin/env bash
# One device call: the CUDA tests of the runtime, then eval.speedup at full-size random shapes.
# Usage (from the repo root, outputs under $OUT): bash runtime/bench_h200.sh [qwen3_8b] [qwen3_5_9b] [tests]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
for what in "$@"; do
  case $what in
    tests)
      # kernels: their CUDA half runs here; graphs: all; engine: the cuda-marked ones
      timeout 180 python -m pytest -q -p no:cacheprovider tests/test_runtime_kernels.py tests/test_runtime_attention.py tests/test_runtime_graphs.py \
        2>&1 | tail -25 | tee "$OUT/tests.log"
      timeout 120 python -m pytest -q -p no:cacheprovider -m cuda tests/test_runtime_engine.py 2>&1 | tail -15 \
        | tee -a "$OUT/tests.log" ;;
    *)
      timeout "${BENCH_TIMEOUT:-240}" python -m eval.speedup "shape=$what" "paths.output_dir=$OUT/$what" \
        hydra.output_subdir=null hydra/job_logging=none hydra/hydra_logging=none ${BENCH_ARGS:-} 2>&1 \
        | grep -v "timed generations" | tee "$OUT/$what.log" ;;
  esac
done
