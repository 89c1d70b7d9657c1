#!/usr/bin/env bash
# A/B of two git revisions in one machine session (diagnosis): EP configs can be compared in one process
# (tools/ep_knobs.py), code changes cannot. This builds both revisions side by side (cmake + ninja, in parallel)
# and runs the same command under each build in alternation, so that drift hits both; each run imports its own
# tree's jax_engram through PYTHONPATH (nothing is pip-installed).
#
#   bash tools/ab_builds.sh REV_A REV_B ROUNDS COMMAND...      (from the repository root)
#   e.g. bash tools/ab_builds.sh main my-branch 3 python3 tools/ep_knobs.py dispatch 4096 3 ''
# REV_A / REV_B: git revisions, or directories holding a source tree (e.g. `git archive` exports carried to a
# machine whose copy of the repository has no git history).
#
# COMMAND runs in each tree's root. Output: one line per run ("a1 ...", "b1 ...", ...) with the run's lines that
# start with SUMMARY (tools/ep_knobs.py) or RESULT; full logs under $OUT (default ./ab_out). JAX_ENGRAM_CUDA
# (default AUTO) is passed to cmake; on the GPU machine NCCL is found from the nvidia-nccl wheel.
set -uo pipefail
[ $# -ge 4 ] || { sed -n 2,12p "$0"; exit 2; }
A=$1 B=$2 ROUNDS=$3
shift 3
ROOT="$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
OUT="${OUT:-$ROOT/ab_out}"
WORK="$(mktemp -d)"
mkdir -p "$OUT"
PY="${PY:-python3}"
NB="$("$PY" -m nanobind --cmake_dir)" || { echo "ab_builds: nanobind not found for $PY" >&2; exit 1; }
NCCL_LIB="$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib")' 2>/dev/null || true)"
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

export_tree() {  # $1 = revision or source directory, $2 = destination
  if [ -d "$1" ]; then cp -r "$1/." "$2/"; else git -C "$ROOT" archive "$1" | tar -x -C "$2"; fi
}
describe() { [ -d "$1" ] && echo "$1" || echo "$1 ($(git -C "$ROOT" rev-parse --short "$1"))"; }

build() {  # $1 = a|b, $2 = revision or directory
  local dir="$WORK/$1"
  mkdir -p "$dir" && export_tree "$2" "$dir" && rm -rf "$dir/build" &&
    cmake -S "$dir" -B "$WORK/build_$1" -G Ninja -DSKBUILD_PROJECT_NAME=jax_engram -DPython_EXECUTABLE="$(command -v "$PY")" \
      -Dnanobind_DIR="$NB" -DJAX_ENGRAM_CUDA="${JAX_ENGRAM_CUDA:-AUTO}" -DCMAKE_BUILD_TYPE=Release > "$OUT/build_$1.log" 2>&1 &&
    ninja -C "$WORK/build_$1" >> "$OUT/build_$1.log" 2>&1 &&
    cp "$WORK/build_$1"/_engram_*.so "$dir/jax_engram/"
}
build a "$A" & pa=$!
build b "$B" & pb=$!
ok=1
wait $pa || ok=0
wait $pb || ok=0
[ $ok = 1 ] || { echo "ab_builds: a build failed (logs in $OUT)" >&2; tail -20 "$OUT"/build_*.log >&2; exit 1; }
echo "ab_builds: a = $(describe "$A"), b = $(describe "$B"), $ROUNDS rounds: $*"
for r in $(seq 1 "$ROUNDS"); do
  for v in a b; do
    log="$OUT/$v$r.log"
    (cd "$WORK/$v" && PYTHONPATH="$WORK/$v" "$@") > "$log" 2>&1
    rc=$?
    echo "$v$r rc=$rc $(grep -E '^(SUMMARY|RESULT)' "$log" | tr '\n' ' ')"
  done
done
rm -rf "$WORK"
