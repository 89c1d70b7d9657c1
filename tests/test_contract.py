"""The contract as a user meets it (CPU): an op whose shard_map mesh places the devices differently from its
context's is refused naming both device orders (flat and ("node", "gpu") contexts); the exception each failing
call raises, once, with nothing printed at interpreter exit. The checks live in tests/workers/contract_check.py."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "contract_check.py")


def _run(*args, timeout=600):
    p = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=str(REPO_ROOT), env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1"))
    return p


def test_reordered_mesh_is_refused():
    p = _run("--case", "mesh")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    passed = [l for l in p.stdout.splitlines() if l.startswith("PASS ")]
    # 2 group shapes x (same mesh + 2 reordered meshes x 5 ops + eager refusal)
    assert len(passed) == 2 * (1 + 2 * 5 + 1), p.stdout
