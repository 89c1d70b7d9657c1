"""EP dispatch / combine: bit-exact against jax_engram.reference, gradients, errors, jit caching, example.

The checks live in tests/workers/ep_check.py (platform-agnostic, many cases per process so that process
start-up and the reference's compiles are paid once). Layouts: 2 processes (every case, gradients, errors),
4 processes and one process with 4 CPU devices (the cases marked wide), and GPUs when present. The
reference results are computed once per (case, R) and shared through a session directory.
"""
from __future__ import annotations

import dataclasses
import json
import re
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
    res = launch(2, WORKER, args=("--suite", "cases,cache,gradne,grad,sequences,config,errors", "--ref-dir", ref_dir),
                 platform="cpu", timeout=900)
    assert len(res) == 2 and all(r["devices"] == 2 and r["processes"] == 2 for r in res)
    _assert_all_pass(res, min_checks=25)
    for name in ("case_expand_e8_k8_a128_zp_unbal_bias2", "case_nonexpand_e64_k1_fp8_p1_bias2",
                 "case_expand_h7168_k8_bias2", "jit_cache_hit_when_token_count_changes", "moe_grad_bfloat16",
                 "grad_nonexpand_dispatch_combine", "sequences_interleaved", "ep_config_attributes_and_cache_key",
                 "error_duplicate_expert_names_token",
                 "error_init_cuda_graphs_not_bool"):
        assert name in res[0]["checks"], name


def test_four_processes(launch, ref_dir):
    res = launch(4, WORKER, args=("--suite", "cases,cache,sequences", "--wide-only", "--ref-dir", ref_dir), platform="cpu",
                 timeout=900)
    assert len(res) == 4 and all(r["devices"] == 4 for r in res)
    _assert_all_pass(res, min_checks=6)


def test_one_process_four_cpu_devices(ref_dir):
    # Runs after the 4-process test: same R, so the reference results are read from ref_dir.
    res = _run_single(["--platform", "cpu", "--cpu-devices", "4", "--suite", "cases,cache,gradne", "--wide-only",
                       "--ref-dir", ref_dir], env={"JAX_PLATFORMS": "cpu"})
    assert res[0]["devices"] == 4 and res[0]["processes"] == 1
    _assert_all_pass(res, min_checks=8)


def test_one_cpu_device_local_path(ref_dir):
    # One rank takes the local path by default (jax_engram/_ep_local.py): every case bit-exact against the reference,
    # the jit cache, the dispatch sequences, the config, and the errors (bad routing, a closed context) through its guard calls.
    # tests/test_ep_local.py compares it with the kernels at one rank.
    res = _run_single(["--platform", "cpu", "--cpu-devices", "1", "--suite", "cases,cache,gradne,sequences,config,errors",
                       "--ref-dir", ref_dir], env={"JAX_PLATFORMS": "cpu"})
    assert res[0]["devices"] == 1 and res[0]["processes"] == 1
    _assert_all_pass(res, min_checks=30)
    for name in ("error_duplicate_expert_names_token", "error_expert_out_of_range", "error_expert_below_minus_one",
                 "call_after_close_fails_cleanly", "handler_guard_topk_out_shape"):
        assert name in res[0]["checks"], name


