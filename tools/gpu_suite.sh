#!/usr/bin/env bash
# Build and check jax_engram on the GPU machine in one call; logs under $OUT (or ./gpu_out).
#   bash tools/gpu_suite.sh [foundation|foundation_gpu|engram|engram_1gpu|engram_gather|ep|scaleout|reliability|probe|probe_engram|probe_reduce|bench_engram|bench_engram_overlap|bench_engram_sizes|bench_model|bench_model_bf16|bench_ep|bench_ep_fair|peer_deepep]...
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
      timeout 300 $PY tests/workers/engram_check.py --platform cuda --suite full > "$OUT/engram_1p.log" 2>&1
      log "engram_check 1 process x 2 GPUs rc=$?"; grep -E "FAIL|SUMMARY|passed" "$OUT/engram_1p.log" | head -20 | tee -a "$OUT/summary.txt"
      timeout 300 $PY -m jax_engram.launch -n 2 --platform cuda tests/workers/engram_check.py --suite full > "$OUT/engram_2p.log" 2>&1
      log "engram_check 2 processes rc=$?"; grep -E "FAIL|SUMMARY|passed" "$OUT/engram_2p.log" | head -20 | tee -a "$OUT/summary.txt" ;;
    ep)
      timeout 400 $PY tests/workers/ep_check.py --platform gpu --suite full > "$OUT/ep_1p.log" 2>&1
      log "ep_check 1 process x 2 GPUs rc=$?"; grep -E "FAIL|SUMMARY|passed" "$OUT/ep_1p.log" | head -30 | tee -a "$OUT/summary.txt"
      timeout 400 $PY -m jax_engram.launch -n 2 --platform cuda tests/workers/ep_check.py --suite full > "$OUT/ep_2p.log" 2>&1
      log "ep_check 2 processes rc=$?"; grep -E "FAIL|SUMMARY|passed" "$OUT/ep_2p.log" | head -30 | tee -a "$OUT/summary.txt" ;;
    foundation_gpu)
      timeout 400 $PY -m pytest -q -rs tests/test_foundation.py -k gpu > "$OUT/foundation.log" 2>&1
      log "foundation GPU pytest rc=$?"; tail -4 "$OUT/foundation.log" | tee -a "$OUT/summary.txt" ;;
    probe)
      nvcc -O3 -std=c++17 -arch=sm_90a -o "$OUT/probe_nvlink" benchmarks/probe_nvlink.cu > "$OUT/probe.log" 2>&1 &&
        timeout 240 "$OUT/probe_nvlink" 256 >> "$OUT/probe.log" 2>&1
      log "probe_nvlink rc=$?"; cat "$OUT/probe.log"; rm -f "$OUT/probe_nvlink" ;;
    probe_engram)  # the Engram gather variants only (cudaMalloc vs cuMem tables, 1 GiB vs 128 MiB of rows)
      nvcc -O3 -std=c++17 -arch=sm_90a -o "$OUT/probe_nvlink" benchmarks/probe_nvlink.cu > "$OUT/probe_engram.log" 2>&1 &&
        timeout 120 "$OUT/probe_nvlink" 256 engram >> "$OUT/probe_engram.log" 2>&1
      log "probe_nvlink engram rc=$?"; cat "$OUT/probe_engram.log"; rm -f "$OUT/probe_nvlink" ;;
    probe_reduce)  # combine's source-side sum on one GPU: register loads vs the cp.async ring, by CTA count
      nvcc -O3 -std=c++17 -arch=sm_90a -o "$OUT/probe_reduce" benchmarks/probe_reduce.cu > "$OUT/probe_reduce.log" 2>&1 &&
        timeout 120 "$OUT/probe_reduce" >> "$OUT/probe_reduce.log" 2>&1
      log "probe_reduce rc=$?"; cat "$OUT/probe_reduce.log"; rm -f "$OUT/probe_reduce" ;;
    engram_1gpu)  # the Engram checks on one GPU
      CUDA_VISIBLE_DEVICES=0 timeout 300 $PY tests/workers/engram_check.py --platform cuda --suite full > "$OUT/engram_1gpu.log" 2>&1
      log "engram_check 1 GPU rc=$?"; grep -E "FAIL|SUMMARY" "$OUT/engram_1gpu.log" | head -20 | tee -a "$OUT/summary.txt" ;;
    engram_gather)  # issue 20 on one GPU: the Engram checks with every gather on the bulk-copy path, then the default
      CUDA_VISIBLE_DEVICES=0 JAX_ENGRAM_ENGRAM_TRACE=1 timeout 300 $PY tests/workers/engram_check.py --platform cuda --suite full --gather tma --num-sms 2 > "$OUT/engram_tma.log" 2>&1
      log "engram_check 1 GPU --gather tma rc=$?"; grep -E "FAIL|SUMMARY" "$OUT/engram_tma.log" | head -20 | tee -a "$OUT/summary.txt"
      grep -m3 "jax_engram engram fetch" "$OUT/engram_tma.log" | tee -a "$OUT/summary.txt"
      CUDA_VISIBLE_DEVICES=0 timeout 300 $PY tests/workers/engram_check.py --platform cuda --suite full > "$OUT/engram_default.log" 2>&1
      log "engram_check 1 GPU default config rc=$?"; grep -E "FAIL|SUMMARY" "$OUT/engram_default.log" | head -20 | tee -a "$OUT/summary.txt" ;;
    scaleout)  # issue 23 on 1-2 GPUs: the (node, gpu) path at 1 x 1, 2 x 1 (also on NCCL's network transport) and
               # 1 x 2, bit-exact; then the benchmark (hierarchical vs flat, inter-node leg vs bare collectives)
      timeout 900 $PY -m pytest -q -rA tests/test_scaleout.py -k "one_gpu or two_gpus" > "$OUT/scaleout.log" 2>&1
      log "scaleout pytest rc=$?"; grep -E "^PASSED|^FAILED|^SKIPPED|passed|failed" "$OUT/scaleout.log" | tail -8 | tee -a "$OUT/summary.txt"
      timeout 300 $PY benchmarks/bench_scaleout.py --out "$OUT/bench_scaleout.json" > "$OUT/bench_scaleout.log" 2>&1
      log "bench_scaleout rc=$?"; grep -E "hier/flat|ragged" "$OUT/bench_scaleout.log" | tee -a "$OUT/summary.txt" ;;
    reliability)  # issue 19 on one GPU (ranks sharing it): checked/routing errors, leaks, the fault cases, NCCL init expiry
      timeout 300 $PY -m pytest -q -rA -s tests/test_reliability.py -k gpu > "$OUT/reliability.log" 2>&1
      log "reliability pytest rc=$?"; grep -E "^PASSED|^FAILED|passed|failed|ERROR_AFTER" "$OUT/reliability.log" | cut -c1-300 | tail -14 | tee -a "$OUT/summary.txt" ;;
    bench_engram_overlap)  # issue 20's table on one GPU, host placement
      CUDA_VISIBLE_DEVICES=0 timeout 420 $PY benchmarks/bench_engram.py --overlap --out "$OUT/bench_engram_overlap.json" > "$OUT/bench_engram_overlap.log" 2>&1
      log "bench_engram --overlap rc=$?"; sed -n '/^Engram fetch beside/,$p' "$OUT/bench_engram_overlap.log" | head -80 ;;
    bench_model)  # issue 27 goal 1 on one GPU: 16-layer step, Engram at 1 and 14, FP8 rows, 2 x 24 GiB host tables,
                  # T 4096 and 512, forward and training, every variant (~5 min with the fill); the table last
      mkdir -p "$OUT/bench_model"
      CUDA_VISIBLE_DEVICES=0 timeout 470 $PY benchmarks/bench_model.py --out "$OUT/bench_model/model.json" > "$OUT/bench_model.log" 2>&1
      log "bench_model rc=$?"; grep -E "^# |ceiling" "$OUT/bench_model.log" | tee -a "$OUT/summary.txt"
      $PY -m jax_engram.bench --replot "$OUT/bench_model" --out-dir "$OUT/bench_model" > /dev/null 2>&1  # the plots
      sed -n '/^Engram in a model step/,$p' "$OUT/bench_model.log" | grep . || tail -30 "$OUT/bench_model.log" ;;
    bench_model_bf16)  # the same with bf16 rows (256 B), fewer timed steps
      mkdir -p "$OUT/bench_model_bf16"
      CUDA_VISIBLE_DEVICES=0 timeout 470 $PY benchmarks/bench_model.py --row-dtype bf16 --quick --out "$OUT/bench_model_bf16/model.json" > "$OUT/bench_model_bf16.log" 2>&1
      log "bench_model bf16 rc=$?"; sed -n '/^Engram in a model step/,$p' "$OUT/bench_model_bf16.log" | grep . || tail -30 "$OUT/bench_model_bf16.log" ;;
    bench_engram_sizes)  # issue 27 goals 2, 3, 5, 6 on one GPU: host table 0.125..48 GiB with the same run's ceilings,
                         # the host gather in 1/2/4 processes, the host paths beside a cuBLAS GEMM, device lookup vs take
      CUDA_VISIBLE_DEVICES=0 timeout 240 $PY benchmarks/bench_engram.py --sizes --procs 1,2,4 --iters 5 --out "$OUT/bench_engram_sizes.json" > "$OUT/bench_engram_sizes.log" 2>&1
      log "bench_engram --sizes --procs rc=$?"
      CUDA_VISIBLE_DEVICES=0 timeout 120 $PY benchmarks/bench_engram.py --overlap --host-paths cpu,gpu --x-kinds gemm --no-baselines --rows-per-rank 16777216 --iters 5 --out "$OUT/bench_engram_cublas.json" > "$OUT/bench_engram_cublas.log" 2>&1
      log "bench_engram --overlap --host-paths rc=$?"
      CUDA_VISIBLE_DEVICES=0 timeout 90 $PY benchmarks/bench_engram.py --deepep-only --placements device --no-overlap --out "$OUT/bench_engram_deepep.json" > "$OUT/bench_engram_deepep.log" 2>&1
      log "bench_engram --deepep-only (device, one rank) rc=$?"
      grep -E "X=gemm|note|goal 5" "$OUT/bench_engram_cublas.log" "$OUT/bench_engram_deepep.log" | tee -a "$OUT/summary.txt"
      sed -n '/^Engram host fetch by table size/,$p' "$OUT/bench_engram_sizes.log" ;;
    bench_engram)
      timeout 400 $PY benchmarks/bench_engram.py --out "$OUT/bench_engram.json" > "$OUT/bench_engram.log" 2>&1
      log "bench_engram rc=$?"; tail -40 "$OUT/bench_engram.log" ;;
    bench_ep)
      timeout 560 $PY benchmarks/bench_ep.py --out "$OUT/bench_ep.json" > "$OUT/bench_ep.log" 2>&1
      log "bench_ep rc=$?"; tail -40 "$OUT/bench_ep.log" ;;
    bench_ep_fair)  # the like-for-like run: baselines per dtype on our inputs, dedup baselines, the same loops as
                    # ours, every row checked, XLA's ragged all-to-all device kernel as one more baseline
      timeout 575 $PY benchmarks/bench_ep.py --loop 30 --iters 4 --sm-sweep 32 --baseline-iters 3 --baseline-max-s 1 \
        --ragged-device-kernel --out "$OUT/bench_ep.json" > "$OUT/bench_ep.log" 2>&1
      log "bench_ep (like-for-like) rc=$?"
      grep -E "ceiling|baseline|correctness|all-reduce" "$OUT/bench_ep.log" | cut -c1-400 | tee -a "$OUT/summary.txt"
      sed -n '/^EP dispatch\/combine/,$p' "$OUT/bench_ep.log" ;;
    peer_deepep)  # DeepEP's V1 intranode Buffer at our configuration (needs carry [".peers/DeepEP"]: tools/peer_deepep.sh)
      PEER_LOG_DIR="$OUT/peer_deepep" timeout 590 bash tools/peer_deepep.sh > "$OUT/peer_deepep.log" 2>&1
      log "peer_deepep rc=$?"; grep -E "^peer deepep" "$OUT/peer_deepep.log" | tee -a "$OUT/summary.txt"
      tail -5 "$OUT/peer_deepep.log" ;;
  esac
done
log "total $(( $(date +%s) - t0 )) s"
