"""Reliability (issue 19): no poisoned state after reported errors, resources after init/close and failed inits,
a dead peer, and Hypothesis property tests against jax_engram.reference (the workers in tests/workers do the work:
poison_check.py, leak_check.py, property_check.py, dead_peer.py).

GPU variants (marked gpu(1)) for the lead: ``pytest -q tests/test_reliability.py -k gpu``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR


def _run(worker, *args, env=None, timeout=600):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, str(WORKERS_DIR / worker), *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=str(REPO_ROOT))


def _result(p):
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][7:])


# ------------------------------------------------------------------------------------------ poisoned state
def _assert_no_poison(p):
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    checks = [l for l in p.stdout.splitlines() if l.startswith("CHECK ")]
    assert len(checks) == 3 and all(" PASS" in l for l in checks), "\n".join(checks) + p.stdout[-4000:]
    # Raised once, by the call: nothing is raised again when the interpreter exits.
    assert "DONE" in p.stderr, out[-4000:]
    tail = p.stderr[p.stderr.rindex("DONE") + 4:]
    assert "Traceback" not in tail and "Exception ignored" not in tail and "Error" not in tail, tail[-4000:]


def test_checked_and_routing_errors_leave_context_usable_cpu():
    p = _run("poison_check.py", "--platform", "cpu", "--cpu-devices", "4", env={"JAX_PLATFORMS": "cpu"})
    _assert_no_poison(p)


@pytest.mark.gpu(1)
def test_checked_and_routing_errors_leave_context_usable_gpu():
    p = _run("poison_check.py", "--platform", "cuda", env={"CUDA_VISIBLE_DEVICES": "0"})
    _assert_no_poison(p)


# ------------------------------------------------------------------------------------------------ leaks
def _assert_no_leaks(res, cycles):
    leaks = res["leaks"]
    for k in ("fds", "memfd_maps", "nvidia_maps", "py_threads", "os_threads", "listening_sockets"):
        assert leaks[k] == 0, f"{k} leaked after {cycles} init/close cycles and a failed init: {leaks}"
    assert res["failed_init"], "a window of 2**50 bytes did not fail init"
    assert res["live_contexts"] == 0


def test_init_close_and_failed_init_leak_nothing_cpu():
    res = _result(_run("leak_check.py", "--platform", "cpu", "--cpu-devices", "4", "--cycles", "20",
                       env={"JAX_PLATFORMS": "cpu"}))
    _assert_no_leaks(res, 20)
    assert res["memfd_maps_while_open"] > 0, "the mapping counter sees nothing of a live context"


@pytest.mark.gpu(1)
def test_init_close_and_failed_init_leak_nothing_gpu():
    res = _result(_run("leak_check.py", "--platform", "cuda", "--cycles", "20", env={"CUDA_VISIBLE_DEVICES": "0"}))
    _assert_no_leaks(res, 20)
    # VMM memory is not in /proc/self/maps: the GPU's free memory must come back (within 64 MiB of XLA noise).
    assert res["leaks"]["gpu_free_bytes_lost"] < 64 << 20, res
