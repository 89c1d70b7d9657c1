"""The CUDA paths at more ranks than GPUs: R processes share the GPUs that are there (several ranks per GPU).

Every earlier GPU run had 2 ranks; the CUDA code for R > 2 (receivers laying out R - 1 peers, per-peer slots and
flags, peer-base caches, Engram owners beyond the first peer, copy-engine receivers) runs only here. The processes
of one GPU map each other's windows by file descriptor like processes on different GPUs do, and the GPU
time-slices their kernels, so a kernel spinning on a peer's flag yields to the peer's kernel at the next time
slice: this is for correctness, not speed. No XLA collective runs (NCCL refuses a communicator with duplicate
GPUs, and the context creates none).

Run: ``pytest -k oversubscribed`` on a machine with at least one NVIDIA GPU.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR, gpu_count

EP_WORKER = str(WORKERS_DIR / "ep_check.py")
ENGRAM_WORKER = str(WORKERS_DIR / "engram_check.py")
FOUNDATION_WORKER = str(WORKERS_DIR / "gpu_foundation_check.py")

RANKS = (3, 4, 8)
_TIMEOUT = 900


def _shared(extra=None):
    """Environment of a job whose ranks share every GPU there is (round-robin)."""
    return {"JAX_ENGRAM_GPUS": str(max(gpu_count(), 1)), **(extra or {})}


def _ep_all_pass(results, ranks, min_checks):
    assert len(results) == ranks
    for r, res in enumerate(results):
        failed = [k for k, v in res["checks"].items() if not v]
        assert not failed, f"rank {r}: failed checks {failed}"
        assert len(res["checks"]) >= min_checks, f"rank {r}: only {len(res['checks'])} checks ran: {res['checks']}"
        assert res["devices"] == ranks and res["processes"] == ranks, res


@pytest.mark.gpu(1)
@pytest.mark.parametrize("ranks", RANKS)
def test_oversubscribed_ep(launch, ranks):
    # both layouts, FP8 with scales, combine with biases, cached dispatch, gradients, dispatch sequences
    res = launch(ranks, EP_WORKER, args=("--suite", "cases,cache,gradne,sequences,config"), platform="cuda",
                 timeout=_TIMEOUT, env=_shared())
    _ep_all_pass(res, ranks, min_checks=8)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("ranks", RANKS)
def test_oversubscribed_ep_copy_engine_rows(launch, ranks):
    # copy-engine rows forced on (3 pieces, so pieces cut the CTA token ranges unevenly): every receiver lays out
    # R - 1 peers' tokens from their whole x
    res = launch(ranks, EP_WORKER, args=("--suite", "cases,cache,gradne", "--ep-config",
                                         "dispatch_copy_engine=always,copy_engine_pieces=3"),
                 platform="cuda", timeout=_TIMEOUT, env=_shared())
    assert all(r["dispatch_path"] == "copy engine (3 pieces)" for r in res), [r["dispatch_path"] for r in res]
    _ep_all_pass(res, ranks, min_checks=6)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("ranks", RANKS)
def test_oversubscribed_engram(launch, ranks):
    res = launch(ranks, ENGRAM_WORKER, args=("--suite", "full"), platform="cuda", timeout=_TIMEOUT, env=_shared())
    assert len(res) == ranks
    for r, out in enumerate(res):
        assert not out["failed"], f"rank {r}: failed cases {json.dumps(out['failed'], indent=1)}"
        assert out["passed"] and out["ranks"] == ranks, out


@pytest.mark.gpu(1)
@pytest.mark.parametrize("ranks", RANKS)
def test_oversubscribed_foundation(launch, ranks):
    res = launch(ranks, FOUNDATION_WORKER, platform="cuda", timeout=_TIMEOUT, env=_shared())
    assert len(res) == ranks
    for r, out in enumerate(res):
        assert out["ok"] and not out["failed"], f"rank {r}: {out['failed']}"
        assert out["devices"] == ranks and sum(c["status"] == "PASS" for c in out["checks"].values()) >= 3, out


@pytest.mark.gpu(1)
def test_oversubscribed_context_reports_and_refuses_nccl(launch, tmp_path):
    """A context whose ranks share a GPU says so (ranks_per_gpu) and refuses the NCCL diagnosis with a clear error
    instead of hanging in NCCL's duplicate-GPU check."""
    code = (
        "from jax_engram import launch; launch.initialize(); import jax, jax_engram as je\n"
        "mesh = jax.make_mesh((jax.device_count(),), ('ep',), axis_types=(jax.sharding.AxisType.Explicit,))\n"
        "ctx = je.init(mesh, 'ep', timeout_s=60)\n"
        "try:\n"
        "    ctx.nccl_topology(); refused = ''\n"
        "except RuntimeError as e:\n"
        "    refused = str(e)\n"
        "launch.emit_result({'ranks_per_gpu': ctx.info()['ranks_per_gpu'], 'refused': refused})\n"
        "ctx.close(); launch.shutdown()\n")
    script = tmp_path / "oversub_probe.py"
    script.write_text(code)
    res = launch(3, str(script), platform="cuda", timeout=300, env=_shared())
    want = -(-3 // max(gpu_count(), 1))
    for out in res:
        assert out["ranks_per_gpu"] == want, out
        if want > 1:
            assert "duplicate GPUs" in out["refused"], out


def test_launcher_shares_gpus_round_robin():
    """CPU-side check of the launcher's device assignment when ranks share GPUs."""
    from jax_engram.launch import LaunchConfig
    ids = [LaunchConfig("127.0.0.1:1", 8, i, "cuda", 1, gpus=3).local_device_ids for i in range(8)]
    assert ids == [[0], [1], [2], [0], [1], [2], [0], [1]]
    assert LaunchConfig("127.0.0.1:1", 2, 1, "cuda", 2, gpus=0).local_device_ids == [2, 3]
    assert LaunchConfig("127.0.0.1:1", 2, 1, "cuda", 2, gpus=1).local_device_ids == [0, 0]
    p = subprocess.run([sys.executable, "-m", "jax_engram.launch", "--help"], capture_output=True, text=True,
                       cwd=str(REPO_ROOT), timeout=60)
    assert "--gpus" in p.stdout


def test_mps_detection(tmp_path, monkeypatch):
    """Ranks sharing a GPU are refused under MPS (kernels of several ranks would have to co-reside); the check
    looks for the MPS control socket in CUDA_MPS_PIPE_DIRECTORY."""
    from jax_engram.context import _mps_active
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not _mps_active()
    (tmp_path / "control").touch()
    assert _mps_active()
