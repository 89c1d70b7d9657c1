"""Bad input to dispatch / combine on a flat 4-rank group and on a 2 x 2 ("node", "gpu") group of the same CPU
devices: every mistake must be refused with the same message on both (the arguments are checked once, in
jax_engram._ep_args, before the path is chosen), and the context must stay usable. Prints one JSON line
``RESULT {"cases": {name: {"flat": message, "hier": message}}, "usable": {...}}``.

Run: python tests/workers/ep_args_check.py   (4 CPU devices in one process)
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import jax_engram as je
except ModuleNotFoundError:  # run straight from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax_engram as je

from _harness import group_meshes  # noqa: E402

R, M, H, E, K = 4, 8, 16, 8, 2
devs = jax.devices()[:R]
GROUPS = group_meshes(devs)
bf, f32, i32, fp8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.float8_e4m3fn


def good_dispatch(ctx, x, i, **kw):
    return je.dispatch(x, i, ctx=ctx, num_experts=E, max_tokens_per_rank=M, **kw)


# name -> (fn(ctx, x, i) run per rank, x shape/dtype, topk_idx shape/dtype)
CASES = {
    "topk_idx_float": (lambda c, x, i: good_dispatch(c, x, i).recv_x, ((M, H), bf), ((M, K), f32)),
    "topk_idx_shape": (lambda c, x, i: good_dispatch(c, x, i).recv_x, ((M, H), bf), ((M - 1, K), i32)),
    "topk_too_large": (lambda c, x, i: je.dispatch(x, i, ctx=c, num_experts=64 * R, max_tokens_per_rank=M).recv_x,
                       ((M, H), bf), ((M, 33), i32)),
    "x_dtype": (lambda c, x, i: good_dispatch(c, x, i).recv_x, ((M, H), jnp.int32), ((M, K), i32)),
    "x_rank": (lambda c, x, i: good_dispatch(c, x.reshape(-1), i).recv_x, ((M, H), bf), ((M, K), i32)),
    "experts_not_multiple": (lambda c, x, i: je.dispatch(x, i, ctx=c, num_experts=E + 1,
                                                         max_tokens_per_rank=M).recv_x, ((M, H), bf), ((M, K), i32)),
    "experts_over_limit": (lambda c, x, i: je.dispatch(x, i, ctx=c, num_experts=257 * R,
                                                       max_tokens_per_rank=M).recv_x, ((M, H), bf), ((M, K), i32)),
    "tokens_over_max": (lambda c, x, i: good_dispatch(c, x, i).recv_x, ((M + 1, H), bf), ((M + 1, K), i32)),
    "zero_padding_without_expand": (lambda c, x, i: good_dispatch(c, x, i, zero_padding=True).recv_x,
                                    ((M, H), bf), ((M, K), i32)),
    "fp8_without_scales": (lambda c, x, i: good_dispatch(c, x, i).recv_x, ((M, H), fp8), ((M, K), i32)),
    "scales_dtype": (lambda c, x, i: good_dispatch(c, x, i, x_scales=jnp.zeros((M, 1), bf)).recv_x,
                     ((M, H), fp8), ((M, K), i32)),
    "scales_shape": (lambda c, x, i: good_dispatch(c, x, i, x_scales=jnp.zeros((M + 1, 1), f32)).recv_x,
                     ((M, H), fp8), ((M, K), i32)),
    "weights_dtype": (lambda c, x, i: good_dispatch(c, x, i, topk_weights=jnp.zeros((M, K), bf)).recv_x,
                      ((M, H), bf), ((M, K), i32)),
    "weights_shape": (lambda c, x, i: good_dispatch(c, x, i, topk_weights=jnp.zeros((M, K + 1), f32)).recv_x,
                      ((M, H), bf), ((M, K), i32)),
    "num_experts_not_int": (lambda c, x, i: je.dispatch(x, i, ctx=c, num_experts=8.0, max_tokens_per_rank=M).recv_x,
                            ((M, H), bf), ((M, K), i32)),
    "after_not_scalar": (lambda c, x, i: good_dispatch(c, x, i, after=jnp.zeros((2,), f32)).recv_x,
                         ((M, H), bf), ((M, K), i32)),
    "cached_other_expand": (lambda c, x, i: good_dispatch(c, x, None, handle=good_dispatch(c, x, i).handle,
                                                          expand=True).recv_x, ((M, H), bf), ((M, K), i32)),
    "cached_without_routing": (lambda c, x, i: good_dispatch(c, x, None).recv_x, ((M, H), bf), ((M, K), i32)),
    "combine_rows": (lambda c, x, i: je.combine(x, good_dispatch(c, x, i).handle).combined_x,
                     ((M, H), bf), ((M, K), i32)),
    "combine_dtype": (lambda c, x, i: je.combine(good_dispatch(c, x, i).recv_x.astype(jnp.float16),
                                                 good_dispatch(c, x, i).handle).combined_x,
                      ((M, H), bf), ((M, K), i32)),
    "combine_handle": (lambda c, x, i: je.combine(x, None).combined_x, ((M, H), bf), ((M, K), i32)),
    "combine_bias_shape": (lambda c, x, i: je.combine(*(lambda d: (d.recv_x, d.handle))(good_dispatch(c, x, i)),
                                                      bias=jnp.zeros((M, H + 1), bf)).combined_x,
                           ((M, H), bf), ((M, K), i32)),
    "combine_bias_dtype": (lambda c, x, i: je.combine(*(lambda d: (d.recv_x, d.handle))(good_dispatch(c, x, i)),
                                                      bias=jnp.zeros((M, H), f32)).combined_x,
                           ((M, H), bf), ((M, K), i32)),
    "combine_three_biases": (lambda c, x, i: je.combine(*(lambda d: (d.recv_x, d.handle))(good_dispatch(c, x, i)),
                                                        bias=(jnp.zeros((M, H), bf),) * 3).combined_x,
                             ((M, H), bf), ((M, K), i32)),
    "combine_weights_shape": (lambda c, x, i: je.combine(
        *(lambda d: (d.recv_x, d.handle))(good_dispatch(c, x, i)), topk_weights=jnp.zeros((M, K), f32)).combined_x,
                              ((M, H), bf), ((M, K), i32)),
}
# On GPUs rows move in 16-byte vectors: traced with the context's platform set to "gpu" (nothing is lowered).
GPU_CASES = {
    "x_row_not_16_bytes": (lambda c, x, i: good_dispatch(c, x, i).recv_x, ((M, 7), bf), ((M, K), i32)),
}


def trace(ctx, mesh, axes, fn, x_sd, i_sd):
    spec = P(axes)
    sds = [jax.ShapeDtypeStruct((R * s[0][0],) + s[0][1:], s[1], sharding=NamedSharding(mesh, spec))
           for s in (x_sd, i_sd)]
    f = jax.jit(jax.shard_map(lambda x, i: fn(ctx, x, i), mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    try:
        f.trace(*sds)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def routing_error(ctx, mesh, axes, duplicate):
    """validate_routing=True with an out-of-range id (rank 3, token 5) and, with ``duplicate``, a repeated expert
    (rank 1, token 2: the lowest rank is reported)."""
    spec = P(axes)
    x = np.ones((R * M, H), np.float32).astype(jnp.bfloat16)
    idx = np.tile(np.array([[0, 1]], np.int32), (R * M, 1))
    idx[3 * M + 5] = [2, E]
    if duplicate:
        idx[1 * M + 2] = [3, 3]
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    f = jax.jit(jax.shard_map(lambda x, i: good_dispatch(ctx, x, i, validate_routing=True).recv_x, mesh=mesh,
                              in_specs=(spec, spec), out_specs=spec))
    try:
        jax.block_until_ready(f(put(x), put(idx)))
    except Exception as e:  # noqa: BLE001 - XLA's runtime error carrying ours
        m = re.search(r"\(validate_routing=True\): (topk_idx of [^\n]*)", str(e))
        # which rank's refusal surfaces first is up to the runtime: the offender as "rank r"
        return re.sub(r"this rank \((\d+)\)", r"rank \1", m.group(1)) if m else f"unexpected: {e}"
    return "no error"


def kernel_routing_error(mesh, axes, value):
    """Bad routing without validate_routing (found by the op itself, on a fresh context: it leaves the context
    unusable): rank 2, token 3, k 1 holds ``value`` ("dup": token 3 lists expert 0 twice). Returns the call's
    message from "topk_idx of" (the offender as "rank r", whichever rank raised first) or "no error"."""
    ctx = je.init(mesh, axes, timeout_s=60.0)
    try:
        spec = P(axes)
        x = np.ones((R * M, H), np.float32).astype(jnp.bfloat16)
        idx = np.tile(np.array([[0, 5]], np.int32), (R * M, 1))
        idx[2 * M + 3, 1] = 0 if value == "dup" else value
        put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        f = jax.jit(jax.shard_map(lambda x, i: good_dispatch(ctx, x, i).recv_x, mesh=mesh, in_specs=(spec, spec),
                                  out_specs=spec))
        try:
            jax.block_until_ready(f(put(x), put(idx)))
        except Exception as e:  # noqa: BLE001 - XLA's runtime error carrying ours
            m = re.search(r"jax_engram ep dispatch on rank \d+ of context \d+ [^:]*: (topk_idx of [^,]*, token \d+, "
                          r"(holds expert id|lists expert) [^(]*)", str(e))
            return re.sub(r"this rank \((\d+)\)", r"rank \1", m.group(1)).strip() if m else f"unexpected: {e}"
        return "no error"
    finally:
        ctx.close()


def still_usable(ctx, mesh, axes):
    """A good dispatch + combine after the refusals: bit-exact round trip of every routed row."""
    spec = P(axes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R * M, H)).astype(jnp.bfloat16)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * M)]).astype(np.int32)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731

    def body(x, i):
        d = good_dispatch(ctx, x, i)
        return je.combine(d.recv_x, d.handle).combined_x

    out = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(put(x), put(idx)))
    # each token reaches K distinct experts; combine sums one copy per distinct destination rank
    ranks = idx // (E // R)
    copies = np.array([len(set(r)) for r in ranks.tolist()], np.float32)
    want = (np.asarray(x, np.float32) * copies[:, None]).astype(jnp.bfloat16)
    return bool(np.array_equal(out.view(np.uint16), want.view(np.uint16)))


cases: dict[str, dict[str, str]] = {}
usable: dict[str, bool] = {}
for group, (mesh, axes) in GROUPS.items():
    ctx = je.init(mesh, axes, timeout_s=60.0)
    try:
        for name, (fn, x_sd, i_sd) in CASES.items():
            cases.setdefault(name, {})[group] = trace(ctx, mesh, axes, fn, x_sd, i_sd)
        inner = getattr(ctx, "inner", ctx)
        for name, (fn, x_sd, i_sd) in GPU_CASES.items():
            saved = (ctx.platform, inner.platform)
            ctx.platform = inner.platform = "gpu"
            try:
                cases.setdefault(name, {})[group] = trace(ctx, mesh, axes, fn, x_sd, i_sd)
            finally:
                ctx.platform, inner.platform = saved
        for name, duplicate in (("validate_routing_out_of_range", False), ("validate_routing_duplicate", True)):
            cases.setdefault(name, {})[group] = routing_error(ctx, mesh, axes, duplicate)
        usable[group] = still_usable(ctx, mesh, axes)
    finally:
        ctx.close()
kernel_routing: dict[str, dict[str, str]] = {}
for group, (mesh, axes) in GROUPS.items():
    for name, value in (("below_minus_one", -7), ("at_num_experts", E), ("duplicate", "dup")):
        kernel_routing.setdefault(name, {})[group] = kernel_routing_error(mesh, axes, value)
print("RESULT " + json.dumps({"cases": cases, "usable": usable, "kernel_routing": kernel_routing}), flush=True)
