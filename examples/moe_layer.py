"""A small expert-parallel MoE layer on jax_engram: router top-k -> dispatch(expand) -> ragged_dot -> combine.

This file builds the layer from the primitives, to show how they fit together; the library ships the same
layer ready to use: ``jax_engram.moe_layer`` (functional, on global arrays) and ``jax_engram.nn.MoE`` (Flax
NNX). ``check_against_reference`` also checks ``jax_engram.moe_layer`` against this file's layer.

Inside ``jax.shard_map`` over the expert-parallel axis every rank holds ``num_experts / R`` experts and its
own tokens. The dispatch's expand layout is GEMM-ready: rows are grouped per local expert (``group_sizes``,
alignment included), so the experts run as two ``jax.lax.ragged_dot`` calls. combine is an UNWEIGHTED sum,
so the layer multiplies each expert output row by its routing weight (``recv_topk_weights``) before it.

The same layer is written twice more for checking:
* :func:`moe_layer_reference` on the global view with :mod:`jax_engram.reference` (same numerics),
* :func:`moe_layer_dense`, the textbook definition ``out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t])``.

Run: ``python examples/moe_layer.py [--devices 4] [--tokens 64]`` (CPU devices by default) prints the
forward / gradient differences against both and exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def init_params(seed: int, *, hidden: int, ffn: int, num_experts: int):
    rng = np.random.default_rng(seed)
    return {
        "router": (rng.standard_normal((hidden, num_experts)) / np.sqrt(hidden)).astype(np.float32),
        "w_up": (rng.standard_normal((num_experts, hidden, ffn)) / np.sqrt(hidden)).astype(np.float32),
        "w_down": (rng.standard_normal((num_experts, ffn, hidden)) / np.sqrt(ffn)).astype(np.float32),
    }


def route(router, x, top_k: int, num_tokens=None):
    """Softmax router, top-k, renormalised weights. Tokens >= num_tokens (padding) route nowhere (-1)."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(x.astype(jnp.float32) @ router, axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    if num_tokens is not None:
        real = (jnp.arange(x.shape[-2]) < num_tokens)[..., :, None]
        idx = jnp.where(real, idx, -1)
        w = jnp.where(real, w, 0.0)
    return idx.astype(jnp.int32), w


def experts(recv_x, w_up, w_down, group_sizes):
    """The local experts on the expand layout (f32 math): gelu(x @ W_up[e]) @ W_down[e] per segment."""
    import jax
    import jax.numpy as jnp

    h = jax.lax.ragged_dot(recv_x.astype(jnp.float32), w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.gelu(h), w_down, group_sizes)


def moe_layer(params, x, *, ctx, num_experts: int, top_k: int, max_tokens_per_rank: int,
              expert_alignment: int = 8, num_tokens=None):
    """Per-rank MoE layer (call inside shard_map over ctx's axis). params: router replicated, w_up / w_down
    the LOCAL experts [E_loc, ...]. x: [N, H] bf16 or f32; num_tokens: real tokens (device scalar) or None."""
    import jax.numpy as jnp

    import jax_engram as je

    idx, w = route(params["router"], x, top_k, num_tokens)
    res = je.dispatch(x, idx, w, ctx=ctx, num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                      expand=True, expert_alignment=expert_alignment, zero_padding=True)
    y = experts(res.recv_x, params["w_up"], params["w_down"], res.group_sizes)
    y = y * res.recv_topk_weights[:, None]  # combine is an unweighted sum: apply the routing weights here
    return je.combine(y.astype(x.dtype), res.handle).combined_x


def moe_layer_reference(params, x, *, num_experts: int, top_k: int, max_tokens_per_rank: int,
                        expert_alignment: int = 8, num_tokens=None):
    """Global-view twin of :func:`moe_layer` on jax_engram.reference. x: [R, N, H] bf16; params: global."""
    import jax
    import jax.numpy as jnp

    from jax_engram import reference as ref

    R = x.shape[0]
    E_loc = num_experts // R
    idx, w = route(params["router"], x, top_k, None if num_tokens is None else num_tokens[:, None])
    d = ref.ep_dispatch(x, idx, w, num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank, expand=True,
                        expert_alignment=expert_alignment, zero_padding=True)
    w_up = params["w_up"].reshape((R, E_loc) + params["w_up"].shape[1:])
    w_down = params["w_down"].reshape((R, E_loc) + params["w_down"].shape[1:])
    y = jax.vmap(experts)(d["recv_x"], w_up, w_down, d["group_sizes"])
    y = y * d["recv_topk_weights"][..., None]
    out, _ = ref.ep_combine(y.astype(x.dtype), d, idx, num_experts=num_experts,
                            max_tokens_per_rank=max_tokens_per_rank, expand=True)
    return out


def moe_layer_dense(params, x, *, num_experts: int, top_k: int, num_tokens=None, **_):
    """Textbook MoE on the global view (any dtype, f32 math): out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t])."""
    import jax
    import jax.numpy as jnp

    idx, w = route(params["router"], x, top_k, None if num_tokens is None else num_tokens[:, None])
    xf = x.astype(jnp.float32)
    h = jax.nn.gelu(jnp.einsum("rnh,ehf->rnef", xf, params["w_up"]))
    y = jnp.einsum("rnef,efh->rneh", h, params["w_down"])                      # every expert on every token
    sel = jax.nn.one_hot(jnp.maximum(idx, 0), num_experts) * (idx >= 0)[..., None]  # [R, N, K, E]
    out = jnp.einsum("rnke,rnk,rneh->rnh", sel, w, y)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------------------------ checking
