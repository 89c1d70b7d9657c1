#!/usr/bin/env bash
# DeepEP as a peer, in the same session as bench_ep: build DeepEP's V1 intranode kernels (the `Buffer` NVLink path,
# no NVSHMEM) with the GPU machine's own PyTorch, then run, at 2 ranks and bench_ep's configuration (4096 tokens per
# rank, hidden 7168, top-8 of 256 experts, bf16 and FP8, 24 SMs):
#   1. DeepEP's own intranode test and benchmark, tests/test_intranode.py (correctness of every mode, then its
#      tuning sweep over NVL chunk sizes at 24 SMs; its GB/s count every received token, the local rank's included);
#   2. tools/peer_deepep_bench.py: the same Buffer timed as bench_ep times ours (slope of n and 3n back-to-back
#      calls), default configs, dispatch with and without `num_worst_tokens` (without it, every dispatch waits on the
#      host for the receive count), with physical GB/s (tokens from the other rank only), as bench_ep prints them.
# and prints a summary of both (the lines starting with "peer deepep:").
#
# DeepEP's source is NOT part of this repository and must never be committed. It lives in .peers/DeepEP (ignored
# through the repository's .git/info/exclude, which `prepare` writes) and is carried to the GPU machine:
#
#   here (any machine with git and the DeepEP repository or a clone of it; no network on the GPU machine):
#     bash tools/peer_deepep.sh prepare <path to a DeepEP clone or its .git directory>
#         -> .peers/DeepEP = `git archive` of DEEPEP_COMMIT below (~1.9 MB of source; no .git, no build outputs)
#   on the 2-GPU machine (the device tool's `run`, kind nvidia-h200-x2):
#     command: bash tools/peer_deepep.sh          carry: [".peers/DeepEP"]
#   The device tool sends the tracked and untracked-but-not-ignored files of the checkout plus the `carry` paths
#   (64 MiB in all, at most 8 paths): .peers/DeepEP is ignored, so it travels only when named in `carry`. Its build
#   outputs (deep_ep_cpp*.so, build/) stay there between calls to a warm machine and are reused (delete them, or
#   set PEER_REBUILD=1, to rebuild).
#
# Why this commit: 9249c25 is DeepEP's last V1 tree (1.2.1, Nov 2025). Its setup.py builds without NVSHMEM when
# NVSHMEM_DIR is unset and the `nvidia.nvshmem` module cannot be found (-DDISABLE_NVSHMEM, sources runtime.cu,
# layout.cu, intranode.cu only); later trees (EPv2) link NVSHMEM and NCCL unconditionally. The GPU machine's image
# HAS the nvidia-nvshmem-cu13 wheel, so the build hides that module from setup.py (a find_spec shim below) instead
# of relying on it being absent.
#
# Environment (optional): PEER_TOKENS (4096), PEER_HIDDEN (7168), PEER_TOPK (8), PEER_EXPERTS (256), PEER_SMS (24),
# PEER_RANKS (2), PEER_SKIP_TEST=1 (skip step 1), PEER_REBUILD=1, PEER_LOG_DIR (default .peers/logs).
# NVLink multicast stays off (the machine's NCCL_NVLS_ENABLE=0 / NVSHMEM_DISABLE_NVLS=1 are kept, and set here if
# missing): DeepEP's V1 intranode path does not use it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DEEPEP_COMMIT=9249c25796320441ffd5a41293365e6d7cdc8df9
SRC="$ROOT/.peers/DeepEP"
PY="${PEER_PYTHON:-python3}"   # the GPU image's python3 is the one that holds PyTorch

if [ "${1:-run}" = prepare ]; then
  from="${2:?usage: tools/peer_deepep.sh prepare <DeepEP clone or .git dir>}"
  if [ -d "$from/.git" ]; then gitdir="$from/.git"; else gitdir="$from"; fi
  git --git-dir="$gitdir" cat-file -e "$DEEPEP_COMMIT^{commit}" \
    || { echo "peer deepep: $from does not hold commit $DEEPEP_COMMIT (fetch DeepEP's full history)" >&2; exit 2; }
  rm -rf "$SRC" && mkdir -p "$SRC"
  git --git-dir="$gitdir" archive "$DEEPEP_COMMIT" | tar -x -C "$SRC"
  echo "$DEEPEP_COMMIT" > "$SRC/.peer_commit"
  exclude="$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.peers/' "$exclude" 2>/dev/null || echo '/.peers/' >> "$exclude"
  git check-ignore -q "$SRC/setup.py" || { echo "peer deepep: .peers/ is not ignored by git" >&2; exit 2; }
  echo "peer deepep: prepared $SRC ($(du -sh "$SRC" | cut -f1)) at $DEEPEP_COMMIT, ignored via $exclude"
  echo "peer deepep: on the 2-GPU machine run 'bash tools/peer_deepep.sh' with carry [\".peers/DeepEP\"]"
  exit 0
fi

[ -f "$SRC/setup.py" ] || { echo "peer deepep: $SRC/setup.py missing: run 'bash tools/peer_deepep.sh prepare <DeepEP clone>' and carry .peers/DeepEP" >&2; exit 2; }
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
LOGS="${PEER_LOG_DIR:-$ROOT/.peers/logs}"
mkdir -p "$LOGS"
N="${PEER_TOKENS:-4096}" H="${PEER_HIDDEN:-7168}" K="${PEER_TOPK:-8}" E="${PEER_EXPERTS:-256}"
SMS="${PEER_SMS:-24}" R="${PEER_RANKS:-2}"

