"""EP dispatch / combine: bit-exact against jax_engram.reference, gradients, errors, jit caching, example.

The checks live in tests/workers/ep_check.py (platform-agnostic, many cases per process so that process
start-up and the reference's compiles are paid once). Layouts: 2 processes (every case, gradients, errors),
4 processes and one process with 4 CPU devices (the cases marked wide), and GPUs when present. The
reference results are computed once per (case, R) and shared through a session directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "ep_check.py")


@pytest.fixture(scope="session")
def ref_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ep_reference"))


def _assert_all_pass(results, min_checks=1):
    for r, res in enumerate(results):
        failed = [k for k, v in res["checks"].items() if not v]
        assert not failed, f"rank {r}: failed checks {failed}"
        assert len(res["checks"]) >= min_checks, f"rank {r}: only {len(res['checks'])} checks ran"


def _run_single(extra_args=(), env=None, timeout=600):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run([sys.executable, WORKER, *extra_args], capture_output=True, text=True, timeout=timeout,
                       env=e, cwd=str(REPO_ROOT))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return [json.loads(lines[-1][7:])]


def test_two_processes_all_cases_grads_errors(launch, ref_dir):
    res = launch(2, WORKER, args=("--suite", "cases,cache,gradne,grad,errors", "--ref-dir", ref_dir),
                 platform="cpu", timeout=900)
    assert len(res) == 2 and all(r["devices"] == 2 and r["processes"] == 2 for r in res)
    _assert_all_pass(res, min_checks=25)
    for name in ("case_expand_e8_k8_a128_zp_unbal_bias2", "case_nonexpand_e64_k1_fp8_p1_bias2",
                 "case_expand_h7168_k8_bias2", "jit_cache_hit_when_token_count_changes", "moe_grad_bfloat16",
                 "grad_nonexpand_dispatch_combine", "error_duplicate_expert_names_token"):
        assert name in res[0]["checks"], name


def test_four_processes(launch, ref_dir):
    res = launch(4, WORKER, args=("--suite", "cases,cache", "--wide-only", "--ref-dir", ref_dir), platform="cpu",
                 timeout=900)
    assert len(res) == 4 and all(r["devices"] == 4 for r in res)
    _assert_all_pass(res, min_checks=6)


def test_one_process_four_cpu_devices(ref_dir):
    # Runs after the 4-process test: same R, so the reference results are read from ref_dir.
    res = _run_single(["--platform", "cpu", "--cpu-devices", "4", "--suite", "cases,cache,gradne", "--wide-only",
                       "--ref-dir", ref_dir], env={"JAX_PLATFORMS": "cpu"})
    assert res[0]["devices"] == 4 and res[0]["processes"] == 1
    _assert_all_pass(res, min_checks=8)


def test_example_moe_layer_runs():
    p = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "moe_layer.py"), "--devices", "2",
                        "--tokens", "12", "--dtypes", "float32"], capture_output=True, text=True, timeout=600,
                       cwd=str(REPO_ROOT), env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "PASS moe_layer float32" in p.stdout


@pytest.mark.gpu(2)
def test_two_gpus_one_process():
    _assert_all_pass(_run_single(["--platform", "gpu", "--suite", "full"]), min_checks=25)


@pytest.mark.gpu(2)
def test_two_processes_one_gpu_each(launch):
    _assert_all_pass(launch(2, WORKER, args=("--suite", "full"), platform="cuda", timeout=900), min_checks=25)


# Copy-engine rows (kernels/cuda/ep.h): the auto policy takes them only for large batches, so these force them, in 3
# pieces so that the pieces cut the CTA token ranges unevenly (and leave some pieces empty at small M).
_CE_ENV = {"JAX_ENGRAM_EP_DISPATCH_CE": "1", "JAX_ENGRAM_EP_CE_PIECES": "3"}


@pytest.mark.gpu(2)
def test_two_gpus_one_process_copy_engine_rows():
    # errors too: with copy-engine rows every receiver finds a peer's bad routing itself (no header carries it)
    res = _run_single(["--platform", "gpu", "--suite", "cases,cache,gradne,grad,errors"], env=_CE_ENV)
    assert res[0]["dispatch_path"] == "copy engine (3 pieces)", res[0]["dispatch_path"]
    _assert_all_pass(res, min_checks=33)  # cases 10, cache 1, gradne 1, grad 2, errors 19


@pytest.mark.gpu(2)
def test_two_processes_one_gpu_each_copy_engine_rows(launch):
    res = launch(2, WORKER, args=("--suite", "cases,cache,gradne,grad,errors"), platform="cuda", timeout=900,
                 env=_CE_ENV)
    assert all(r["dispatch_path"] == "copy engine (3 pieces)" for r in res), [r["dispatch_path"] for r in res]
    _assert_all_pass(res, min_checks=33)  # cases 10, cache 1, gradne 1, grad 2, errors 19


@pytest.mark.parametrize("push", [False, True])
def test_staging_bytes_mirror_the_layout_header(push):
    """The Python sizes of the EP staging regions (pull: CPU, push: CUDA) equal ep_layout.h's, over shapes that
    hit every alignment boundary, so a region is never smaller than what the kernels address."""
    from jax_engram import _ffi, ep

    mod = _ffi.native("cpu")
    for R in (1, 2, 3, 8):
        for M in (1, 7, 128, 4096):
            for K in (1, 8, 32):
                for E in (R, 8 * R, 256 if 256 % R == 0 else 8 * R):
                    for hb, P in ((2, 0), (256, 0), (14336, 0), (7168, 56), (100, 3)):
                        want = mod.ep_dispatch_bytes(R, M, K, E, hb, P, push)
                        assert ep.dispatch_staging_bytes(R, M, K, E, hb, P, push=push) == want, (R, M, K, E, hb, P)
                    for hb in (2, 256, 14336, 100):
                        want = mod.ep_combine_bytes(R, M, K, hb, push)
                        assert ep.combine_staging_bytes(R, M, K, hb, push=push) == want, (R, M, K, hb)
