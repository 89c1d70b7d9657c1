"""Engram prefetch (tests/workers/prefetch_check.py): wait's ordering argument under jax.grad, two prefetched
layers and their gradients against the pure-JAX reference (in a global program and inside a user's shard_map),
the layers inside a user's shard_map, a Flax NNX model with two EngramMemory layers jitted as a whole, FP8
EngramMemory layers, the decode form (also as a lax.scan generation loop), FP8 + scale factors and their
quantization, checked mode through a prefetch, token ids captured by the jitted step, the gate's memory_dim check.
One process with 4 CPU devices."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "prefetch_check.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def test_prefetch_four_cpu_devices():
    names = subprocess.run([sys.executable, WORKER, "--list"], capture_output=True, text=True, timeout=300,
                           cwd=str(REPO_ROOT), env=ENV).stdout.split()
    assert len(names) >= 10, names
    p = subprocess.run([sys.executable, WORKER, "--cpu-devices", "4"], capture_output=True, text=True, timeout=600,
                       cwd=str(REPO_ROOT), env=ENV)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    res = json.loads(lines[-1][7:])
    assert sorted(res["checks"]) == sorted(names) and all(res["checks"].values()), res