echo "peer deepep: commit $(cat "$SRC/.peer_commit" 2>/dev/null || echo '?'), $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'), $(nvcc --version | tail -1)"
gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
[ "$gpus" -ge "$R" ] || { echo "peer deepep: needs $R GPUs, this machine has $gpus" >&2; exit 2; }

# ---- build (in place: deep_ep_cpp*.so next to the deep_ep package) ----
if [ "${PEER_REBUILD:-0}" = 1 ]; then rm -rf "$SRC"/build "$SRC"/deep_ep_cpp*.so; fi
if ! ls "$SRC"/deep_ep_cpp*.so >/dev/null 2>&1; then
  echo "peer deepep: building the V1 intranode kernels without NVSHMEM (log: $LOGS/build.log)"
  t0=$(date +%s)
  # Two adjustments to setup.py, made from outside (DeepEP's files stay as published):
  #  * it looks for the nvidia.nvshmem module, which this image has: hide it, so that setup.py takes its
  #    DISABLE_NVSHMEM branch (sources runtime.cu, layout.cu, intranode.cu);
  #  * it compiles with -rdc=true but device-links only with NVSHMEM, so a build without NVSHMEM fails at import
  #    with "undefined symbol: __cudaRegisterLinkedBinary_..._intranode_cu" (DeepEP issue #429): drop -rdc=true
  #    when there is no device-link step (the three sources share no device symbols; they compile and link
  #    without it, checked with nvcc 13.0 for sm_90).
  (cd "$SRC" && env -u NVSHMEM_DIR TORCH_CUDA_ARCH_LIST=9.0 DISABLE_AGGRESSIVE_PTX_INSTRS=1 \
      MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" - build_ext --inplace > "$LOGS/build.log" 2>&1 <<'PYEOF'
import importlib.util, runpy, sys
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.startswith("nvidia.nvshmem") else _find_spec(name, *a, **k)
import torch.utils.cpp_extension as cpp_ext
_CUDAExtension = cpp_ext.CUDAExtension
def _no_rdc_without_dlink(*a, **k):
    args = k.get("extra_compile_args") or {}
    if isinstance(args, dict) and "nvcc_dlink" not in args:
        args["nvcc"] = [f for f in args.get("nvcc", []) if f not in ("-rdc=true", "--relocatable-device-code=true")]
        print("peer deepep shim: nvcc flags", args["nvcc"], flush=True)
    return _CUDAExtension(*a, **k)
cpp_ext.CUDAExtension = _no_rdc_without_dlink
sys.argv = ["setup.py"] + sys.argv[1:]
runpy.run_path("setup.py", run_name="__main__")
PYEOF
  ) || { echo "peer deepep: BUILD FAILED after $(( $(date +%s) - t0 )) s; the last lines of $LOGS/build.log:" >&2;
         tail -40 "$LOGS/build.log" >&2; exit 3; }
  grep -q "DISABLE_NVSHMEM" "$LOGS/build.log" || echo "peer deepep: WARNING: the build log does not show -DDISABLE_NVSHMEM" >&2
  grep "peer deepep shim" "$LOGS/build.log" || true
  echo "peer deepep: built in $(( $(date +%s) - t0 )) s: $(ls "$SRC"/deep_ep_cpp*.so)"
fi
export PYTHONPATH="$SRC:$SRC/tests${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import deep_ep; print("peer deepep: import ok, topk_idx_t", deep_ep.topk_idx_t)'

rc=0 rc2=0
# ---- 1. DeepEP's own intranode test + benchmark (defaults = our configuration; it hard-codes 24 SMs) ----
if [ "${PEER_SKIP_TEST:-0}" != 1 ]; then
  echo "peer deepep: tests/test_intranode.py --num-processes $R --num-tokens $N --hidden $H --num-topk $K --num-experts $E (log: $LOGS/test_intranode.log)"
  (cd "$SRC/tests" && timeout 300 "$PY" test_intranode.py --num-processes "$R" --num-tokens "$N" --hidden "$H" \
      --num-topk "$K" --num-experts "$E") > "$LOGS/test_intranode.log" 2>&1 || { rc=$?; echo "peer deepep: test_intranode.py exited $rc; its last lines:"; tail -25 "$LOGS/test_intranode.log"; }
  grep -E "^\[config\]|passed|Best dispatch|Best combine" "$LOGS/test_intranode.log" | sed 's/^/peer deepep: test_intranode: /' | sort -u | head -40 || true
fi

# ---- 2. the same Buffer timed like bench_ep times ours ----
echo "peer deepep: tools/peer_deepep_bench.py (log: $LOGS/bench.log)"
timeout 200 "$PY" "$ROOT/tools/peer_deepep_bench.py" --ranks "$R" --tokens "$N" --hidden "$H" --topk "$K" --experts "$E" \
    --sms "$SMS" --json "$LOGS/bench.json" > "$LOGS/bench.log" 2>&1 \
  || { rc2=$?; echo "peer deepep: peer_deepep_bench.py exited $rc2; its last lines:"; tail -25 "$LOGS/bench.log"; }
grep "^peer deepep:" "$LOGS/bench.log" || true
exit $(( rc != 0 ? rc : rc2 ))
