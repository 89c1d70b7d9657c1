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


# The bulk-copy gather's plan (engram_layout.h TmaPlan, tma_chunk_rows, tma_piece) through the native module's
# hooks: the CUDA kernel copies exactly these pieces, so a gap or an overlap here would leave output bytes unwritten
# or written twice. Properties: the chunks tile the output, every piece is a 16-byte-multiple run inside one row and
# one chunk, the pieces of a row cover the row once, and the plan respects its SM and shared-memory limits.
def _native():
    from jax_engram import _ffi

    return _ffi.native("cpu")


def _check_tma_plan(mod, n_rows, row_bytes, sms, budget):
    p = mod.engram_tma_plan(n_rows, row_bytes, sms, budget)
    total = n_rows * row_bytes
    C = p["chunk_bytes"]
    assert C % 16 == 0 and 1024 <= C <= 32768, p
    assert p["chunks"] == -(-total // C), p
    assert 1 <= p["grid"] <= max(sms, 1), p
    assert p["grid"] == min(max(sms, 1), max(1, -(-p["chunks"] // p["warps"]))), p
    assert p["smem_bytes"] == p["warps"] * p["stages"] * C and p["stages"] >= 2, p
    assert p["smem_bytes"] <= max(budget, 16384), p
    covered = [0] * n_rows
    for c in range(p["chunks"]):
        pieces = mod.engram_tma_pieces(c, C, row_bytes, n_rows)
        pos = 0
        for row, row_off, stage_off, length in pieces:
            assert stage_off == pos and length > 0 and length % 16 == 0 and row_off % 16 == 0, (c, pieces)
            assert c * C + stage_off == row * row_bytes + row_off, (c, row, row_off, stage_off)  # output position
            assert row_off == covered[row], (c, row, row_off, covered[row])  # the row continues where it stopped
            covered[row] += length
            pos += length
        assert pos == min(C, total - c * C), (c, pos, C, total)  # the chunk is full (the last one: the rest)
    assert covered == [row_bytes] * n_rows, "some row not covered exactly once"
    assert mod.engram_tma_pieces(p["chunks"], C, row_bytes, n_rows) == []
    return p


def test_engram_tma_plan_tiles_the_output():
    mod = _native()
    for n_rows, row_bytes in ((1, 16), (24, 256), (7, 14336), (100, 48), (3, 32768 + 16), (12288, 256)):
        for sms, budget in ((1, 16384), (4, 192 * 1024), (3, 65536), (132, 227 * 1024)):
            _check_tma_plan(mod, n_rows, row_bytes, sms, budget)
    # DeepEP's shape (512 x 24 ids, 256-byte rows) at the default config: 4 CTAs, every pipeline busy
    p = _check_tma_plan(mod, 512 * 24, 256, 4, 192 * 1024)
    assert p["grid"] == 4 and p["chunk_bytes"] == 12288 and p["chunks"] == 256, p
    # one token: a single small chunk on one CTA
    p = _check_tma_plan(mod, 24, 256, 4, 192 * 1024)
    assert p["grid"] == 2 and p["chunk_bytes"] == 1024, p


def test_engram_tma_plan_property():
    from hypothesis import given, settings, strategies as st

    mod = _native()

    @settings(max_examples=150, deadline=None)
    @given(n_rows=st.integers(1, 48), row16=st.integers(1, 600), sms=st.integers(1, 16),
           budget_kib=st.integers(16, 227))
    def run(n_rows, row16, sms, budget_kib):
        _check_tma_plan(mod, n_rows, row16 * 16, sms, budget_kib * 1024)

    run()


def test_engram_tma_eligible():
    mod = _native()
    assert mod.engram_tma_eligible(256, 0, 1 << 20)
    assert not mod.engram_tma_eligible(200, 0, 1 << 20)   # row not a multiple of 16 bytes
    assert not mod.engram_tma_eligible(256, 8, 1 << 20)   # table offset
    assert not mod.engram_tma_eligible(256, 0, (1 << 20) + 8)  # output address


def test_benchmark_overlap_tiny_cpu(tmp_path):
    # issue 20's --overlap table at a smoke size: every measurement present (CPU has no overlap to show)
    out = tmp_path / "overlap.json"
    p = subprocess.run([sys.executable, BENCH, "--overlap", "--tiny", "--out", str(out)], capture_output=True,
                       text=True, timeout=900, cwd=str(REPO_ROOT),
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    res = json.loads(out.read_text())
    impls = {(r["X"], r["impl"]) for r in res["rows"]}
    for x in ("gemm", "moe"):
        for want in ("X alone", "X + fetch (tma)", "X + fetch (sm_few)", "X + fetch (sm)", "fetch alone (tma)",
                     "fetch alone (sm)", "X + all_to_all lookup (device table)",
                     "X + jnp.take on pinned_host (compute_on)"):
            assert (x, want) in impls, (x, want, impls)
    for want in ("DeepEP shape fetch+wait (tma)", "DeepEP shape lookup (sm)"):
        assert ("-", want) in impls, (want, impls)
    assert all(r["us"] and r["us"] > 0 for r in res["rows"]), [r for r in res["rows"] if not r.get("us")]
    tma = [r for r in res["rows"] if r["impl"] == "fetch alone (tma)"][0]
    assert 1 <= tma["sms"] <= 4, tma
    assert "summary (issue 20 goals" in p.stdout
