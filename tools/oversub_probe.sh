#!/usr/bin/env bash
# GPU machine: build, then short oversubscribed runs (several ranks on one GPU) with timings; logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
PY="${PY:-python3}"
t0=$(date +%s)
JAX_ENGRAM_CUDA=ON $PY -m pip install -e . --no-build-isolation --no-deps > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
run() {  # name timeout cmd...
  local name=$1 to=$2; shift 2; local s=$(date +%s)
  timeout "$to" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s )) s"; grep -E "SUMMARY|FAIL|Error|error:" "$OUT/$name.log" | grep -v "^\[rank [1-9]" | head -8
}
for spec in "$@"; do
  IFS=, read -r name to R what <<< "$spec"
  case "$what" in
    found) run "$name" "$to" $PY -m jax_engram.launch -n "$R" --gpus 1 --platform cuda --timeout "$to" tests/workers/gpu_foundation_check.py ;;
    epq) run "$name" "$to" $PY -m jax_engram.launch -n "$R" --gpus 1 --platform cuda --timeout "$to" tests/workers/ep_check.py --suite quick ;;
    epc) run "$name" "$to" $PY -m jax_engram.launch -n "$R" --gpus 1 --platform cuda --timeout "$to" tests/workers/ep_check.py --suite cases,cache,gradne,lanes ;;
    engq) run "$name" "$to" $PY -m jax_engram.launch -n "$R" --gpus 1 --platform cuda --timeout "$to" tests/workers/engram_check.py --suite quick ;;
    engf) run "$name" "$to" $PY -m jax_engram.launch -n "$R" --gpus 1 --platform cuda --timeout "$to" tests/workers/engram_check.py --suite full ;;
    pytest) run "$name" "$to" $PY -m pytest -q -rA -x $R ;;
  esac
done
echo "total $(( $(date +%s) - t0 )) s"
