"""tools/profile_gaps.py on a synthetic jax.profiler trace: the main stream is the busiest GPU stream, its span,
busy time and idle gaps (with the activities on both sides) are computed from the events, overlapping events are
not counted as gaps, CPU threads are ignored, and the side stream's activities are listed."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

from conftest import REPO_ROOT


def _trace(tmp_path):
    ev = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 14, "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 32, "args": {"name": "Stream #32(MemcpyH2D)"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    main = [(0, 100, "gemm_a"), (100, 50, "gemm_b"), (140, 20, "overlapping"), (400, 100, "layer1"),
            (510, 40, "gemm_c")]  # gaps: 160 -> 400 (240 us), 500 -> 510 (10 us)
    ev += [{"ph": "X", "pid": 1, "tid": 14, "ts": t, "dur": d, "name": n} for t, d, n in main]
    ev += [{"ph": "X", "pid": 1, "tid": 32, "ts": t, "dur": d, "name": "MemcpyH2D"} for t, d in ((20, 30), (300, 31))]
    ev += [{"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 5000, "name": "host work"}]  # not a GPU stream
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return tmp_path


def test_profile_gaps_summary(tmp_path):
    p = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "profile_gaps.py"), str(_trace(tmp_path)),
                        "--min-gap-us", "5"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    main = next(l for l in lines if "Stream #14" in l)
    assert "5 events" in main and "span     550.0 us" in main and "busy     310.0 us" in main, main
    assert "gaps >= 5 us: 2 =    250.0 us" in main, main
    gaps = [l for l in lines if l.strip().startswith("gap")]
    assert "240.0 us at +    160.0" in gaps[0] and "'overlapping'" in gaps[0] and "'layer1'" in gaps[0], gaps
    side = next(l for l in lines if "Stream #32" in l)
    assert "2 events" in side, side
    assert any("+    300.0 us     31.0 us  MemcpyH2D" in l for l in lines), p.stdout
    assert "host work" not in p.stdout and "/host:CPU" not in p.stdout


def test_profile_kernels_per_call(tmp_path):
    """--kernels CALLS: GPU time and count per activity name over every GPU stream, divided by CALLS; host events
    are not counted."""
    p = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "profile_gaps.py"), str(_trace(tmp_path)),
                        "--kernels", "2"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "GPU busy 185.5 us per call, 3.5 activities per call (2 calls)" in lines[0], lines[0]  # (310 + 61) / 2
    assert lines[1].split()[0] == "50.0" and lines[3].split()[0] == "30.5", lines  # the largest first
    rows = {l.split()[-1]: l.split()[:4] for l in lines[1:]}  # name: time, "us", calls, "x"
    assert rows["MemcpyH2D"] == ["30.5", "us", "1.0", "x"], rows
    assert rows["layer1"] == ["50.0", "us", "0.5", "x"] and rows["overlapping"] == ["10.0", "us", "0.5", "x"], rows
    assert "host work" not in p.stdout


def test_profile_steps(tmp_path):
    """--steps: one line per execution (the host's ExecuteThunks), its GPU activities assigned by time, the --mark
    activity, the end of its GPU work, the time to the next execution, and the launching thread's custom calls and
    graph launches; another host thread's events are not listed."""
    ev = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 14, "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "python3"}},
    ]
    X = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}  # noqa
    for t0 in (1000, 3000):  # two executions, 2000 us apart
        ev += [X(2, 7, t0, 400, "[0] GpuExecutable::ExecuteThunks"), X(2, 7, t0 + 10, 20, "jax_engram_ffi_call.3"),
               X(2, 7, t0 + 40, 100, "cuGraphLaunch (CudaGraph:1)"), X(2, 8, t0 + 50, 30, "jax_engram_ffi_call.9"),
               X(1, 14, t0 + 120, 50, "gemm"), X(1, 14, t0 + 300, 10, "layer1"), X(1, 14, t0 + 400, 900, "gemm")]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    p = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "profile_gaps.py"), str(tmp_path), "--steps",
                        "--mark", "layer1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "2 executions" in lines[0], lines
    rows = [l.split() for l in lines[2:]]
    # step, first GPU activity, layer1, GPU end (400 + 900), to the next execution (3000 - 2300), the host pieces
    assert rows[0] == ["0", "120", "300", "1300", "700", "jax_engram_ffi_call.3@10+20", "graph@40+100"], rows
    assert rows[1] == ["1", "120", "300", "1300", "-", "jax_engram_ffi_call.3@10+20", "graph@40+100"], rows
