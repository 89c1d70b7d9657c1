"""Shared pytest setup for jax_engram.

Rules for everything in this file (it is shared; append your fixtures in their own section):

* Never import ``jax`` (or ``jax_engram``, whose ``__init__`` may) at import time: in-process
  tests pick their own platform / device count, and multi-process jobs need fresh processes
  that call ``jax.distributed.initialize`` before any backend starts.  Import lazily inside
  fixtures.
* Never call ``jax.devices()`` to count GPUs here: it would grab every GPU in the pytest
  process.  Use :func:`gpu_count` (``nvidia-smi -L``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# ---------------------------------------------------------------------------------------
# Environment (before anything imports jax)
# ---------------------------------------------------------------------------------------
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several processes share GPUs
os.environ["NCCL_NVLS_ENABLE"] = "0"  # hard rule on our GPU hosts: NVLink SHARP/multicast off

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
WORKERS_DIR = TESTS_DIR / "workers"

# A source checkout that is not pip-installed is still importable (``pytest`` without
# ``python -m`` does not put the cwd on sys.path).  An installed/editable jax_engram wins.
if importlib.util.find_spec("jax_engram") is None:
    sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------------------------------
# GPU detection and the ``gpu`` marker
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """Number of NVIDIA GPUs on this host per ``nvidia-smi -L``; 0 without nvidia-smi.

    Respects ``CUDA_VISIBLE_DEVICES`` only in the trivial "hide everything" form ("" / "-1").
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _gpus_required(marker: pytest.Mark) -> int:
    if marker.args:
        return int(marker.args[0])
    return int(marker.kwargs.get("n", 1))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu(n=1): needs at least n NVIDIA GPUs (counted with nvidia-smi -L); skipped otherwise",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need, have = _gpus_required(marker), gpu_count()
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s), found {have}"))


# ---------------------------------------------------------------------------------------
# One-process workers
# ---------------------------------------------------------------------------------------
def run_worker(script: str, *args: str, timeout: float = 600) -> dict:
    """Run ``tests/workers/<script>`` in a fresh process on the CPU platform and return the dict of its last
    ``RESULT <json>`` line; the test fails, showing the output tails, if it exits non-zero or prints none."""
    import json

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, str(WORKERS_DIR / script), *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=str(REPO_ROOT))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][7:])


def assert_same_message(result: dict, case: str, needles: list[str]) -> None:
    """An args-check worker's case (``result["cases"][case]``: the message on a flat and on a ("node", "gpu")
    group): the same text on both, containing every needle."""
    got = result["cases"][case]
    assert got["flat"] == got["hier"], got
    for word in needles:
        assert word in got["flat"], (case, got["flat"])


@functools.cache
def harness():
    """``tests/workers/_harness.py`` as a module (numpy only), for tests that use the workers' helpers."""
    spec = importlib.util.spec_from_file_location("_harness", WORKERS_DIR / "_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------
# Multi-process jobs (jax_engram.launch)
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def workers_dir() -> Path:
    """``tests/workers``: scripts run as ``python <worker>.py`` by the launcher."""
    return WORKERS_DIR


@pytest.fixture
def launch(workers_dir: Path):
    """Run a multi-process jax.distributed job and return each rank's ``RESULT`` dict.

    ``launch(n, script, args=(), platform="cpu", devices_per_process=1, timeout=240, env=None)``
    -- same as :func:`jax_engram.launch.run`; a bare script name such as
    ``"hello_distributed.py"`` is looked up in ``tests/workers``.  Raises
    ``jax_engram.launch.LaunchError`` (every rank's output tail) on failure or timeout.
    Each call is a fresh set of processes; worker scripts call
    ``jax_engram.launch.initialize()`` first and end with ``emit_result(...)``.
    """
    from jax_engram.launch import run  # lazy: no jax / jax_engram import at collection

    def _launch(n: int, script: str | os.PathLike, *args, **kwargs):
        path = Path(script)
        if not path.exists() and (workers_dir / path).exists():
            path = workers_dir / path
        return run(n, str(path), *args, **kwargs)

    return _launch
