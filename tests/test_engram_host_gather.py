"""The Engram host gather pool (issue 27): the CPU backend's fetches run on it, so CI checks the routine and the
pool that the CUDA host-table path uses (tests/workers/engram_host_check.py does the work): bit-exact against the
reference (modes, padding, FP8 + sf in both layouts, odd row sizes, R = 1 and 3 devices of one process and
2 and 3 processes, 1 and 3 threads), two
pending fetches with their own slots, thread lifecycle, a worker failure, the config rule and the host
measurement helpers; and that the built modules kept the gather's software prefetches.

GPU (marked gpu(1)): the same worker with host tables on the CUDA host path (host_gather="cpu"), one process and
three ranks sharing one GPU; there the thread-lifecycle case also counts the members' enqueue threads (started by
the first host-path fetch, joined by close) and an injected enqueue failure fails the wait once, naming the op and
the rank, with the context usable after it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = WORKERS_DIR / "engram_host_check.py"


def _run(*args, env=None, timeout=900):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout,
                          env=e, cwd=str(REPO_ROOT))


def _check(p, min_passed=9):
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    res = json.loads(lines[-1][7:])
    assert not res["failed"] and len(res["passed"]) >= min_passed, res
    # a failed op is raised once, by the call: nothing again at interpreter exit
    assert "Exception ignored" not in p.stderr, p.stderr[-4000:]


@pytest.mark.parametrize("ranks,threads", [(1, 1), (3, 3)])
def test_host_gather_pool_cpu(ranks, threads):
    _check(_run("--platform", "cpu", "--cpu-devices", str(ranks), "--threads", str(threads),
                env={"JAX_PLATFORMS": "cpu"}))


@pytest.mark.parametrize("processes", [2, 3])
def test_host_gather_pool_processes_cpu(launch, processes):
    # peers' shards mapped from other processes (imported memfds) are read by the same workers
    res = launch(processes, str(WORKER), platform="cpu", timeout=600)
    assert len(res) == processes and all(not r["failed"] and len(r["passed"]) >= 9 for r in res), res


@pytest.mark.gpu(1)
def test_host_gather_cuda_host_path_gpu():
    _check(_run("--platform", "cuda", env={"CUDA_VISIBLE_DEVICES": "0"}))


@pytest.mark.gpu(1)
def test_host_gather_cuda_three_ranks_one_gpu(launch):
    res = launch(3, str(WORKER), platform="cuda", timeout=900, env={"JAX_ENGRAM_GPUS": "1"})
    assert len(res) == 3 and all(not r["failed"] and len(r["passed"]) >= 9 for r in res), res


def test_host_gather_pool_waking_cpu():
    """The pool's workers sleep on a futex word that a submit advances outside the pool's lock: idle workers use no
    CPU; jobs submitted from several threads at once, each to workers that may be asleep, are all gathered right
    (bit-exact; a lost wake-up would leave a job unrun and its bounded wait would fail the test); stop() joins the
    workers; a stopped pool fails a job instead of hanging."""
    import threading
    import time

    import numpy as np

    from conftest import harness
    from jax_engram import _ffi

    h = harness()
    native = _ffi.native("cpu")
    name = "je-hostgather"
    before = h.threads_named(name)
    table = np.random.default_rng(7).integers(0, 256, size=(4096, 96), dtype=np.uint8)

    def gather(pool, rng, n=3000, item_rows=16):
        ids = rng.integers(-5, table.shape[0], size=n, dtype=np.int32)  # negative: zero rows
        out = np.full((n, table.shape[1]), 0xAB, dtype=np.uint8)
        pool.gather(table, ids, out, item_rows, 30.0)
        want = np.where((ids >= 0)[:, None], table[np.maximum(ids, 0)], 0).astype(np.uint8)
        np.testing.assert_array_equal(out, want)

    pool = native._HostGatherPool("waking test", 3)
    assert pool.threads() == 3 and h.threads_named(name) == before + 3
    gather(pool, np.random.default_rng(1))
    c0 = h.thread_cpu_seconds(name)
    time.sleep(0.3)
    idle = h.thread_cpu_seconds(name) - c0
    assert idle < 0.05, f"idle workers used {idle:.3f} s of CPU in 0.3 s: they should sleep"

    errors: list[BaseException] = []

    def submitter(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in range(150):
                gather(pool, rng, n=int(rng.integers(1, 400)), item_rows=int(rng.integers(1, 40)))
                if i % 25 == 0:
                    time.sleep(0.01)  # let the workers fall asleep between some jobs
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=submitter, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "a submitting thread did not finish"
    assert not errors, errors[:3]

    pool.stop()
    assert h.threads_named(name) == before
    with pytest.raises(RuntimeError, match="stopped"):
        gather(pool, np.random.default_rng(2))


def test_host_gather_keeps_its_software_prefetches():
    """The row gather keeps dozens of random rows in flight with software prefetches; a compiler that deletes them
    (GCC drops a call to a prefetch-only function it did not inline) leaves each worker waiting for one row at a
    time, 2.5x slower. Every built native module that holds the gather (the CPU module, and the CUDA module's host
    path where it was built) must contain prefetch instructions (x86-64: prefetchnta, read by objdump)."""
    import importlib.util
    import platform
    import shutil

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the check reads x86-64 code; this machine is {platform.machine()}")
    objdump = shutil.which("objdump")
    if objdump is None:
        if os.environ.get("CI"):
            pytest.fail("objdump (binutils) missing -- CI must check the built gather")
        pytest.skip("objdump (binutils) missing")
    found = []
    for name in ("jax_engram._engram_cpu", "jax_engram._engram_cuda"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            assert name.endswith("cuda"), f"{name} is not built"
            continue
        p = subprocess.run([objdump, "-d", "--no-show-raw-insn", spec.origin], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        n = sum(1 for line in p.stdout.splitlines() if "prefetchnta" in line)
        found.append((name, n))
        assert n > 0, f"{spec.origin}: no prefetchnta instruction: the host gather's software prefetch was compiled out"
    assert found
