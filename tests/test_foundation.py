"""Foundation: context init/close, windows, barrier, ring exchange, errors, leaks; every process layout.

The checks live in tests/workers/foundation_check.py (platform-agnostic); here we run it as one process
with 4 CPU devices, as 2 and 4 processes, as 2 processes x 2 devices, and on GPUs when present.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "foundation_check.py")


def _assert_all_pass(results):
    for r, res in enumerate(results):
        failed = [k for k, v in res["checks"].items() if not v]
        assert not failed, f"rank {r}: failed checks {failed}"
        assert res["checks"], "no checks ran"


def _run_single(extra_args=(), env=None, timeout=600):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run([sys.executable, WORKER, *extra_args], capture_output=True, text=True, timeout=timeout,
                       env=e, cwd=str(REPO_ROOT))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return [json.loads(lines[-1][7:])]


def test_one_process_four_cpu_devices():
    res = _run_single(["--platform", "cpu", "--cpu-devices", "4"], env={"JAX_PLATFORMS": "cpu"})
    _assert_all_pass(res)
    assert res[0]["devices"] == 4
    # The single-process run also proves timeouts name op, rank and peer, and recovery afterwards.
    assert "timeout_names_op_rank_peer" in res[0]["checks"]


@pytest.mark.parametrize("nproc,ndev", [(2, 1), (4, 1), (2, 2)])
def test_multi_process_cpu(launch, nproc, ndev):
    res = launch(nproc, WORKER, args=("--cycles", "5"), platform="cpu", devices_per_process=ndev, timeout=600)
    assert len(res) == nproc
    _assert_all_pass(res)
    assert all(r["devices"] == nproc * ndev and r["processes"] == nproc for r in res)


@pytest.mark.parametrize("devices", [4, 1])
def test_diagnosis(devices):
    p = subprocess.run([sys.executable, "-m", "jax_engram.diagnose", "--platform", "cpu", "--cpu-devices",
                        str(devices)], capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT),
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for needle in ("jax_engram diagnosis", "barrier round trip", "ring exchange (device segment)  PASS",
                   "RESULT: PASS", f" {devices} total, {devices} local"):
        assert needle in p.stdout, f"missing {needle!r} in:\n{p.stdout}"


@pytest.mark.gpu(1)
def test_one_gpu(launch):
    _assert_all_pass(launch(1, WORKER, platform="cuda", timeout=600))


@pytest.mark.gpu(2)
def test_two_gpus_one_process():
    _assert_all_pass(_run_single(["--platform", "gpu"]))


@pytest.mark.gpu(2)
def test_two_processes_one_gpu_each(launch):
    _assert_all_pass(launch(2, WORKER, args=("--cycles", "5"), platform="cuda", timeout=600))
