#!/usr/bin/env bash
# Build and check jax_engram on the GPU machine in one call; logs under $OUT (or ./gpu_out).
#   bash tools/gpu_suite.sh [foundation|engram|ep|bench|all]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
PY="${PY:-python3}"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
{ nvidia-smi -L; nvidia-smi topo -m; } > "$OUT/topo.txt" 2>&1
log "python: $($PY -c 'import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__, jaxlib.__version__)')"
log "nccl wheel: $($PY -c 'import nvidia.nccl as m, os; print(os.listdir(m.__path__[0] + "/lib"))' 2>&1)"
t0=$(date +%s)
JAX_ENGRAM_CUDA=ON $PY -m pip install -e . --no-build-isolation --no-deps > "$OUT/build.log" 2>&1
rc=$?; log "build rc=$rc in $(( $(date +%s) - t0 )) s"; [ $rc -ne 0 ] && { tail -50 "$OUT/build.log"; exit 1; }
grep -E "jax_engram:" "$OUT/build.log" | head -5 | tee -a "$OUT/summary.txt"
for what in "${@:-foundation}"; do
  case "$what" in
    foundation)
      timeout 300 $PY -m jax_engram > "$OUT/main.log" 2>&1; log "main job rc=$?"; tail -20 "$OUT/main.log"
      timeout 500 $PY -m pytest -q -rs tests/test_foundation.py -k "gpu or one_process_four" > "$OUT/foundation.log" 2>&1
      log "foundation pytest rc=$?"; tail -15 "$OUT/foundation.log" | tee -a "$OUT/summary.txt"
      timeout 200 $PY tests/workers/gpu_foundation_check.py > "$OUT/gpu_foundation_1p.log" 2>&1
      log "gpu_foundation_check 1 process rc=$?"; grep -E "PASS|FAIL|topology" "$OUT/gpu_foundation_1p.log" | head -30
      ;;
    engram)
      timeout 500 $PY -m pytest -q -rs tests/test_engram.py -k gpu > "$OUT/engram.log" 2>&1
      log "engram pytest rc=$?"; tail -15 "$OUT/engram.log" | tee -a "$OUT/summary.txt" ;;
    ep)
      timeout 500 $PY -m pytest -q -rs tests/test_ep.py -k gpu > "$OUT/ep.log" 2>&1
      log "ep pytest rc=$?"; tail -15 "$OUT/ep.log" | tee -a "$OUT/summary.txt" ;;
    bench_engram)
      timeout 400 $PY benchmarks/bench_engram.py --out "$OUT/bench_engram.json" > "$OUT/bench_engram.log" 2>&1
      log "bench_engram rc=$?"; tail -40 "$OUT/bench_engram.log" ;;
    bench_ep)
      timeout 400 $PY benchmarks/bench_ep.py --out "$OUT/bench_ep.json" > "$OUT/bench_ep.log" 2>&1
      log "bench_ep rc=$?"; tail -40 "$OUT/bench_ep.log" ;;
  esac
done
log "total $(( $(date +%s) - t0 )) s"
