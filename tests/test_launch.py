"""Tests of the multi-process harness (jax_engram.launch + tests/workers).

Each job is a fresh set of processes (about 2-3 s for 2 CPU processes); the pytest process
itself never imports jax here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
WORKERS_DIR = TESTS_DIR / "workers"


def _launch_module():
    from jax_engram import launch as launch_mod

    return launch_mod


def _expected_psum(n_proc: int, k: int) -> list[float]:
    # device j of process r holds [4j .. 4j+3] + 100 r (see hello_distributed.py)
    return [float(sum(4 * j + c + 100 * r for r in range(n_proc) for j in range(k)))
            for c in range(4)]


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (containers may not reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


# ---------------------------------------------------------------------------------------
# No processes: pure launcher logic
# ---------------------------------------------------------------------------------------
def test_import_does_not_import_jax():
    # Load launch.py by path so this checks launch.py alone, whatever jax_engram/__init__ does.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('engram_launch', {str(REPO_ROOT / 'jax_engram' / 'launch.py')!r})\n"
        "m = sys.modules['engram_launch'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "assert m.initialize() is None   # no JAX_ENGRAM_* env: no-op\n"
        "m.shutdown()\n"
        "assert 'jax' not in sys.modules, 'launch.py imported jax'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_ENGRAM_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_child_env_and_config():
    lm = _launch_module()
    base = {"PATH": "/bin", "XLA_FLAGS": "--foo"}
    cuda = lm.child_env(1, 2, "127.0.0.1:1234", "cuda", 2, base=base,
                        env={"NCCL_NVLS_ENABLE": "1", "EXTRA": "x"})
    assert cuda["NCCL_NVLS_ENABLE"] == "0"  # hard rule wins over the caller
    assert cuda["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert cuda["PYTHONUNBUFFERED"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in cuda and "JAX_PLATFORMS" not in cuda
    assert cuda["EXTRA"] == "x" and cuda["XLA_FLAGS"] == "--foo"
    cfg = lm.config_from_env(cuda)
    assert cfg == lm.LaunchConfig("127.0.0.1:1234", 2, 1, "cuda", 2)
    assert cfg.local_device_ids == [2, 3]

    cpu = lm.child_env(0, 3, "127.0.0.1:9", "cpu", 1, base=base)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["NCCL_NVLS_ENABLE"] == "0"
    assert (cpu["JAX_ENGRAM_COORDINATOR"], cpu["JAX_ENGRAM_NUM_PROCESSES"],
            cpu["JAX_ENGRAM_PROCESS_ID"], cpu["JAX_ENGRAM_PLATFORM"],
            cpu["JAX_ENGRAM_DEVICES_PER_PROCESS"]) == ("127.0.0.1:9", "3", "0", "cpu", "1")
    assert lm.config_from_env({}) is None


def test_emit_and_parse_result(capsys):
    lm = _launch_module()
    np = pytest.importorskip("numpy")
    lm.emit_result({"a": np.arange(3, dtype=np.float32), "b": np.int64(7)})
    line = capsys.readouterr().out
    assert line.startswith("RESULT ") and line.count("\n") == 1
    assert lm.parse_results(["noise", line.rstrip("\n")]) == {"a": [0.0, 1.0, 2.0], "b": 7}
    # glued behind foreign output without a newline; the last RESULT wins
    assert lm.parse_results(['RESULT {"x": 1}', 'W0000 log textRESULT {"x": 2}']) == {"x": 2}
    assert lm.parse_results(["RESULT not json"]) is None


# ---------------------------------------------------------------------------------------
# Real 2-process CPU jobs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2], ids=["2x1dev", "2x2dev"])
def test_psum_cpu(launch, k):
    results = launch(2, "hello_distributed.py", platform="cpu", devices_per_process=k, timeout=120)
    assert [r["process_index"] for r in results] == [0, 1]
    for r in results:
        assert r["launched"] and r["platform"] == "cpu"
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 2 * k, k)
        assert r["psum"] == _expected_psum(2, k)


def test_failing_rank_kills_job_fast(launch):
    lm = _launch_module()
    t0 = time.monotonic()
    with pytest.raises(lm.LaunchError) as ei:
        # rank 0 would sleep 300 s; rank 1 exits 3 right after jax.distributed.initialize
        launch(2, "fail_rank.py", ["exit"], timeout=120, env={"FAIL_RANK_SLEEP": "300"})
    wall = time.monotonic() - t0
    e = ei.value
    assert wall < 30, f"job took {wall:.1f} s: the sleeping rank was not killed promptly"
    assert e.failed_rank == 1 and not e.timed_out
    assert e.returncodes[1] == 3
    assert e.returncodes[0] is not None and e.returncodes[0] < 0  # killed by the launcher
    msg = str(e)
    assert "rank 1 failed (exit code 3)" in msg
    assert "failing on purpose" in msg and "rank 0 initialized" in msg  # every rank's tail


def test_timeout_kills_whole_group(launch):
    lm = _launch_module()
    t0 = time.monotonic()
    with pytest.raises(lm.LaunchError) as ei:
        launch(2, "hang.py", timeout=8)
    wall = time.monotonic() - t0
    e = ei.value
    assert e.timed_out and e.failed_rank is None
    assert "timed out" in str(e)
    assert 8 <= wall < 25
    pids = [int(p) for out in e.outputs for p in re.findall(r"pid=(\d+)", out)]
    assert len(pids) == 4, e.outputs  # 2 ranks + 2 grandchildren
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes outlived the launcher"


def test_coordinator_port_taken_is_retried(launch, monkeypatch):
    # rank 0 cannot bind a port someone else holds (jaxlib segfaults); the job is restarted.
    import socket

    lm = _launch_module()
    orig, calls = lm.free_port, []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(lm, "free_port",
                            lambda host="127.0.0.1": calls.append(1) or (taken if len(calls) == 1 else orig(host)))
        results = launch(2, "hello_distributed.py", timeout=120)
    assert len(calls) == 2
    assert [r["psum"] for r in results] == [_expected_psum(2, 1)] * 2


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jax_engram.launch", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_success():
    proc = _cli("-n", "2", "tests/workers/hello_distributed.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        res = [json.loads(l.split("RESULT ", 1)[1]) for l in lines
               if l.startswith(f"[rank {rank}] RESULT ")]
        assert len(res) == 1 and res[0]["process_index"] == rank
        assert res[0]["psum"] == _expected_psum(2, 1)
    assert all(l.startswith("[rank ") for l in lines), lines


def test_cli_failure_exit_code():
    t0 = time.monotonic()
    proc = _cli("-n", "2", "--timeout", "100", str(WORKERS_DIR / "fail_rank.py"), "raise")
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[rank 1] RuntimeError: rank 1 failing on purpose" in proc.stderr
    assert "[launch] rank 1 failed (exit code 1)" in proc.stderr


# ---------------------------------------------------------------------------------------
# GPU (1 process per GPU); skipped without enough GPUs
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu(2)
@pytest.mark.parametrize("n,k", [(2, 1), (1, 2)], ids=["2procx1gpu", "1procx2gpu"])
def test_psum_cuda(launch, n, k):
    results = launch(n, "hello_distributed.py", platform="cuda", devices_per_process=k,
                     timeout=240)
    for rank, r in enumerate(results):
        assert r["process_index"] == rank and r["platform"] == "gpu"
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (n, n * k, k)
        assert r["psum"] == _expected_psum(n, k)
