"""MoE expert-parallel dispatch / combine benchmark: jax_engram vs the JAX baselines vs the NVLink ceiling.

DeepEP's configuration by default: 4096 tokens per rank, hidden 7168, top-8 of 256 experts (uniform routing, K
distinct experts per token), bf16 and FP8 (float8_e4m3fn x with [N, 56] float32 scales), non-expand and expand,
plus 128 tokens per rank for latency; an SM sweep at 4096 tokens. All in the SAME run:

  * ours:       jax_engram.dispatch / combine, each timed as n back-to-back calls inside ONE jitted
                lax.fori_loop (chained: done -> after=); per call = the slope between loops of n and 3n
                calls (n = --loop; _common.time_per_call: the program's fixed ~0.5-1 ms overhead cancels, and
                so does the one dispatch in front of the combine loop), medians of `--iters` samples.
  * baselines:  benchmarks/_baselines.py, per dtype, on OUR inputs (same x, scales, routing; FP8 x and its
                scales packed into one uint8 row, the bytes our dispatch moves per token):
                  ragged_a2a        MaxText-style sort + ragged_all_to_all (dropless, per (token, expert))
                  a2a_cap1.25       all_to_all with capacity factor 1.25 (GShard, drops)
                  dedup_a2a         each token once per destination rank (all_to_all, capacity N, dropless) +
                                    its routing row; dedup_a2a_expand adds the local permute to expert-major rows
                  dedup_all_gather  all_gather of x (every token to every rank once), combine = psum_scatter
                  ragged_a2a_device_kernel  (--ragged-device-kernel, GPU) ragged_a2a compiled with XLA's
                                    --xla_gpu_experimental_ragged_all_to_all_use_device_kernel (errors reported)
                Timed exactly like ours: the same shard_map'ed fori_loop (_baselines.make_loops: each call's input
                depends on the previous call's output through a local one-element update, every output carried)
                and the same loop lengths (n and 3n, fewer only past --baseline-max-s, said in the output).
                `x base` = the best baseline of the same dtype among those standing beside the row's layout
                (non-expand: all; expand: the expert-major ones). Single-jitted-call times are kept in the JSON.
                --loop-hlo counts the collectives in every timed loop's compiled HLO: neither
                side carries an all-reduce.
  * ceiling:    benchmarks/_ceilings.py NVLINK_CEILING: the same run's copy-engine rate per direction with
                both GPUs copying to each other at once (jax.device_put); every "% of ceiling" divides by it.

Bytes (per rank, averaged over ranks, from the actual routing; metadata excluded):
  row bytes   = hidden * itemsize (+ P*4 scales)           (combine: hidden * 2, bf16)
  logical     = row bytes * tokens received, deduplicated per destination rank, LOCAL RANK INCLUDED
                (DeepEP V2 "SU" convention)
  physical    = row bytes * tokens received from OTHER ranks = what crossed NVLink into one GPU
                (= per-direction link bytes; compare with the NVLink ceiling)
SMs used = the CTA count of our kernels (num_sms; 0 -> 24, capped at the device).

Correctness (on by default, device-side, cheap; every reported row: SM sweep and path reruns included):
combine(dispatch(x).recv_x) must equal, bit for bit, bf16(sum over dest ranks d of f32(bf16(f32(x) * c_d))) where c_d = number of the token's experts on rank d
(expand) or 1 (non-expand) -- exact for any summation order because every partial sum is exact in fp32 -- and
the routed weights must come back (combined_topk_weights == topk_weights where topk_idx >= 0, else 0).

Runs:
  one process, all local GPUs:  python benchmarks/bench_ep.py --out ep.json
  under the launcher:           python -m jax_engram.launch -n 2 --platform cuda benchmarks/bench_ep.py --out ep.json
                                (ceiling and baseline checks need one process; they are skipped there)
  CPU smoke (tiny, 2 host devices, any machine):  python benchmarks/bench_ep.py --smoke
  one rank (one device; ours, the native kernels forced and the plain-JAX permute per shape, beside the HBM floor:
  one_rank_main):                  python benchmarks/bench_ep.py --one-rank --out ep_one_rank.json  (CPU: --smoke)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


_DEFAULT_BASELINES = "ragged_a2a,a2a_cap1.25,dedup_a2a,dedup_all_gather,dedup_a2a_expand"


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,128", help="tokens per rank (comma list); also max_tokens_per_rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtypes", default="bf16,fp8", help="bf16,fp8 (fp8 = float8_e4m3fn + [N, scales] f32)")
    ap.add_argument("--scales", type=int, default=56, help="scale entries per token for fp8 (7168/128)")
    ap.add_argument("--layouts", default="nonexpand,expand")
    ap.add_argument("--alignment", type=int, default=1, help="expert_alignment of the expand layout")
    ap.add_argument("--sms", type=int, default=0, help="num_sms of our kernels (0 = automatic: 24)")
    ap.add_argument("--sm-sweep", default="8,16,24,32", help="num_sms values at the largest token count, first dtype ('' = off)")
    ap.add_argument("--no-sm-compare", action="store_true",
                    help="skip the same-run rerun of the largest config (first dtype) on the other dispatch path "
                         "(EPConfig dispatch_copy_engine='never' or 'always': SM stores or copy-engine rows)")
    ap.add_argument("--loop", type=int, default=50, help="calls per timed fori_loop")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--baseline-iters", type=int, default=5)
    ap.add_argument("--baseline-max-s", type=float, default=3.0,
                    help="a baseline's loops have --loop and 3x --loop calls like ours, unless 3x would take longer than "
                         "this (seconds per timed program): then fewer, said in the output")
    ap.add_argument("--ragged-device-kernel", action="store_true",
                    help="also time ragged_all_to_all compiled with --xla_gpu_experimental_ragged_all_to_all_use_device_"
                         "kernel (GPU only; an error is reported and the run goes on)")
    ap.add_argument("--loop-hlo", action="store_true",
                    help="count the collectives in the compiled HLO of every timed loop (ours and baselines) and "
                         "record them: neither side may carry an all-reduce")
    ap.add_argument("--baselines", default=_DEFAULT_BASELINES,
                    help="which JAX baselines (comma list of the keys of bench_ep.BASELINES)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="the context's cuda_graphs=True (XLA may capture the SM-store dispatches and the combines into "
                         "CUDA graphs; XLA_FLAGS decide which loops it does: see benchmarks/bench_graphs.py)")
    ap.add_argument("--ceiling-bytes", type=int, default=1 << 30)
    ap.add_argument("--devices", type=int, default=0, help="ranks (0 = all devices)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on a machine without GPUs: 2 CPU devices")
    ap.add_argument("--out", default="", help="write every result as JSON here")
    ap.add_argument("--one-rank", action="store_true",
                    help="the one-rank section instead (one device; see one_rank_main): our one-rank path, the native "
                         "kernels forced, and the plain-JAX permute, per shape, beside the HBM floor")
    ap.add_argument("--profile", default="",
                    help="--one-rank: also record 8 single calls of every variant and shape with jax.profiler into "
                         "DIR/<tokens>x<hidden>_<variant> (summarize: tools/profile_gaps.py DIR/* --kernels 8)")
    return ap.parse_args(argv)


ARGS = _args()
# The one-rank section: (tokens, hidden, top-k, experts) per shape; --smoke: tiny ones.
ONE_RANK_SHAPES = ((4096, 2048, 4, 8), (128, 7168, 8, 256), (1024, 4096, 8, 64), (4096, 7168, 8, 256))
ONE_RANK_SMOKE = ((32, 256, 4, 16),)
PROFILE_CALLS = 8  # --profile: calls recorded per variant and shape
if ARGS.smoke:
    ARGS.tokens, ARGS.hidden, ARGS.topk, ARGS.experts, ARGS.scales = "64,16", 256, 4, 16, 2
    ARGS.loop, ARGS.iters, ARGS.warmup, ARGS.baseline_iters = 3, 2, 1, 1
    ARGS.sm_sweep, ARGS.ceiling_bytes = "4,8", 1 << 20
    if ARGS.baselines == _DEFAULT_BASELINES:  # fewer compilations: the smoke run must stay quick on 2 CPU cores
        ARGS.baselines = "ragged_a2a,a2a_cap1.25,dedup_a2a"
    if "XLA_FLAGS" not in os.environ and "JAX_ENGRAM_COORDINATOR" not in os.environ and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _baselines & co. (also where the wheel installs them)
from jax_engram.launch import emit_result, initialize, shutdown  # noqa: E402

LAUNCH = initialize()  # no-op outside the launcher; before anything starts a JAX backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram  # noqa: E402
import _baselines as B  # noqa: E402
import _ceilings as CE  # noqa: E402
import _common as C  # noqa: E402

AX = "ep"
SINGLE = jax.process_count() == 1


def log(*a):
    if jax.process_index() == 0:
        print(*a, flush=True)


def _dtype(name):
    return {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[name]


# ------------------------------------------------------------------------------------------------ inputs
def make_inputs(mesh, N, H, K, E, dtype_name, P_sf, seed):
    """x [R*N, H] (bf16 or fp8), topk [R*N, K] int32, w [R*N, K] f32, sf [R*N, P] f32 ([R*N, 0] for bf16)."""
    x, topk, w = B.make_moe_inputs(mesh, N, H, K, E, jnp.bfloat16, seed)
    sh = NamedSharding(mesh, P(AX, None))
    if dtype_name == "fp8":
        x = jax.jit(lambda v: v.astype(jnp.float8_e4m3fn), out_shardings=sh)(x)
        R = mesh.shape[AX]
        sf = jax.jit(lambda k: jax.random.uniform(k, (R * N, P_sf), jnp.float32, 0.5, 2.0),
                     out_shardings=sh)(jax.random.key(seed + 77))
    else:
        R = mesh.shape[AX]
        sf = jax.jit(lambda: jnp.zeros((R * N, 0), jnp.float32), out_shardings=sh)()
    return jax.block_until_ready((x, topk, w, sf))


def traffic(mesh, topk, E):
    """(received token rows incl. local, received from other ranks) per rank, averaged over ranks."""
    R = mesh.shape[AX]
    El = E // R

    def body(tk):
        me = lax.axis_index(AX)
        dest = jnp.where(tk >= 0, tk // El, -1)
        hit = (dest[:, :, None] == jnp.arange(R)[None, None, :]).any(axis=1)          # [N, R]
        dedup = hit.sum().astype(jnp.float32)
        local = jnp.take(hit, me, axis=1).sum().astype(jnp.float32)
        return jnp.stack([lax.psum(dedup, AX), lax.psum(local, AX)])[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX, None), out_specs=P(None, None)))
    out = np.asarray(f(topk).addressable_data(0))[0]
    return float(out[0]) / R, float(out[0] - out[1]) / R


# --------------------------------------------------------------------------------------------- our ops
def make_ours(ctx, mesh, *, N, E, expand, A, num_sms, n, config=None):
    """Jitted (dispatch loop, combine loop, check) over global (x, topk, w, sf)."""
    spec = (P(AX, None),) * 4
    kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=N, expand=expand, expert_alignment=A,
              num_sms=num_sms, config=config)

    def disp(x, tk, w, sf, tok):
        return jax_engram.dispatch(x, tk, w, x_scales=sf if sf.shape[1] else None, after=tok, **kw)

    def tok0(x):
        return lax.pcast(jnp.zeros((), jnp.float32), AX, to="varying")  # varying, like the ops' done

    def dispatch_loop(x, tk, w, sf):
        def step(i, tok):
            return disp(x, tk, w, sf, tok).done
        return lax.fori_loop(0, n, step, tok0(x))[None]

    def combine_loop(x, tk, w, sf):
        res = disp(x, tk, w, sf, tok0(x))
        y = res.recv_x.astype(jnp.bfloat16)

        def step(i, tok):
            return jax_engram.combine(y, res.handle, after=tok).done
        return lax.fori_loop(0, n, step, res.done)[None]

    def check(x, tk, w, sf):
        res = disp(x, tk, w, sf, tok0(x))
        y = res.recv_x.astype(jnp.bfloat16)
        cr = jax_engram.combine(y, res.handle, topk_weights=res.recv_topk_weights)
        out, cw = cr.combined_x, cr.combined_topk_weights
        R = ctx.num_ranks
        El = E // R
        xf = x.astype(jnp.bfloat16).astype(jnp.float32)
        dest = jnp.where(tk >= 0, tk // El, -1)
        cnt = (dest[:, :, None] == jnp.arange(R)[None, None, :]).sum(axis=1)           # [N, R]
        per = cnt if expand else jnp.minimum(cnt, 1)
        # reduce_precision, not astype(bf16).astype(f32): XLA drops that round trip (excess precision) and the
        # expected values would miss the expert-side rounding the contract prescribes.
        parts = lax.reduce_precision(xf[:, None, :] * per[:, :, None].astype(jnp.float32), exponent_bits=8,
                                     mantissa_bits=7)
        acc = jnp.full(xf.shape, -0.0, jnp.float32)  # left fold from -0.0 (a lone -0.0 term stays -0.0)
        for d in range(R):
            acc = acc + jnp.where(per[:, d, None] > 0, parts[:, d], -0.0)
        want = jnp.where((per > 0).any(axis=1)[:, None], acc, 0.0).astype(jnp.bfloat16)
        bits = lambda a: lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731
        bad_x = jnp.sum(bits(out) != bits(want))
        want_w = jnp.where(tk >= 0, w, 0.0)
        bad_w = jnp.sum(lax.bitcast_convert_type(cw, jnp.uint32) != lax.bitcast_convert_type(want_w, jnp.uint32))
        nrecv = res.num_recv_tokens.astype(jnp.float32)
        return jnp.stack([lax.psum(bad_x.astype(jnp.float32), AX), lax.psum(bad_w.astype(jnp.float32), AX),
                          lax.psum(nrecv, AX)])[None]

    sm = lambda f, out: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=out))  # noqa: E731
    return sm(dispatch_loop, P(AX)), sm(combine_loop, P(AX)), sm(check, P(None, None))


def time_ours(ctx, mesh, inputs, *, N, E, expand, A, num_sms, do_check, config=None):
    n1, n2 = ARGS.loop, 3 * ARGS.loop
    progs = {}

    def make(n):
        if n not in progs:
            progs[n] = make_ours(ctx, mesh, N=N, E=E, expand=expand, A=A, num_sms=num_sms, n=n, config=config)
        return progs[n]

    out = {}
    if do_check:
        r = np.asarray(make(n1)[2](*inputs).addressable_data(0))[0]
        out["check"] = dict(ok=bool(r[0] == 0 and r[1] == 0), x_mismatches=int(r[0]), w_mismatches=int(r[1]),
                            num_recv_total=int(r[2]))
    # per call = slope between loops of n1 and n2 calls (the program's fixed overhead cancels; in the combine
    # loops, so does the one dispatch that makes the handle)
    td = C.time_per_call(lambda n: make(n)[0], inputs, n1, n2, warmup=ARGS.warmup, iters=ARGS.iters)
    tc = C.time_per_call(lambda n: make(n)[1], inputs, n1, n2, warmup=ARGS.warmup, iters=ARGS.iters)
    out["dispatch_us"], out["combine_us"] = td["median_us"], tc["median_us"]
    out["dispatch_timing"] = {k: v for k, v in td.items() if not k.startswith("samples")}
    out["combine_timing"] = {k: v for k, v in tc.items() if not k.startswith("samples")}
    out["loop"] = [n1, n2]
    if ARGS.loop_hlo:
        out["loop_collectives"] = dict(dispatch=B.hlo_collectives(make(n1)[0], *inputs),
                                       combine=B.hlo_collectives(make(n1)[1], *inputs))
    return out


# ------------------------------------------------------------------------------------------- baselines
RAGGED_DEVICE_KERNEL_FLAG = "xla_gpu_experimental_ragged_all_to_all_use_device_kernel"

# key -> (builder, keyword arguments, the layouts of ours it stands beside)
BASELINES = {
    "ragged_a2a": (B.make_ragged_a2a_dispatch_combine, {}, ("nonexpand", "expand")),
    "a2a_cap1.25": (B.make_a2a_capacity_dispatch_combine, {}, ("nonexpand", "expand")),
    "dedup_a2a": (B.make_dedup_dispatch_combine, {}, ("nonexpand",)),
    "dedup_all_gather": (B.make_dedup_dispatch_combine, dict(impl="all_gather"), ("nonexpand",)),
    "dedup_a2a_expand": (B.make_dedup_dispatch_combine, dict(expand=True), ("expand",)),
}


def _err(e):
    return f"{type(e).__name__}: {str(e).strip()[:400]}"


def _compiled(fn, args, options):
    """fn itself, or fn compiled for args with XLA debug options (per compilation: no process restart)."""
    return fn if not options else fn.lower(*args).compile(options)


def time_baseline(mesh, key, inputs, *, N, H, K, E, dname, P_sf, options=None, name_suffix=""):
    """One JAX baseline on our inputs (the same x, scales and routing; FP8 x + scales packed into one uint8 row per
    token, the same bytes our dispatch moves), timed like ours: the same shard_map'ed fori_loop structure
    (_baselines.make_loops) and the same loop lengths (--loop and 3x), shortened only where 3x --loop calls would
    take more than --baseline-max-s (then said in the JSON)."""
    mk, kw, layouts = BASELINES[key.replace("_device_kernel", "")]
    x, tk, w, sf = inputs
    xdt = _dtype(dname)
    try:
        bl = mk(mesh, N, H, K, E, xdt, seed=N, make_inputs=False, **kw)
    except Exception as e:  # noqa: BLE001
        return dict(name=key, supported=False, reason=_err(e), layouts=list(layouts))
    if not bl.supported:
        return dict(name=bl.name, supported=False, reason=bl.reason, layouts=list(layouts))
    name = bl.name + name_suffix
    try:
        xr = jax.block_until_ready(jax.jit(B.pack_rows)(x, sf if P_sf else None))
        disp1 = _compiled(bl.dispatch, (xr, tk), options)
        recv, gs, handle = disp1(xr, tk)
        y = jax.block_until_ready(jax.jit(lambda r: B.combine_rows(r, H, xdt))(recv))
        comb1 = _compiled(bl.combine, (y, handle, w), options)
        td1 = C.time_fn(disp1, xr, tk, warmup=1, iters=ARGS.baseline_iters)
        tc1 = C.time_fn(comb1, y, handle, w, warmup=1, iters=ARGS.baseline_iters)
        del recv, gs, y
        slowest = max(td1["median_us"], tc1["median_us"]) * 1e-6
        n1 = max(1, min(ARGS.loop, int(ARGS.baseline_max_s / (3 * slowest)))) if slowest > 0 else ARGS.loop
        progs = {}

        def make(n, which):
            if n not in progs:
                progs[n] = B.make_loops(bl, mesh, n, H, xdt)
            return _compiled(progs[n][which], (xr, tk, w), options)
        args = (xr, tk, w)
        td = C.time_per_call(lambda n: make(n, 0), args, n1, 3 * n1, warmup=1, iters=ARGS.baseline_iters)
        tc = C.time_per_call(lambda n: make(n, 1), args, n1, 3 * n1, warmup=1, iters=ARGS.baseline_iters)
    except Exception as e:  # noqa: BLE001  (e.g. the ragged device kernel on this NCCL): report and carry on
        return dict(name=name, supported=False, reason=_err(e), layouts=list(layouts), error=True)
    r = dict(name=name, supported=True, dtype=dname, layouts=list(layouts), dispatch_us=td["median_us"],
             combine_us=tc["median_us"], dispatch_us_single_call=td1["median_us"],
             combine_us_single_call=tc1["median_us"], loop=[n1, 3 * n1], loop_shortened=n1 < ARGS.loop,
             row_bytes=int(xr.shape[1] * xr.dtype.itemsize), meta=bl.meta,
             dispatch_timing={k: v for k, v in td.items() if not k.startswith("samples")},
             combine_timing={k: v for k, v in tc.items() if not k.startswith("samples")})
    if options:
        r["compiler_options"] = dict(options)
    if ARGS.loop_hlo:
        r["loop_collectives"] = dict(dispatch=B.hlo_collectives(progs[n1][0], *args, compiler_options=options),
                                     combine=B.hlo_collectives(progs[n1][1], *args, compiler_options=options))
    # bit-exact (dispatch) check on fresh bf16 inputs at small sizes: the builders are dtype-generic, their FP8
    # rows are the same code on uint8
    if SINGLE and N <= 256 and not ARGS.no_check and dname == "bf16":
        try:
            mk_in = lambda s: B.make_moe_inputs(mesh, N, H, K, E, jnp.bfloat16, s)  # noqa: E731
            chk = mk(mesh, N, H, K, E, jnp.bfloat16, seed=N, make_inputs=False, **kw)
            if options:
                chk.dispatch = chk.dispatch.lower(*mk_in(N + 1000)[:2]).compile(options)
            r["check"] = chk._check(chk.dispatch, chk.combine, *mk_in(N + 1000))
        except Exception as e:  # noqa: BLE001
            r["check"] = dict(ok=None, reason=_err(e))
    return r


def time_baselines(mesh, inputs, *, N, H, K, E, dname, P_sf, platform):
    """Every JAX baseline for one (token count, dtype), on our inputs."""
    res = {}
    if ARGS.no_baselines:
        return res
    for key in [k for k in ARGS.baselines.split(",") if k]:
        if key not in BASELINES:
            raise SystemExit(f"bench_ep: unknown baseline {key!r} (known: {', '.join(BASELINES)})")
        res[key] = time_baseline(mesh, key, inputs, N=N, H=H, K=K, E=E, dname=dname, P_sf=P_sf)
    if ARGS.ragged_device_kernel:
        key = "ragged_a2a_device_kernel"
        if platform not in ("gpu", "cuda"):
            res[key] = dict(name=key, supported=False, layouts=list(BASELINES["ragged_a2a"][2]),
                            reason=f"--{RAGGED_DEVICE_KERNEL_FLAG} applies on GPU only (platform {platform})")
        else:
            res[key] = time_baseline(mesh, key, inputs, N=N, H=H, K=K, E=E, dname=dname, P_sf=P_sf,
                                     options={RAGGED_DEVICE_KERNEL_FLAG: True}, name_suffix=" [XLA device kernel]")
    return res


def best_baseline(bl: dict, layout: str, op: str):
    """(us, key) of the fastest supported baseline that stands beside our `layout`, or (None, None)."""
    c = [(b[f"{op}_us"], k) for k, b in bl.items() if b.get("supported") and layout in b.get("layouts", ())
         and b.get(f"{op}_us", 0) > 0]
    return min(c) if c else (None, None)


# ------------------------------------------------------------------------------------------------- main
def main():
    devs = jax.devices()
    R = ARGS.devices or len(devs)
    mesh = C.make_ep_mesh(R)
    H, K, E = ARGS.hidden, ARGS.topk, ARGS.experts
    toks = [int(t) for t in ARGS.tokens.split(",") if t]
    dtypes = [d for d in ARGS.dtypes.split(",") if d]
    layouts = [lname for lname in ARGS.layouts.split(",") if lname]
    sweep = [int(s) for s in ARGS.sm_sweep.split(",") if s]
    info = C.env_info()
    platform = devs[0].platform
    log(f"bench_ep: {R} ranks ({platform}, {info.get('device_kind')}, {info.get('sms')} SMs), processes="
        f"{jax.process_count()}, jax {jax.__version__}")
    shown = dict(vars(ARGS), out=os.path.basename(ARGS.out) if ARGS.out else None)  # no machine paths in the JSON
    results = dict(env=info, args=shown, ranks=R, runs=[], baselines={}, baselines_by_dtype={}, ceiling=None,
                   ceiling_definition=CE.NVLINK_CEILING, ceiling_gbps=None)

    ceil_gbps = None
    if not ARGS.no_ceiling:
        if SINGLE and R >= 2:
            c = CE.p2p_copy_ceiling(ARGS.ceiling_bytes, warmup=1, iters=max(3, ARGS.iters // 2))
            results["ceiling"] = c
            results["ceiling_gbps"] = CE.nvlink_ceiling_gbps(c)
            if c:
                ceil_gbps = CE.nvlink_ceiling_gbps(c)
                log(f"config: p2p copy ceiling bytes={c['bytes']} -> one way {c['one_way']['gbps']:.1f} GB/s, both "
                    f"ways {c['bidir']['gbps']:.1f} GB/s total = {ceil_gbps:.1f} GB/s per direction (copy engine, "
                    f"device_put)")
                log(f"config: every '% of ceiling' below: {CE.NVLINK_CEILING} = {ceil_gbps:.1f} GB/s")
        else:
            results["ceiling"] = {"skipped": "needs one process with >= 2 devices"}

    ctx = jax_engram.init(mesh, AX, cuda_graphs=ARGS.cuda_graphs)
    log(f"config: cuda_graphs={ARGS.cuda_graphs} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    rows = []
    with jax.set_mesh(mesh):
        for N in toks:
            on_gpu = platform in ("gpu", "cuda")
            for dname in dtypes:
                # SM sweep: largest token count, first dtype (each num_sms value is a new compilation)
                sweep_here = N == max(toks) and on_gpu and dname == dtypes[0]
                sms_list = [ARGS.sms] + ([s for s in sweep if s != ARGS.sms] if sweep_here else [])
                P_sf = ARGS.scales if dname == "fp8" else 0
                inputs = make_inputs(mesh, N, H, K, E, dname, P_sf, seed=N + 1)
                recv_rows, remote_rows = traffic(mesh, inputs[1], E)
                row_b = H * np.dtype(_dtype(dname)).itemsize + 4 * P_sf
                crow_b = H * 2
                # the baselines of THIS dtype, on these inputs (same bytes per row, same routing)
                bl = time_baselines(mesh, inputs, N=N, H=H, K=K, E=E, dname=dname, P_sf=P_sf, platform=platform)
                results["baselines_by_dtype"].setdefault(str(N), {})[dname] = bl
                if dname == "bf16" or (str(N) not in results["baselines"] and dname == dtypes[0]):
                    results["baselines"][str(N)] = bl  # the pre-dtype key: bf16 baselines
                for k, b in bl.items():
                    cfgs = f"tokens={N} hidden={H} topk={K} experts={E} dtype={dname} ranks={R}"
                    if b.get("supported"):
                        log(f"config: {cfgs} | baseline {b['name']} ({b['row_bytes']} B rows): dispatch "
                            f"{b['dispatch_us']:.1f} us, combine {b['combine_us']:.1f} us per call in loops of "
                            f"{b['loop'][0]} and {b['loop'][1]} calls"
                            + (" (shortened: --baseline-max-s)" if b["loop_shortened"] else "")
                            + f" (single jitted call: {b['dispatch_us_single_call']:.1f} / "
                              f"{b['combine_us_single_call']:.1f} us)"
                            + (f", loop collectives {b['loop_collectives']}" if "loop_collectives" in b else "")
                            + (f", check {b['check']}" if "check" in b else ""))
                    else:
                        log(f"config: {cfgs} | baseline {k}: n/a ({b.get('reason')})")
                for lname in layouts:
                    expand = lname == "expand"
                    A = ARGS.alignment if expand else 1
                    path = ctx.dispatch_path(max_tokens_per_rank=N, hidden_bytes=H * np.dtype(_dtype(dname)).itemsize,
                                             topk=K, num_experts=E)
                    variants = [(sms, path, None) for sms in sms_list]
                    if sweep_here and on_gpu and not ARGS.no_sm_compare:  # the other path, same run
                        other = jax_engram.EPConfig(dispatch_copy_engine="never" if path.startswith("copy engine")
                                                    else "always")
                        variants.insert(1, (ARGS.sms, ctx.dispatch_path(
                            max_tokens_per_rank=N, hidden_bytes=H * np.dtype(_dtype(dname)).itemsize, topk=K,
                            num_experts=E, config=other), other))
                    for sms, path_v, config in variants:
                        r = time_ours(ctx, mesh, inputs, N=N, E=E, expand=expand, A=A, num_sms=sms,
                                      do_check=not ARGS.no_check, config=config)  # every reported configuration
                        used = min(sms or 24, info.get("sms") or 10 ** 6) if on_gpu else None
                        row = dict(tokens=N, hidden=H, topk=K, experts=E, dtype=dname, layout=lname, alignment=A,
                                   ranks=R, sms=used, num_sms_attr=sms, dispatch_path=path_v,
                                   recv_rows=recv_rows, remote_rows=remote_rows, row_bytes=row_b, **r)
                        for op, rb, us in (("dispatch", row_b, r["dispatch_us"]), ("combine", crow_b, r["combine_us"])):
                            row[f"{op}_logical_gbps"] = C.gbps(rb * recv_rows, us)
                            row[f"{op}_physical_gbps"] = C.gbps(rb * remote_rows, us)
                            row[f"{op}_pct_ceiling"] = (100.0 * row[f"{op}_physical_gbps"] / ceil_gbps
                                                        if ceil_gbps and row[f"{op}_physical_gbps"] else None)
                        best_d, row["best_baseline_dispatch"] = best_baseline(bl, lname, "dispatch")
                        best_c, row["best_baseline_combine"] = best_baseline(bl, lname, "combine")
                        row["baseline_dtype"] = dname
                        row["dispatch_speedup_vs_best_baseline"] = (best_d / r["dispatch_us"]
                                                                    if best_d and r["dispatch_us"] > 0 else None)
                        row["combine_speedup_vs_best_baseline"] = (best_c / r["combine_us"]
                                                                   if best_c and r["combine_us"] > 0 else None)
                        results["runs"].append(row)
                        rows.append(row)
                        cfgs = (f"tokens={N} hidden={H} topk={K} experts={E} dtype={dname} layout={lname} A={A} "
                                f"ranks={R} sms={row['sms']} rows by {path_v}")
                        chk = r.get("check")
                        pc = lambda v: "n/a" if v is None else f"{v:.0f}%"  # noqa: E731
                        sp = lambda v: "n/a" if v is None else f"{v:.1f}x"  # noqa: E731
                        log(f"config: {cfgs} | ours dispatch {r['dispatch_us']:.1f} us "
                            f"({C.fmt_value(row['dispatch_logical_gbps'])} GB/s logical, "
                            f"{C.fmt_value(row['dispatch_physical_gbps'])} GB/s physical = "
                            f"{pc(row['dispatch_pct_ceiling'])} of the NVLink ceiling, "
                            f"{sp(row['dispatch_speedup_vs_best_baseline'])} vs best {dname} baseline "
                            f"{row['best_baseline_dispatch']}) | combine "
                            f"{r['combine_us']:.1f} us ({C.fmt_value(row['combine_logical_gbps'])} GB/s logical, "
                            f"{C.fmt_value(row['combine_physical_gbps'])} GB/s physical = "
                            f"{pc(row['combine_pct_ceiling'])}, "
                            f"{sp(row['combine_speedup_vs_best_baseline'])} vs best baseline "
                            f"{row['best_baseline_combine']})"
                            + (f" | check {'OK' if chk['ok'] else 'FAILED ' + str(chk)}" if chk else ""))
                del inputs
    ctx.check()  # raises a device-recorded error (timeout, bad input) that the timings could hide
    if ARGS.cuda_graphs:
        results["graph_captures"] = ctx.graph_captures()
        log(f"EP calls captured into CUDA graphs: {results['graph_captures']}")
    ctx.close()

    t = C.Table([("tokens", "tok"), ("dtype", "dtype"), ("layout", "layout"), ("sms", "SMs"),
                 ("dispatch_path", "rows by"),
                 ("dispatch_us", "disp us", ".1f"), ("dispatch_physical_gbps", "disp phys GB/s", ".0f"),
                 ("dispatch_pct_ceiling", "% ceil", ".0f"), ("dispatch_speedup_vs_best_baseline", "x base", ".1f"),
                 ("combine_us", "comb us", ".1f"), ("combine_physical_gbps", "comb phys GB/s", ".0f"),
                 ("combine_pct_ceiling", "% ceil", ".0f"), ("combine_speedup_vs_best_baseline", "x base", ".1f"),
                 ("dispatch_logical_gbps", "disp log GB/s", ".0f"), ("best_baseline_dispatch", "best base disp"),
                 ("best_baseline_combine", "best base comb")],
                title=f"EP dispatch/combine, {R} ranks, hidden {H}, top-{K}, {E} experts"
                      + (f", NVLink ceiling {ceil_gbps:.0f} GB/s per direction, both ways busy (same run)"
                         if ceil_gbps else ""))
    for row in rows:
        t.add(row)
    if jax.process_index() == 0:
        t.print()
    if ARGS.loop_hlo:
        loops = {f"ours {r['tokens']} {r['dtype']} {r['layout']} sms={r['num_sms_attr']}": r.get("loop_collectives")
                 for r in rows}
        for n, per in results["baselines_by_dtype"].items():
            for dn, bl in per.items():
                loops.update({f"baseline {k} {n} {dn}": b.get("loop_collectives") for k, b in bl.items()
                              if b.get("supported")})
        with_ar = sorted(k for k, v in loops.items() if v and any(c.get("all-reduce", 0) for c in v.values()))
        results["loops_with_all_reduce"] = with_ar
        log(f"bench_ep: timed loops with an all-reduce in their compiled HLO: {with_ar or 'none'} "
            f"({len(loops)} loop pairs inspected)")
    checks = [r["check"]["ok"] for r in rows if "check" in r]
    ok = all(checks) if checks else True
    log(f"bench_ep: correctness checks {'all passed' if ok else 'FAILED'} ({len(checks)} configs)")
    if ARGS.out and jax.process_index() == 0:
        C.write_json(ARGS.out, results)
        log(f"bench_ep: wrote {ARGS.out}")
    if LAUNCH is not None:
        emit_result(dict(ok=ok, runs=len(rows)))
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------- one rank
def one_rank_main():
    """One device, one rank: jitted dispatch + combine per call (one fori_loop step: combine(dispatch(x)) feeds the
    next call's x) for our one-rank path (expand and non-expand; EPConfig.one_rank='local', the default, its guard
    calls included), the native kernels forced on the same context kind (EPConfig.one_rank='kernels'), and the
    plain-JAX permute (_baselines.local_permute_dispatch / _combine: argsort
    by expert, take, weighted segment_sum), all in the same run. Per call = the slope between loops of --loop and 3x --loop calls (_common.time_per_call).

    HBM floor = the bytes a permute must move / the same run's HBM bandwidth (read + write counted: an in-place
    streaming kernel over 1 GiB, _ceilings.local_d2d_ceiling). Bytes per call: dispatch reads the N token rows and writes the received rows (non-expand:
    tokens with an expert; expand: routed (token, k) entries), combine reads those rows and writes N rows.
    Correctness: our combined_x equals the native path's bit for bit (both layouts), printed per shape. CUDA: our
    path is timed a second time on a context with cuda_graphs=True (guards as graph targets: XLA may capture the
    whole loop), checked the same way."""
    dev = jax.devices()[:1]
    mesh = jax.make_mesh((1,), (AX,), devices=dev)
    platform = dev[0].platform
    shapes = ONE_RANK_SMOKE if ARGS.smoke else ONE_RANK_SHAPES
    n1, n2 = (ARGS.loop, 3 * ARGS.loop) if ARGS.smoke else (20, 60)
    iters, warmup = (ARGS.iters, ARGS.warmup) if ARGS.smoke else (5, 1)
    results = dict(env=C.env_info(), args=C.shown_args(ARGS),
                   one_rank=[])  # no machine paths in the JSON
    log(f"bench_ep --one-rank: 1 {platform} device ({results['env'].get('device_kind')}), jax {jax.__version__}")

    # HBM bandwidth, read + write counted: an in-place streaming kernel over a large array (_ceilings), same run
    nbytes = (1 << 22) if ARGS.smoke else (1 << 30)
    hbm = CE.local_d2d_ceiling(nbytes, device=0, warmup=warmup, iters=iters)
    bw = hbm["kernel"]["rw_gbps"]
    log(f"config: HBM bandwidth {bw:.0f} GB/s (read + write; {hbm['kernel']['name']} on {nbytes >> 20} MiB, "
        f"x ^ const streamed in place)")
    results["hbm_rw_gbps"] = bw

    ctx = jax_engram.init(mesh, AX)  # the one-rank path (EPConfig.one_rank="local", the default)
    ctx_native = jax_engram.init(mesh, AX, ep_config=jax_engram.EPConfig(one_rank="kernels"))  # the native kernels
    # CUDA: the one-rank path again with cuda_graphs=True (its guards are graph targets, so XLA may capture the whole
    # loop into one command buffer); on CPU the option changes nothing, so the variant is left out there
    ctx_graphs = jax_engram.init(mesh, AX, cuda_graphs=True) if platform != "cpu" else None
    rows = []
    for N, H, K, E in shapes:
        x, tk, w = B.make_moe_inputs(mesh, N, H, K, E, jnp.bfloat16, seed=N + 7)
        inputs = jax.block_until_ready((x, tk, w))
        valid = np.asarray(tk) >= 0
        tokens_with_expert, entries = int(valid.any(axis=1).sum()), int(valid.sum())
        row_b = H * 2

        # the receive rows pass an optimization barrier before the combine in every variant: each materializes
        # its dispatch output, as it would with the expert GEMMs in between (XLA could otherwise fuse the gathers)
        def ours(c, expand):
            def step(x, tk, w):
                r = jax_engram.dispatch(x, tk, w, ctx=c, num_experts=E, max_tokens_per_rank=N, expand=expand)
                return jax_engram.combine(lax.optimization_barrier(r.recv_x), r.handle).combined_x
            return step

        def permute(x, tk, w):
            rows, tok, wr = B.local_permute_dispatch(x, tk, w, E)
            return B.local_permute_combine(lax.optimization_barrier(rows), tok, wr, N)

        variants = [("ours expand", ours(ctx, True), True), ("ours non-expand", ours(ctx, False), False),
                    ("native expand", ours(ctx_native, True), True),
                    ("native non-expand", ours(ctx_native, False), False), ("plain-JAX permute", permute, True)]
        if ctx_graphs is not None:
            variants[2:2] = [("ours expand, cuda_graphs", ours(ctx_graphs, True), True),
                             ("ours non-expand, cuda_graphs", ours(ctx_graphs, False), False)]
        by_name = {name: f for name, f, _ in variants}
        one = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AX),) * 3, out_specs=P(AX)))  # noqa: E731
        check = {}
        for layout in ("expand", "non-expand"):
            want = np.asarray(one(by_name[f"native {layout}"])(*inputs)).view(np.uint16)
            for name in (f"ours {layout}", f"ours {layout}, cuda_graphs"):
                if name in by_name:
                    got = np.asarray(one(by_name[name])(*inputs)).view(np.uint16)
                    check[name.replace("ours ", "")] = bool(np.array_equal(got, want))
        timed = {}
        for name, f, expand in variants:
            def make(n, f=f):
                def loop(x, tk, w):
                    return lax.fori_loop(0, n, lambda i, v: f(v, tk, w), x)
                return one(loop)
            t = C.time_per_call(make, inputs, n1, n2, warmup=warmup, iters=iters)
            if ARGS.profile:  # PROFILE_CALLS single calls: which kernels the op is made of
                single = one(f)
                jax.block_until_ready(single(*inputs))
                tag = f"{N}x{H}_" + name.replace(",", "").replace(" ", "_").replace("-", "_")
                with jax.profiler.trace(os.path.join(ARGS.profile, tag), create_perfetto_trace=True):
                    for _ in range(PROFILE_CALLS):
                        jax.block_until_ready(single(*inputs))
            moved = 2 * row_b * (N + (entries if expand else tokens_with_expert))
            floor_us = moved / (bw * 1e9) * 1e6
            timed[name] = t["median_us"]
            row = dict(tokens=N, hidden=H, topk=K, experts=E, variant=name, us=t["median_us"], bytes=moved,
                       floor_us=floor_us, pct_floor=100.0 * floor_us / t["median_us"], timing=t)
            rows.append(row)
            results["one_rank"].append(row)
        base = timed["plain-JAX permute"]
        for row in rows[-len(variants):]:
            row["vs_permute"] = base / row["us"]
            log(f"config: tokens={N} hidden={H} topk={K} experts={E} | {row['variant']}: {row['us']:.1f} us per "
                f"dispatch+combine, {row['pct_floor']:.0f}% of the HBM floor ({row['floor_us']:.1f} us for "
                f"{row['bytes'] / 1e6:.1f} MB), {row['vs_permute']:.2f}x vs plain-JAX permute ({base:.1f} us)")
        log(f"config: tokens={N} hidden={H} topk={K} experts={E} | combined_x ours == native bit for bit: {check}")
        results.setdefault("checks", {})[f"{N}x{H} top{K} E{E}"] = check
        if ctx_graphs is not None:
            log(f"config: tokens={N} hidden={H} topk={K} experts={E} | cuda_graphs context, EP calls captured so far: "
                f"{ctx_graphs.graph_captures()}")
        del inputs, x, tk, w
    ctx_native.close()
    ctx.close()
    if ctx_graphs is not None:
        ctx_graphs.close()
    t = C.Table([("tokens", "tok"), ("hidden", "hidden"), ("topk", "K"), ("experts", "E"), ("variant", "variant"),
                 ("us", "us/call", ".1f"), ("floor_us", "floor us", ".1f"), ("pct_floor", "% floor", ".0f"),
                 ("vs_permute", "x permute", ".2f")],
                title=f"one rank: dispatch + combine per call, HBM floor at {bw:.0f} GB/s (same run)")
    for row in rows:
        t.add(row)
    t.print()
    ok = all(v for c in results["checks"].values() for v in c.values())
    log(f"bench_ep --one-rank: ours == native {'in every shape' if ok else 'FAILED'}")
    if ARGS.out:
        C.write_json(ARGS.out, results)
        log(f"bench_ep: wrote {ARGS.out}")
    return 0 if ok else 1


if __name__ == "__main__" and ARGS.one_rank:
    rc = one_rank_main()
    shutdown()
    sys.exit(rc)

if __name__ == "__main__":
    rc = main()
    shutdown()
    sys.exit(rc)