def _one_gpu_env(extra=None):
    """One GPU visible (the first of CUDA_VISIBLE_DEVICES, else 0): one rank."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    return {"CUDA_VISIBLE_DEVICES": first, **(extra or {})}


_ONE_RANK_SUITES = "cases,cache,gradne,sequences,config,errors"


@pytest.mark.gpu(1)
@pytest.mark.parametrize("variant", ["local", "kernels", "local_cuda_graphs"])
def test_one_gpu_one_rank(variant):
    # one rank on one GPU: the local path (its CUDA guard kernel; with cuda_graphs its graph target, captured) and
    # the kernels, every suite that applies at one rank
    extra = {"kernels": ["--ep-config", "one_rank=kernels"], "local_cuda_graphs": ["--cuda-graphs"]}.get(variant, [])
    env = _one_gpu_env(_GRAPH_ENV if variant == "local_cuda_graphs" else None)
    res = _run_single(["--platform", "gpu", "--suite", _ONE_RANK_SUITES, *extra], env=env)
    assert res[0]["devices"] == 1
    _assert_all_pass(res, min_checks=30)


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


# Copy-engine rows (kernels/cuda/ep.h): the auto policy takes them only for large batches, so these force them
# (EPConfig), in 3 pieces so that the pieces cut the CTA token ranges unevenly (and leave some pieces empty at small M).
_CE_ARGS = ("--ep-config", "dispatch_copy_engine=always,copy_engine_pieces=3")


@pytest.mark.gpu(2)
def test_two_gpus_one_process_copy_engine_rows():
    # errors too: with copy-engine rows every receiver finds a peer's bad routing itself (no header carries it)
    res = _run_single(["--platform", "gpu", "--suite", "cases,cache,gradne,grad,errors", *_CE_ARGS])
    assert res[0]["dispatch_path"] == "copy engine (3 pieces)", res[0]["dispatch_path"]
    _assert_all_pass(res, min_checks=33)  # cases 10, cache 1, gradne 1, grad 2, errors 19


@pytest.mark.gpu(2)
def test_two_processes_one_gpu_each_copy_engine_rows(launch):
    res = launch(2, WORKER, args=("--suite", "cases,cache,gradne,grad,errors", *_CE_ARGS), platform="cuda",
                 timeout=900)
    assert all(r["dispatch_path"] == "copy engine (3 pieces)" for r in res), [r["dispatch_path"] for r in res]
    _assert_all_pass(res, min_checks=33)  # cases 10, cache 1, gradne 1, grad 2, errors 19


def test_cuda_graphs_flag_is_a_no_op_on_cpu():
    # cuda_graphs=True only changes which CUDA targets the ops call; on CPU the same results, nothing captured
    res = _run_single(["--platform", "cpu", "--cpu-devices", "2", "--suite", "quick,sequences", "--cuda-graphs"],
                      env={"JAX_PLATFORMS": "cpu"})
    _assert_all_pass(res, min_checks=2)
    assert res[0]["graph_captures"] == {"dispatch": 0, "dispatch_cached": 0, "combine": 0}


def test_bench_graphs_runs_on_cpu(tmp_path):
    # the benchmark's plumbing (both contexts, both loops, the JSON); on CPU both modes run the same targets
    out = tmp_path / "graphs.json"
    p = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_graphs.py"), "--tokens", "8",
                        "--hidden", "256", "--ffn", "64", "--experts", "16", "--loop", "2", "--iters", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=str(REPO_ROOT),
                       env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["tokens"] == 8 and rows[0]["max_abs_diff"] == 0.0, rows
    assert rows[0]["step_us_graphs_off"] > 0 and rows[0]["step_us_graphs_on"] > 0


# CUDA graphs (Context cuda_graphs=True): with a graph-size threshold of 1 XLA captures every EP op it may (the SM-store
# dispatches, cached dispatches and combines) into CUDA graphs and replays them without their handlers; the sequences
# suite interleaves them with copy-engine dispatches, which stay outside (ep_layout.h, EpSequence).
_GRAPH_ENV = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1").strip()}
_GRAPH_SUITES = "cases,cache,gradne,grad,sequences,errors"


@pytest.mark.gpu(2)
def test_two_gpus_one_process_cuda_graphs():
    res = _run_single(["--platform", "gpu", "--suite", _GRAPH_SUITES, "--cuda-graphs"], env=_GRAPH_ENV)
    _assert_all_pass(res, min_checks=36)  # cases 10, cache 1, gradne 1, grad 2, sequences 2, errors 20
    assert all(v > 0 for v in res[0]["graph_captures"].values()), res[0]["graph_captures"]  # every op captured


@pytest.mark.gpu(2)
def test_two_processes_one_gpu_each_cuda_graphs(launch):
    res = launch(2, WORKER, args=("--suite", _GRAPH_SUITES, "--cuda-graphs"), platform="cuda", timeout=900,
                 env=_GRAPH_ENV)
    _assert_all_pass(res, min_checks=36)  # cases 10, cache 1, gradne 1, grad 2, sequences 2, errors 20
    assert all(v > 0 for r in res for v in r["graph_captures"].values()), [r["graph_captures"] for r in res]


@pytest.mark.parametrize("push", [False, True])
def test_layout_figures_come_from_the_native_module(push):
    """The public layout figures (staging bytes, expand rows, limits) are the native module's (ep_layout.h), over
    shapes that hit every alignment boundary, and they grow with what the kernels address."""
    from jax_engram import _ffi, ep

    mod = _ffi.native("cpu")
    assert (ep.MAX_TOPK, ep.MAX_LOCAL_EXPERTS, ep.MAX_EXPERTS) == (32, 256, 2048)
    assert ep.MAX_TOPK == mod.ep_limits["max_topk"] and ep.MAX_EXPERTS == mod.ep_limits["max_experts"]
    for R, M, K, E, hb, P in ((1, 1, 1, 1, 2, 0), (2, 7, 8, 16, 100, 3), (8, 128, 32, 256, 14336, 0),
                              (3, 4096, 8, 24, 7168, 56)):
        got = ep.dispatch_staging_bytes(R, M, K, E, hb, P, push=push)
        assert got == mod.ep_dispatch_bytes(R, M, K, E, hb, P, push) and got % 256 == 0, (R, M, K, E, hb, P)
        # the region holds at least the x rows that travel: staged (CPU) or in R - 1 inbox slots (CUDA), both halves
        assert got >= 2 * (R - 1 if push else 1) * M * hb, (R, M, K, E, hb, P, got)
        assert ep.combine_staging_bytes(R, M, K, hb, push=push) == mod.ep_combine_bytes(R, M, K, hb, push)
    # expand rows: align(R*M*min(K, E_loc) + (A-1)*E_loc, A)
    assert ep.expand_rows(8, 4096, 6, 32, 128) == -(-(8 * 4096 * 6 + 127 * 32) // 128) * 128
    assert ep.expand_rows(2, 5, 3, 1, 4) == 16 and ep.expand_rows(2, 5, 1, 4, 1) == 10


def test_ep_config_is_validated_once_with_clear_errors():
    import jax_engram as je

    assert je.EPConfig() == je.EPConfig(dispatch_copy_engine="auto", copy_engine_pieces=4)
    assert hash(je.EPConfig(copy_engine_pieces=3)) == hash(je.EPConfig(copy_engine_pieces=3))  # a cache key
    for kw, err, needle in ((dict(dispatch_copy_engine="yes"), ValueError, "dispatch_copy_engine must be one of"),
                            (dict(copy_engine_pieces=0), ValueError, "copy_engine_pieces must be in [1, 32]"),
                            (dict(copy_engine_pieces=33), ValueError, "copy_engine_pieces must be in [1, 32]"),
                            (dict(copy_engine_pieces=2.0), TypeError, "copy_engine_pieces must be an int"),
                            (dict(dispatch_stage_warps=16), ValueError, "dispatch_stage_warps must be in [1, 15]"),
                            (dict(combine_stage_warps=0), ValueError, "combine_stage_warps must be in [1, 15]"),
                            (dict(combine_stage_warps=True), TypeError, "combine_stage_warps must be an int")):
        with pytest.raises(err, match=re.escape(needle)):
            je.EPConfig(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        je.EPConfig().copy_engine_pieces = 2


def test_ep_config_reaches_the_handlers_as_attributes():
    # the config is part of the compiled program (attributes of the custom calls), so a new config recompiles
    # and every rank runs the same one; the CPU backend accepts and ignores the CUDA tuning
    res = _run_single(["--platform", "cpu", "--cpu-devices", "2", "--suite", "config"],
                      env={"JAX_PLATFORMS": "cpu"})
    _assert_all_pass(res, min_checks=2)


# The CUDA push protocol's token ranges, push chunks and copy-engine pieces (ep_layout.h): the handler sizes its
# copies and the kernels their waits with these, so any disagreement (a gap, an overlap, a wrong "piece of") would
# let a receiver read rows that have not landed. Whole tables from the module's test hooks; the properties are the
# ones both sides rely on.
def _hooks():
    from jax_engram import _ffi

    return _ffi.native("cpu")


def _check_cta_ranges(mod, M, G):
    t0, t1, of, per = mod.ep_cta_table(M, G)
    pos = 0
    for c in range(G):
        assert t0[c] == pos and pos <= t1[c] <= M and t1[c] - t0[c] <= per, (M, G, c, t0[c], t1[c], per)
        pos = t1[c]
    assert pos == M, (M, G, pos)  # every token in exactly one range, in order
    for t in range(M):
        assert t0[of[t]] <= t < t1[of[t]], (M, G, t, of[t])
    assert (t1[0] == 0) == (G >= 2 and M <= 32 * G), (M, G)  # CTA 0 writes the header instead at small M


def _check_chunks(mod, t0, length, nch):
    b, of = mod.ep_chunk_table(t0, length, nch)
    assert b[0] == t0 and b[nch] == t0 + length, (t0, length, nch, b)
    sizes = [b[i + 1] - b[i] for i in range(nch)]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, (length, nch, sizes)
    for t in range(length):
        assert b[of[t]] <= t0 + t < b[of[t] + 1], (t0, length, nch, t, of[t])


def _check_pieces(mod, per, P, tau):
    b, of = mod.ep_ce_piece_table(per, P, tau)
    assert b[0] == 0 and b[P] == per, (per, P, tau, b)
    assert all(b[j] <= b[j + 1] for j in range(P)), (per, P, tau, b)
    for off in range(per):
        j = of[off]
        assert 0 <= j < P and b[j] <= off < b[j + 1], (per, P, tau, off, j, b)
    if tau > 0:  # later pieces are not larger (up to one row of rounding)
        sizes = [b[j + 1] - b[j] for j in range(P)]
        assert all(sizes[j + 1] <= sizes[j] + 1 for j in range(P - 1)), (per, P, tau, sizes)


def test_push_protocol_ranges_chunks_pieces_exhaustive_small():
    mod = _hooks()
    for G in (1, 2, 3, 24, 32):
        for M in (1, 2, 31, 32, 33, 64, 128, 129, 1000):
            _check_cta_ranges(mod, M, G)
    for length in range(0, 40):
        for nch in range(1, 13):
            _check_chunks(mod, 5, length, nch)
    for per in range(1, 80):
        for P in range(1, 9):
            cap = 99 // max(P - 1, 1)  # the handler's cap: every share stays positive
            for tau in sorted({0, 1, min(20, cap), cap}):
                _check_pieces(mod, per, P, tau)


def test_push_protocol_ranges_chunks_pieces_property():
    from hypothesis import given, settings, strategies as st  # a test dependency (pyproject, run.sh)

    mod = _hooks()

    @settings(max_examples=300, deadline=None)
    @given(M=st.integers(1, 8192), G=st.integers(1, 160), P=st.integers(1, 32), data=st.data())
    def check(M, G, P, data):
        _check_cta_ranges(mod, M, G)
        per = mod.ep_cta_table(M, G)[3]
        tau = data.draw(st.integers(0, 99 // max(P - 1, 1)), label="tau")  # the handler's cap
        _check_pieces(mod, per, P, tau)
        _check_chunks(mod, 0, per, data.draw(st.integers(1, 128), label="nch"))

    check()
