"""tools/host_trace.py on real trace lines: a subprocess gathers through a host gather pool of the native module with
JAX_ENGRAM_HOST_TRACE=1, and the tool must find every job the pool printed, with consistent times (so a change of
the pool's trace format fails here), and print the summary."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import host_trace  # noqa: E402

JOBS, ROWS, THREADS = 20, 3000, 3
CODE = f"""
import numpy as np
from jax_engram import _ffi
rng = np.random.default_rng(0)
table = rng.integers(0, 256, size=(4096, 64), dtype=np.uint8)
pool = _ffi.native("cpu")._HostGatherPool("trace test", {THREADS})
for _ in range({JOBS}):
    ids = rng.integers(0, 4096, size={ROWS}, dtype=np.int32)
    out = np.zeros(({ROWS}, 64), dtype=np.uint8)
    pool.gather(table, ids, out, 16, 30.0)
    assert (out == table[ids]).all()
pool.stop()
"""


def test_host_trace_reads_the_pools_trace(tmp_path):
    env = dict(os.environ, JAX_ENGRAM_HOST_TRACE="1", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(REPO_ROOT))
    assert p.returncode == 0, p.stderr[-4000:]
    jobs = host_trace.parse(p.stderr)
    assert len(jobs) == JOBS, p.stderr[-2000:]
    for j in jobs:
        assert j["rows"] == ROWS and j["rb"] == 64 and j["items"] == (ROWS + 15) // 16, j
        assert 1 <= j["workers"] <= THREADS, j
        assert 0 <= j["first"] <= j["median"] <= j["last"] <= j["done"], j
        assert 0 <= j["chunk0"] <= j["done"], j
    log = tmp_path / "trace.log"
    log.write_text(p.stderr)
    t = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "host_trace.py"), str(log)], capture_output=True,
                       text=True, timeout=60)
    assert t.returncode == 0, t.stderr
    assert f"{JOBS} jobs of 0.18 MiB" in t.stdout and "last worker joins" in t.stdout, t.stdout
    empty = tmp_path / "empty.log"
    empty.write_text("nothing traced\n")
    t = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "host_trace.py"), str(empty)], capture_output=True,
                       text=True, timeout=60)
    assert t.returncode == 0 and "no host gather jobs traced" in t.stdout, t.stdout
