#!/usr/bin/env bash
# Tuner checks on a GPU: the tuner and capture tests, then tuning runs whose wall time and
# per-bucket speedups are the figures of record. Results in ${MOE_OPS_RESULTS_DIR:-benchmarks/results}.
#     [SHIP=1] [SKIP_TESTS=1] bash benchmarks/gpu_tune_check.sh [model:quant ...]
# SHIP=1 writes the package's tables (moe_ops/tuned/) instead of $out/tuning.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${MOE_OPS_RESULTS_DIR:-benchmarks/results}"
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ -z "${SKIP_TESTS:-}" ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_tuning.py tests/test_tune.py \
    tests/test_gpu_capture.py > "$out/pytest_tune_gpu.log" 2>&1 || status=1
  tail -n 3 "$out/pytest_tune_gpu.log"
fi
for pair in "$@"; do
  model="${pair%%:*}"; quant="${pair##*:}"
  start=$(date +%s.%N)
  python3 -m moe_ops.tune --model "$model" --quant "$quant" ${SHIP:+--ship} \
    --cache "$out/tuning.json" --report "$out/tune_${model}_${quant}.json" \
    2> "$out/tune_${model}_${quant}.progress" || status=1
  echo "wall $(python3 -c "import time;print(round(time.time()-$start,1))") s for $model $quant"
done
exit $status
