"""The library as a user meets it: the main job (python -m jax_engram) on 1 device, 4 devices and 2 processes,
the public API's shape (tests/workers/api_check.py: spellings, deprecations, result types, type hints, layers,
Flax NNX modules), and the examples (each must pass its own check)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

STAGES = ("engram_lookup", "dispatch", "expert_gemms", "combine", "backward")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _run(cmd, timeout=600):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO_ROOT), env=ENV)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return p.stdout


def _main_json(*args):
    out = _run([sys.executable, "-m", "jax_engram", "--platform", "cpu", "--json", "--iters", "2", "--warmup", "1",
                *args])
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got:\n{out}"
    res = json.loads(lines[0])
    assert res["ok"] is True and res["platform"] == "cpu", res
    assert list(res["stages"]) == list(STAGES) and all(res["stages"][s]["ms"] >= 0 for s in STAGES), res["stages"]
    ck = res["check"]
    assert not ck["skipped"] and ck["ok"], ck
    assert {"forward", "d_x", "d_engram.w_key", "d_engram.w_value", "d_moe.router", "d_moe.w_up",
            "d_moe.w_down"} <= set(ck["max_rel_err"]), ck
    assert all(v <= 1e-4 for v in ck["max_rel_err"].values()), ck  # float32 on CPU
    return res


def test_main_job_one_device_json():
    res = _main_json("--cpu-devices", "1")
    c = res["config"]
    assert c["devices"] == 1 and c["processes"] == 1 and c["ranks"] == 1 and c["placement"] == "host"
    assert c["orders"] == [2, 3] and c["ids_per_token"] == 2 * c["heads_per_order"]


def test_main_job_two_processes_json():
    res = _main_json("-n", "2", "--cpu-devices", "1", "--placement", "device")
    c = res["config"]
    assert c["devices"] == 2 and c["processes"] == 2 and c["placement"] == "device"


def test_main_job_table_four_devices():
    out = _run([sys.executable, "-m", "jax_engram", "--platform", "cpu", "--iters", "2", "--warmup", "1"])
    for needle in ("4 device(s) in 1 process(es) = 4 EP ranks", "Engram lookup", "dispatch", "expert GEMMs",
                   "combine", "backward", "check vs pure-JAX reference", "-> PASS", "RESULT: PASS"):
        assert needle in out, f"missing {needle!r} in:\n{out}"


def test_api_and_layers():
    out = _run([sys.executable, str(WORKERS_DIR / "api_check.py"), "--cpu-devices", "2"])
    res = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])
    failed = [k for k, v in res["checks"].items() if not v]
    assert not failed and len(res["checks"]) >= 10, (failed, out[-6000:])


def test_example_engram_layer():
    out = _run([sys.executable, str(REPO_ROOT / "examples" / "engram_layer.py"), "--devices", "2"])
    assert "PASS engram_layer placement=host" in out and "PASS engram_layer placement=device" in out, out


def test_example_train_moe_loss_decreases():
    out = _run([sys.executable, str(REPO_ROOT / "examples" / "train_moe.py"), "--devices", "2", "--steps", "20"])
    assert "PASS train_moe" in out, out
    curve = [float(v) for v in next(l for l in out.splitlines() if l.startswith("loss curve:")).split()[2:]]
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < 0.8 * curve[0], curve