def check_against_reference(ctx, mesh, *, dtype: str = "float32", tol: float = 2e-5, seed: int = 0,
                            tokens: int = 16, hidden: int = 32, ffn: int = 48, experts_per_rank: int = 2,
                            top_k: int = 3, alignment: int = 8, verbose: bool = False):
    """Forward and gradients (x, router, w_up, w_down) of :func:`moe_layer` against the global twins.

    float32: against :func:`moe_layer_dense` (tolerance tol, relative to each array's scale).
    bfloat16: against :func:`moe_layer_reference` (same numerics: forward within one bf16 ulp-level tol,
    gradients within tol). Returns (ok, detail)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    R = mesh.shape[ctx.axis_name]
    E = experts_per_rank * R
    M = tokens
    ax = ctx.axis_name
    params = init_params(seed, hidden=hidden, ffn=ffn, num_experts=E)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((R, M, hidden)).astype(np.float32).astype(jnp.dtype(dtype))
    ct = rng.standard_normal((R, M, hidden)).astype(np.float32)
    ntok = np.array([max(1, M - 3 * r) for r in range(R)], np.int32)  # ragged ranks
    cfg = dict(num_experts=E, top_k=top_k, max_tokens_per_rank=M, expert_alignment=alignment)

    def put(a, spec):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    gparams = {"router": put(params["router"], P()), "w_up": put(params["w_up"], P(ax)),
               "w_down": put(params["w_down"], P(ax))}

    def ours(p, x, ct, n):
        def body(p, x, ct, n):
            out = moe_layer(p, x[0], ctx=ctx, num_tokens=n[0], **cfg)
            return out[None], jax.lax.psum(jnp.sum(out.astype(jnp.float32) * ct[0]), ax)
        f = jax.shard_map(body, mesh=mesh, in_specs=({"router": P(), "w_up": P(ax), "w_down": P(ax)}, P(ax), P(ax),
                                                     P(ax)), out_specs=(P(ax), P()))
        out, loss = f(p, x, ct, n)
        return loss, out

    def theirs(p, x, ct, n):
        twin = moe_layer_reference if dtype == "bfloat16" else moe_layer_dense
        out = twin(p, x, num_tokens=n, **cfg)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (l1, o1), g1 = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(
        gparams, put(x, P(ax)), put(ct, P(ax)), put(ntok, P(ax)))
    (l2, o2), g2 = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1), has_aux=True))(params, x, ct, ntok)

    def host(a):
        if a.is_fully_addressable:
            return np.asarray(a)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    errs = []

    def cmp(name, a, b, t):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        scale = max(float(np.abs(b).max()), 1e-6)
        err = float(np.abs(a - b).max()) / scale
        if verbose:
            print(f"  {name:10s} max |diff| / max |ref| = {err:.2e}   (max |ref| = {scale:.3g})")
        if not err <= t:
            errs.append(f"{name}: relative error {err:.2e} > {t:.0e}")

    # The packaged layer (je.moe_layer, gelu experts, same routing) on the same input, all tokens real.
    import jax_engram as je

    xs = put(x.reshape(R * M, hidden), P(ax))
    packaged = jax.jit(lambda p, x: je.moe_layer(p, x, ctx=ctx, top_k=top_k, expert_alignment=alignment))(gparams, xs)
    mine = jax.jit(jax.shard_map(lambda p, x: moe_layer(p, x, ctx=ctx, **cfg), mesh=mesh,
                                 in_specs=({"router": P(), "w_up": P(ax), "w_down": P(ax)}, P(ax)),
                                 out_specs=P(ax)))(gparams, xs)
    if not np.array_equal(host(packaged).astype(np.float32), host(mine).astype(np.float32)):
        errs.append("je.moe_layer differs from this example's layer")
    elif verbose:
        print("  je.moe_layer == this example's layer (bit for bit)")

    fwd_tol = tol if dtype == "float32" else 1e-2
    cmp("forward", host(o1), o2, fwd_tol)
    cmp("loss", float(np.asarray(l1.addressable_data(0))), float(l2), fwd_tol)
    cmp("d x", host(g1[1]), g2[1], tol)
    for k in ("router", "w_up", "w_down"):
        cmp(f"d {k}", host(g1[0][k]), g2[0][k], tol)
    return not errs, "; ".join(errs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=2, help="CPU devices when running on CPU (single process)")
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="float32: against the dense textbook layer; bfloat16: against jax_engram.reference")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    import jax

    try:
        import jax_engram as je
    except ModuleNotFoundError:  # run from a source checkout that is not installed
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import jax_engram as je
    from jax_engram._jax_private import backends_initialized

    if a.platform == "cpu" and not backends_initialized():  # else: called from a running job
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", a.devices)

    devs = jax.devices()
    mesh = jax.make_mesh((len(devs),), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    ok_all = True
    with je.init(mesh, "ep") as ctx:
        tols = {"float32": 2e-5, "bfloat16": 3e-2}
        for dtype in a.dtypes.split(","):
            tol = tols[dtype]
            if not a.quiet:
                print(f"MoE layer on {len(devs)} {devs[0].platform} ranks, {dtype}, {a.tokens} tokens/rank:")
            ok, detail = check_against_reference(ctx, mesh, dtype=dtype, tol=tol, tokens=a.tokens,
                                                 verbose=not a.quiet)
            ok_all &= ok
            print(f"{'PASS' if ok else 'FAIL'} moe_layer {dtype} {detail}".rstrip())
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
