"""Hypothesis property tests of EP dispatch/combine and Engram lookups against jax_engram.reference (CPU).

Every process of a job runs the same derandomized Hypothesis search (same examples in the same order, no
shrinking), so the collective ops stay in step; each example is one case compared bit-exactly. Static shapes come
from a few *families* per run (one compile each); Hypothesis varies what is data inside a family: per-rank
real token counts (ragged, zero), -1 masks, skewed routing, values, Engram ids with padding and out-of-range ids,
so many cases share one executable.

  python tests/workers/property_check.py --cpu-devices 4 --examples 100        (one process)
  python -m jax_engram.launch -n 2 --devices-per-process 2 tests/workers/property_check.py --examples 50
Options: --families SEED (which families), --what ep,engram. Prints ``RESULT {...}`` with the case counts.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from functools import partial

from _harness import local, same, start
from _harness import shard as put

ap = argparse.ArgumentParser()
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--examples", type=int, default=60, help="Hypothesis examples per suite (ep, engram)")
ap.add_argument("--families", type=int, default=0, help="seed choosing this run's shape families")
ap.add_argument("--what", default="ep,engram")
args = ap.parse_args()

cfg = start("cpu", args.cpu_devices)
from jax_engram.launch import emit_result  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import ep, reference as ref  # noqa: E402

AX = "ep"
R = jax.device_count()
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,))
SPEC = P(AX)
ctx = je.init(mesh, AX, timeout_s=60.0)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SETTINGS = settings(max_examples=args.examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
                    print_blob=False)
counts = {"ep": 0, "engram": 0}
failures: list[str] = []


shard = partial(put, mesh=mesh, spec=SPEC)


def values(rng, shape, dt):
    dt = np.dtype(dt)
    if dt == FP8:
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN payloads
        return b.view(FP8)
    return rng.standard_normal(shape).astype(np.float32).astype(dt)


# ------------------------------------------------------------------------------------------------------ EP
@dataclasses.dataclass(frozen=True)
class EpFamily:
    K: int
    E_loc: int
    H: int
    M: int
    expand: bool
    A: int
    dtype: str
    P: int = 0
    weights: bool = True


EP_POOL = [
    EpFamily(K=2, E_loc=2, H=16, M=6, expand=False, A=1, dtype="bfloat16"),
    EpFamily(K=4, E_loc=3, H=32, M=8, expand=True, A=4, dtype="bfloat16"),
    EpFamily(K=1, E_loc=1, H=8, M=5, expand=False, A=1, dtype="float32", weights=False),
    EpFamily(K=3, E_loc=4, H=16, M=7, expand=True, A=1, dtype="float16"),
    EpFamily(K=5, E_loc=2, H=16, M=4, expand=False, A=2, dtype="float8_e4m3fn", P=2),
    EpFamily(K=2, E_loc=5, H=24, M=9, expand=True, A=8, dtype="bfloat16", weights=False),
]
ENGRAM_POOL = [  # (num_entries, hidden, dtype, T, E, sf packs, sf_layout, mode)
    (8, 16, "bfloat16", 5, 3, 0, "row", "fill"),
    (5, 8, "float32", 3, 4, 2, "tma_col_major", "clip"),
    (12, 4, "float8_e4m3fn", 6, 2, 1, "row", "checked"),
    (3, 32, "float16", 2, 5, 0, "row", "clip"),
    (7, 12, "bfloat16", 4, 1, 3, "tma_col_major", "fill"),
    (4, 16, "float32", 3, 3, 0, "row", "checked"),
]


def pick(pool, n, salt):
    order = np.random.default_rng(args.families * 7919 + salt).permutation(len(pool))
    return [pool[i] for i in order[:n]]


_ep_fns: dict = {}


def ep_fn(fam: EpFamily):
    if fam not in _ep_fns:
        E = fam.E_loc * R
        kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=fam.M, expand=fam.expand, expert_alignment=fam.A)

        def body(x, idx, w, sf, y):
            d = ep.dispatch(x[0], idx[0], w[0] if fam.weights else None, x_scales=sf[0] if fam.P else None, **kw)
            cx = ep.combine(y[0], d.handle).combined_x
            h = d.handle
            out = dict(recv_x=d.recv_x, num_recv=d.num_recv_tokens, group_sizes=d.group_sizes,
                       psum_rank=h.psum_num_recv_tokens_per_rank, psum_expert=h.psum_num_recv_tokens_per_expert,
                       unaligned=h.num_unaligned_recv_tokens_per_expert, meta=h.recv_src_metadata, cx=cx)
            if fam.P:
                out["recv_sf"] = d.recv_x_scales
            if fam.weights:
                out["recv_w"] = d.recv_topk_weights
            return {k: v[None] for k, v in out.items()}

        _ep_fns[fam] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    return _ep_fns[fam]


def ep_case(fam: EpFamily, real: list[int], mask_p: float, skew: bool, seed: int):
    rng = np.random.default_rng(seed)
    E, M, H = fam.E_loc * R, fam.M, fam.H
    K = min(fam.K, E)  # distinct experts per token: at most E (few ranks, few experts)
    N = M
    scores = rng.random((R, N, E))
    if skew:  # most tokens want rank 0's experts
        scores[..., : fam.E_loc] += 2.0 * (rng.random((R, N)) < 0.8)[..., None]
    idx = np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)
    idx[rng.random(idx.shape) < mask_p] = -1
    for r in range(R):
        idx[r, real[r]:] = -1  # tokens past the rank's real count: not sent (ragged, possibly zero)
    x = values(rng, (R, N, H), fam.dtype)
    w = rng.standard_normal((R, N, K)).astype(np.float32)
    sf = rng.standard_normal((R, N, max(fam.P, 1))).astype(np.float32)[..., : fam.P]
    rows = ep.expand_rows(R, M, K, fam.E_loc, fam.A) if fam.expand else R * M
    y = values(rng, (R, rows, H), "bfloat16")
    out = {k: local(v) for k, v in ep_fn(fam)(shard(x), shard(idx), shard(w), shard(sf), shard(y)).items()}
    kwr = dict(num_experts=E, max_tokens_per_rank=M, expand=fam.expand, expert_alignment=fam.A)
    rd = ref.ep_dispatch(x, idx, w if fam.weights else None, x_scales=sf if fam.P else None, **kwr)
    rd = {k: (None if v is None else np.asarray(v)) for k, v in rd.items()}
    rcx, _ = ref.ep_combine(y, rd, idx, num_experts=E, max_tokens_per_rank=M, expand=fam.expand)
    rcx = np.asarray(rcx)
    bad = []
    for r in out["recv_x"]:
        o = {k: v[r] for k, v in out.items()}
        tv, rv = rd["recv_token_valid"][r], rd["recv_row_defined"][r]
        checks = [("num_recv", o["num_recv"], rd["num_recv_tokens"][r]),
                  ("group_sizes", o["group_sizes"], rd["group_sizes"][r]),
                  ("psum_rank", o["psum_rank"], rd["psum_num_recv_tokens_per_rank"][r]),
                  ("psum_expert", o["psum_expert"], rd["psum_num_recv_tokens_per_expert"][r]),
                  ("unaligned", o["unaligned"], rd["num_unaligned_recv_tokens_per_expert"][r]),
                  ("meta", o["meta"][tv][:, : (K + 2 if fam.expand else 2)],
                   rd["recv_src_metadata"][r][tv][:, : (K + 2 if fam.expand else 2)]),
                  ("recv_x", o["recv_x"][rv], rd["recv_x"][r][rv]),
                  ("combined_x", o["cx"], rcx[r])]
        if fam.P:
            checks.append(("recv_x_scales", o["recv_sf"][rv], rd["recv_x_scales"][r][rv]))
        if fam.weights:
            sel = rv if fam.expand else tv
            checks.append(("recv_topk_weights", o["recv_w"][sel], rd["recv_topk_weights"][r][sel]))
        bad += [f"rank {r} {n}" for n, g, wnt in checks if not same(g, wnt)]
    return bad


def run_ep(families):
    @SETTINGS
    @given(fi=st.integers(0, len(families) - 1), data=st.data())
    def prop(fi, data):
        fam = families[fi]
        real = data.draw(st.lists(st.sampled_from([0, 1, fam.M // 2, fam.M - 1, fam.M]) | st.integers(0, fam.M),
                                  min_size=R, max_size=R), label="real tokens per rank")
        mask_p = data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]), label="mask")
        skew = data.draw(st.booleans(), label="skew")
        seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
        counts["ep"] += 1
        try:
            bad = ep_case(fam, real, mask_p, skew, seed)
        except Exception as e:  # noqa: BLE001 - recorded, the search goes on in step with the other processes
            bad = [f"{type(e).__name__}: {e}"]
            traceback.print_exc()
        if bad:
            failures.append(f"ep {fam} real={real} mask={mask_p} skew={skew} seed={seed}: {bad[:4]}")
            print("FAIL", failures[-1], flush=True)

    prop()


# -------------------------------------------------------------------------------------------------- Engram
_tables: dict = {}


def engram_setup(fam):
    if fam not in _tables:
        N, H, dt, T, E, packs, layout, mode = fam
        t = je.EngramTable(N, H, np.dtype(dt), ctx=ctx, placement="host" if len(_tables) % 2 else "device",
                           num_sf_packs=packs)
        rng = np.random.default_rng(len(_tables))
        x = values(rng, (R * N, H), dt)
        sf = rng.standard_normal((R * N, packs)).astype(np.float32) if packs else None
        t.write_global(x, sf)
        _tables[fam] = (t, x, sf, jax.jit(jax.shard_map(
            lambda i: tuple(v[None] if v is not None else jnp.zeros((1, 0), jnp.float32)
                            for v in t.lookup(i[0], mode=mode, sf_layout=layout)),
            mesh=mesh, in_specs=SPEC, out_specs=SPEC)))
    return _tables[fam]


def engram_case(fam, pad_p, oob_p, seed):
    N, H, dt, T, E, packs, layout, mode = fam
    t, x, sf, f = engram_setup(fam)
    total = R * N
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, total, size=(R, T, E)).astype(np.int64)
    pad = rng.random(ids.shape) < pad_p
    ids[pad] = rng.choice([-1, -2, -(2**31)], size=int(pad.sum()))
    oob = rng.random(ids.shape) < oob_p
    ids[oob] = rng.choice([total, total + 1, 2**31 - 1], size=int(oob.sum()))
    ids = ids.astype(np.int32)
    shards = x.reshape(R, N, H)
    mine = sorted({s.index[0].start or 0 for s in shard(ids).addressable_shards})
    expect_error = mode == "checked" and bool(oob[mine].any())
    try:
        data, s = f(shard(ids))
        got = local(data), (local(s) if packs else None)
    except Exception as e:  # noqa: BLE001
        if expect_error and "index out of range" in str(e):
            from jax_engram.engram import _forget_failed_execution
            _forget_failed_execution(ctx)
            return []
        raise
    if expect_error:
        return ["checked mode: an out-of-range id raised nothing"]
    bad = []
    for r in got[0]:
        wd, ws = ref.engram_lookup(shards, ids[r], mode=mode, sf_table=sf, sf_layout=layout)
        if not same(got[0][r], wd):
            bad.append(f"rank {r} data")
        if packs and not same(got[1][r], ws):
            bad.append(f"rank {r} sf")
    return bad


def run_engram(families):
    @SETTINGS
    @given(fi=st.integers(0, len(families) - 1), pad_p=st.sampled_from([0.0, 0.2, 1.0]),
           oob_p=st.sampled_from([0.0, 0.0, 0.1, 0.5]), seed=st.integers(0, 2**31 - 1))
    def prop(fi, pad_p, oob_p, seed):
        fam = families[fi]
        counts["engram"] += 1
        try:
            bad = engram_case(fam, pad_p, oob_p, seed)
        except Exception as e:  # noqa: BLE001
            bad = [f"{type(e).__name__}: {str(e)[:300]}"]
        if bad:
            failures.append(f"engram {fam} pad={pad_p} oob={oob_p} seed={seed}: {bad[:4]}")
            print("FAIL", failures[-1], flush=True)

    prop()


t0 = time.time()
what = args.what.split(",")
if "ep" in what:
    run_ep(pick(EP_POOL, 2, 1))
if "engram" in what:
    run_engram(pick(ENGRAM_POOL, 3, 2))
ctx.check()
ctx.close()
print(f"SUMMARY property_check: {counts} cases, {len(failures)} failed, R={R}, {time.time() - t0:.1f}s", flush=True)
emit_result(dict(counts=counts, failures=failures, ranks=R, processes=jax.process_count(),
                 seconds=round(time.time() - t0, 1)))
sys.exit(1 if failures else 0)
