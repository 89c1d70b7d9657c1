"""Hierarchical (node, local) EP groups (issue: scale-out): every result bit-exact against the flat semantics
(jax_engram.reference over the same global ranks). The checks live in tests/workers/scaleout_check.py.

Layouts: 1 process x 4 CPU devices as 2 nodes x 2; 2 processes x 2 CPU devices as 2 x 2 (a node = a
process); 4 processes as 4 nodes x 1; 3 nodes x 1 (non power of two).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "scaleout_check.py")


def _assert_all_pass(results, min_checks=1):
    for r, res in enumerate(results):
        failed = [k for k, v in res["checks"].items() if not v]
        assert not failed, f"rank {r}: failed checks {failed}"
        assert len(res["checks"]) >= min_checks, f"rank {r}: only {len(res['checks'])} checks ran"


def _run_single(args, timeout=600):
    e = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, WORKER, "--platform", "cpu", *args], capture_output=True, text=True,
                       timeout=timeout, env=e, cwd=str(REPO_ROOT))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return [json.loads(lines[-1][7:])]


def test_one_process_2_nodes_x_2():
    res = _run_single(["--cpu-devices", "4", "--nodes", "2"])
    assert res[0]["devices"] == 4 and res[0]["nodes"] == 2
    _assert_all_pass(res, min_checks=7)
