"""Engram table: write / fetch / wait / lookup, bit-exact against jax_engram.reference.engram_lookup.

The checks live in tests/workers/engram_check.py (platform-agnostic, one PASS/FAIL line per case); here it
runs as one process with 4 CPU devices and as 2 / 4 / 2x2 processes through the launcher, and on GPUs when
present (one GPU, one process with 2 GPUs, 2 processes with one GPU each). A tiny CPU run of the
benchmark checks that it still works end to end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "engram_check.py")
BENCH = str(REPO_ROOT / "benchmarks" / "bench_engram.py")


def _cases(suite: str) -> list[str]:
    p = subprocess.run([sys.executable, WORKER, "--platform", "cpu", "--cpu-devices", "1", "--suite", suite, "--list"],
                       capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT),
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [l for l in p.stdout.splitlines() if l and not l.startswith(("engram_check", "RESULT"))]


def _assert_all_pass(results, suite: str, ranks: int):
    want = _cases(suite)
    assert want, "no cases listed"
    for r, res in enumerate(results):
        assert not res["failed"], f"rank {r}: failed cases {json.dumps(res['failed'], indent=1)}"
        assert sorted(res["passed"]) == sorted(want), f"rank {r}: ran {res['passed']}, expected {want}"
        assert res["ranks"] == ranks, res


def _run_single(extra_args=(), env=None, timeout=600):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run([sys.executable, WORKER, *extra_args], capture_output=True, text=True, timeout=timeout,
                       env=e, cwd=str(REPO_ROOT))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return [json.loads(lines[-1][7:])]


def test_one_process_four_cpu_devices():
    res = _run_single(["--platform", "cpu", "--cpu-devices", "4", "--suite", "full"], env={"JAX_PLATFORMS": "cpu"})
    _assert_all_pass(res, "full", 4)
    assert res[0]["processes"] == 1


@pytest.mark.parametrize("nproc,ndev,suite", [(2, 1, "full"), (4, 1, "core"), (2, 2, "quick")])
def test_multi_process_cpu(launch, nproc, ndev, suite):
    res = launch(nproc, WORKER, args=("--suite", suite), platform="cpu", devices_per_process=ndev, timeout=600)
    assert len(res) == nproc
    _assert_all_pass(res, suite, nproc * ndev)
    assert all(r["processes"] == nproc for r in res)


def test_benchmark_tiny_cpu(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, BENCH, "--tiny", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=str(REPO_ROOT),
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert rows and all(r["verified"] for r in rows if r["impl"].startswith("engram")), rows
    impls = {r["impl"] for r in rows}
    for want in ("engram fetch+wait", "engram issue", "engram wait", "gspmd take", "all_to_all lookup"):
        assert want in impls, (want, impls)
    assert "config:" in p.stdout and "speedup" in p.stdout


@pytest.mark.gpu(1)
def test_one_gpu():
    _assert_all_pass(_run_single(["--platform", "cuda", "--suite", "full"], env={"CUDA_VISIBLE_DEVICES": "0"}),
                     "full", 1)


@pytest.mark.gpu(2)
def test_two_gpus_one_process():
    _assert_all_pass(_run_single(["--platform", "cuda", "--suite", "full"], env={"CUDA_VISIBLE_DEVICES": "0,1"}),
                     "full", 2)


@pytest.mark.gpu(2)
def test_two_processes_one_gpu_each(launch):
    _assert_all_pass(launch(2, WORKER, args=("--suite", "full"), platform="cuda", timeout=600), "full", 2)
