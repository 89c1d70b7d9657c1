"""The one-rank EP path: dispatch / combine of a flat context of ONE rank as a local permutation in plain JAX.

At one rank nothing crosses a link: every token's destination is the rank itself, so dispatch is a gather of x's
rows into the documented receive layout and combine a gather (non-expand) or a gather-and-sum (expand) back. This
module computes exactly the layouts, handle fields and sums of docs/semantics.md ("MoE dispatch", "MoE combine",
"Gradients") with sorts, prefix sums, gathers and scatters of static worst-case shapes: no staging region (the
context's memory needs do not change), no host synchronisation, no recompilation when counts change.

The contract the kernels enforce holds here too, through one small native call per op, the guard
(``jax_engram_ep_guard``: ffi/handlers cpu_ep.cc / cuda_ep.cc, the check in ffi/kernels cpu/ep.cc / cuda/ep_guard.cu):
its handler refuses a closed context or one with a recorded error, as every EP handler does, and a fresh dispatch's
guard checks topk_idx as the dispatch kernels do (an id outside ``[-1, num_experts)``, an expert listed twice in a
token) and records the first bad entry in the context exactly as they do: the same error, reported the same way
(CPU: the call fails with it; CUDA: the next op of the context or ``ctx.check()``), and the context is unusable
after it. The backward pass has guards in the places of the kernels' backward ops. The guard is a side-effecting
custom call on the op's token (XLA never drops it, and it keeps its place in the chain of the context's ops); a fresh
dispatch computes its layout from the guard's copy of topk_idx, so none of it runs before the check. The guards of
cached dispatch and combine check only the context, at their handler, which fails the whole call wherever XLA
places it.

``dispatch_p`` and ``combine_p`` take and return exactly what the native calls of :mod:`jax_engram._ep_flat` do,
so the flat path (after :mod:`jax_engram._ep_args` validated the arguments once) calls one or the other; the
choice is made per context (:func:`applies`), so the handles of one context always come from one path. The
handle's fields are the native path's, so either path could read the other's handles, but nothing mixes them.

Numerics (bit for bit the native path's): rows are moved as their bit patterns (NaN payloads, subnormals and -0.0
kept); every sum is a left fold in float32 from -0.0 over the terms in the documented order, rounded once per
level to y's dtype (``reduce_precision`` between levels, which XLA must keep), and a lone term without bias is
copied, not summed, as the CPU and CUDA kernels do.

Differences from the native path, all in what the contract leaves open: rows past the real counts are zero (x,
scales, weights) or -1 (indices, metadata), as on CPU; the outputs of a call whose routing the guard refuses are
unspecified (CUDA; on CPU the call fails). The handle's arrays are not checked again by cached dispatch and combine
(the kernels check their ranges): a handle that does not come from this context's dispatch gives unspecified
results instead of an error.
Inputs and outputs pass an ``optimization_barrier``, as a kernel's would be an op boundary: the caller's arithmetic
is not fused into the op, the results are materialized, and the output token (the input token) comes after them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import _call

_NEG_ZERO = -0.0  # the exact additive identity: -0.0 + v == v for every v, so a fold may start from it
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def applies(ctx, ep_config) -> bool:
    """Whether the EP ops of this flat context take the one-rank path: one rank and ``EPConfig.one_rank ==
    "local"`` (the default; ``ctx._ep_local = False`` forces the native kernels even then)."""
    return ctx.num_ranks == 1 and ep_config.one_rank == "local" and getattr(ctx, "_ep_local", True)


def _guard(cfg, token, topk_idx=None, *, combine: bool):
    """(token, topk_idx) after the context's guard (see the module docstring). The token comes back in its own buffer
    once the guard's handler accepted the context; ``topk_idx`` [N, K] (a fresh dispatch's routing) comes back as
    the copy the guard's check wrote, which the layout is computed from (None without routing). ``combine``: the op
    the guard stands for (the name in its errors)."""
    ctx = cfg.ctx
    axes = ctx.axis_name
    token = _call.vary(token, axes)
    routing = _call.vary(topk_idx if topk_idx is not None else jnp.zeros((0, 0), jnp.int32), axes)
    token, checked = guard_call(ctx, token, routing, combine=combine, num_experts=cfg.num_experts, records=0)
    return token, (checked if topk_idx is not None else None)


def guard_call(ctx, token, operand, *, combine: bool, num_experts: int, records: int):
    """The context's guard (``jax_engram_ep_guard``, EpGuardAttrs) over ``operand`` (a routing [N, K], or a
    group's routing records with ``records`` 1 / 2); the token comes back in its own buffer. Returns (token, the
    guard's copy of the operand)."""
    graph = ctx.cuda_graphs and ctx.platform != "cpu"  # as the kernels: the graph target where XLA may capture it
    return _call.call(ctx, "jax_engram_ep_guard_graph" if graph else "jax_engram_ep_guard",
                      [_call.like(token), _call.like(operand)], token, operand, input_output_aliases={0: 0},
                      combine=combine, num_experts=num_experts, records=records)


# ------------------------------------------------------------------------------------------------- pieces
def _bits(a):
    return jax.lax.bitcast_convert_type(a, _BITS[np.dtype(a.dtype).itemsize])


def _take_rows(a, src):
    """Rows ``src`` of ``a`` ([n, ...]) moved as bits; an index outside ``[0, n)`` gives a zero row."""
    n = a.shape[0]
    ok = (src >= 0) & (src < n)
    if n == 0:
        return jnp.zeros(src.shape + a.shape[1:], a.dtype)
    u = _bits(a) if jnp.issubdtype(a.dtype, jnp.floating) else a
    got = u[jnp.clip(src, 0, n - 1)]
    got = jnp.where(ok.reshape(ok.shape + (1,) * (a.ndim - 1)), got, jnp.zeros((), got.dtype))
    return jax.lax.bitcast_convert_type(got, a.dtype) if got.dtype != a.dtype else got


def _align(v, a: int):
    return (v + a - 1) // a * a


def _fence(*trees):
    """The arrays of ``trees`` behind one optimization barrier: every one is computed before any is used, and XLA
    fuses nothing across it. On the inputs of an op, the caller's arithmetic is not fused into our gathers (where
    XLA could contract a multiply-add the caller's own program rounds twice); on the outputs, the results are
    materialized like a kernel's and the token comes after them (whatever waits for it waits for the op)."""
    return jax.lax.optimization_barrier(trees)


def _counts(cfg, valid, idx):
    """(count, aligned, start) per local expert: routed entries, align(count, A), segment start."""
    E = cfg.num_experts  # a one-hot sum, not a scatter-add: no atomics on a few hot counters
    count = jnp.sum(valid[:, :, None] & (idx[:, :, None] == jnp.arange(E, dtype=jnp.int32)), axis=(0, 1),
                    dtype=jnp.int32)
    aligned = _align(count, cfg.expert_alignment)
    start = jnp.cumsum(aligned, dtype=jnp.int32) - aligned
    return count, aligned, start


def _routing(cfg, topk_idx):
    """The layout of a fresh dispatch at one rank: the handle's arrays, the source token of every receive row
    (``N`` = none) and, expand, the source (token, k) entry ``t*K + k`` of every row (``N*K`` = none)."""
    N, K = topk_idx.shape
    M, E, rows = cfg.max_tokens_per_rank, cfg.num_experts, cfg.rows
    i32 = jnp.int32
    idx = topk_idx.astype(i32)
    valid = (idx >= 0) & (idx < E)
    kk = jnp.arange(K, dtype=i32)
    has_dest = jnp.any(valid, axis=1)                                            # [N]
    pos = jnp.cumsum(has_dest.astype(i32), dtype=i32) - 1
    num_recv = jnp.sum(has_dest, dtype=i32)
    dst_row = jnp.where(has_dest, pos, -1)[:, None]                             # [N, 1]
    tok_of_row = jnp.full((M,), N, i32).at[jnp.where(has_dest, pos, M)].set(jnp.arange(N, dtype=i32), mode="drop")
    master = jnp.max(jnp.where(valid, kk, -1), axis=1)                           # [N]
    count, aligned, start = _counts(cfg, valid, idx)

    if cfg.expand:
        key = jnp.where(valid, idx, E).reshape(-1)                               # [N*K], E = none
        order = jnp.argsort(key, stable=True).astype(i32)                        # by expert, then token
        skey = key[order]
        first = start if cfg.expert_alignment == 1 else jnp.cumsum(count, dtype=i32) - count  # unaligned starts
        e = jnp.minimum(skey, E - 1)
        j = jnp.arange(N * K, dtype=i32)
        row_sorted = jnp.where(skey < E, start[e] + j - first[e], -1)
        exp_row = jnp.full((N * K,), -1, i32).at[order].set(row_sorted, unique_indices=True).reshape(N, K)
        src_entry = jnp.full((rows,), N * K, i32).at[jnp.where(row_sorted >= 0, row_sorted, rows)].set(
            order, mode="drop")
        src_tok = jnp.where(src_entry < N * K, src_entry // K, N)
        meta_k = exp_row
        psum_expert = start + count
        recv_topk = jnp.full((0, K), -1, i32)
    else:
        src_entry = None
        src_tok = tok_of_row
        meta_k = jnp.full((N, K), -1, i32)
        psum_expert = jnp.cumsum(aligned, dtype=i32)
        recv_topk = _take_rows(jnp.where(valid, idx, -1), tok_of_row)
        recv_topk = jnp.where((tok_of_row < N)[:, None], recv_topk, -1)
    per_tok = jnp.concatenate([jnp.arange(N, dtype=i32)[:, None], master[:, None], meta_k], axis=1)  # [N, K+2]
    meta = jnp.where((tok_of_row < N)[:, None], _take_rows(per_tok, tok_of_row), -1)
    handle = (recv_topk, num_recv[None], psum_expert, count, meta, dst_row, num_recv, aligned)
    return handle, src_tok, src_entry


def _replay(cfg, meta, psum_rank):
    """The source token of every receive row (``N`` = none) and, expand, its (token, k) entry, from a handle."""
    N, K, rows, M = cfg.num_tokens, cfg.topk, cfg.rows, cfg.max_tokens_per_rank
    i32 = jnp.int32
    real = jnp.arange(M, dtype=i32) < psum_rank[-1]
    tok = jnp.where(real, meta[:, 0], N)                                         # gid = t at one rank
    if not cfg.expand:
        return tok, None
    r = meta[:, 2:]                                                              # [M, K]
    ok = real[:, None] & (r >= 0)
    entry = tok[:, None] * K + jnp.arange(K, dtype=i32)
    src_entry = jnp.full((rows,), N * K, i32).at[jnp.where(ok, r, rows).reshape(-1)].set(
        entry.reshape(-1), mode="drop")
    return jnp.where(src_entry < N * K, src_entry // K, N), src_entry


def _move(cfg, x, w, sf, src_tok, src_entry):
    """recv_x, recv_x_scales and recv_topk_weights of a layout (rows nobody fills are zero)."""
    N, K = w.shape
    recv_x = _take_rows(x, src_tok)
    recv_sf = _take_rows(sf, src_tok)
    if K == 0:
        recv_w = jnp.zeros((0,), jnp.float32)
    elif cfg.expand:
        recv_w = _take_rows(w.reshape(-1), src_entry)
    else:
        recv_w = _take_rows(w, src_tok)
    return recv_x, recv_sf, recv_w


# ------------------------------------------------------------------------------------------------ combine
def _round(acc, dtype):
    """acc (float32) rounded to dtype's precision, staying float32 (an op XLA keeps, unlike a convert pair)."""
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
        return jax.lax.reduce_precision(acc, exponent_bits=8, mantissa_bits=7)
    return acc


def _sum_rows(y, rows):
    """Per token the fold of ``y[rows[t, k]]`` over the k with ``rows >= 0`` (docs: expert side, expand):
    float32 from -0.0, rounded to y's dtype, a lone row copied, +0.0 without rows; as bits of y's dtype."""
    n = y.shape[0]
    ok = rows >= 0
    safe = jnp.clip(rows, 0, n - 1)
    acc = jnp.full((rows.shape[0], y.shape[1]), _NEG_ZERO, jnp.float32)
    lone = jnp.zeros((rows.shape[0], y.shape[1]), _BITS[y.dtype.itemsize])
    yb = _bits(y)
    for k in range(rows.shape[1]):  # ascending k: the documented order
        row = yb[safe[:, k]]
        acc = acc + jnp.where(ok[:, k, None], jax.lax.bitcast_convert_type(row, y.dtype).astype(jnp.float32),
                              _NEG_ZERO)
        lone = lone | jnp.where(ok[:, k, None], row, 0)
    nvalid = jnp.sum(ok, axis=1)[:, None]
    summed = jnp.where(nvalid == 0, 0, _bits(_round(acc, y.dtype).astype(y.dtype)))  # no row: +0.0
    return jnp.where(nvalid == 1, lone, summed)


def _combine(cfg, y, w, biases, meta, dst_row, topk_idx):
    """combined_x and combined_topk_weights at one rank (docs: "MoE combine"), meta / dst_row / topk_idx from
    the handle."""
    N, K, E = cfg.num_tokens, cfg.topk, cfg.num_experts
    rows_tok = meta.shape[0]
    i = dst_row[:, 0]                                                            # my token's receive row or -1
    has = i >= 0
    i_safe = jnp.clip(i, 0, rows_tok - 1)
    if cfg.expand:
        exp_rows = jnp.where(has[:, None], meta[i_safe, 2:], -1)                 # [N, K]
        part_bits = _sum_rows(y, exp_rows)                                       # expert side
    else:
        part_bits = _take_rows(_bits(y), jnp.where(has, i, -1))
    if not biases:  # one destination: its part is the result (a lone term is copied); none: +0.0
        out = jax.lax.bitcast_convert_type(jnp.where(has[:, None], part_bits, 0), y.dtype)
    else:
        acc = jnp.full((N, y.shape[1]), _NEG_ZERO, jnp.float32)
        for b in biases:
            acc = acc + b.astype(jnp.float32)
        part = jax.lax.bitcast_convert_type(part_bits, y.dtype).astype(jnp.float32)
        acc = acc + jnp.where(has[:, None], part, _NEG_ZERO)
        out = acc.astype(y.dtype)
    if w.size == 0:
        return out, jnp.zeros((N, 0), jnp.float32)
    idx = topk_idx.astype(jnp.int32)
    valid = (idx >= 0) & (idx < E) & (dst_row[:, :1] >= 0)
    if cfg.expand:
        r = jnp.where(valid, meta[i_safe, 2:], -1)
        got = _take_rows(w, r.reshape(-1)).reshape(N, K)
    else:
        got = _take_rows(w, jnp.where(has, i, -1))
    return out, jnp.where(valid, got, 0.0)


def _combine_dtype(dtype):
    return dtype if np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float32)) else jnp.float32


# --------------------------------------------------------------------------------------------- dispatch vjp
# The operands of the native dispatch (_ep_flat._dispatch_raw / _cached_raw): routing = (topk_idx,) fresh,
# (meta, psum_rank, psum_expert, unaligned, dst_row, topk_idx) cached; outputs as theirs.
def _dispatch_impl(cfg, zero_padding, cached, x, w, sf, routing, token):
    del zero_padding  # rows nobody fills are zero, alignment padding included
    token, checked = _guard(cfg, token, None if cached else routing[0], combine=False)
    if not cached:
        routing = (checked,)  # the layout comes from the guard's copy: it cannot be computed before the check
    x, w, sf, routing, token = _fence(x, w, sf, routing, token)
    if cached:
        meta, psum_rank, _, _, dst_row, topk_idx = routing
        src_tok, src_entry = _replay(cfg, meta, psum_rank)
        recv_x, recv_sf, recv_w = _move(cfg, x, w, sf, src_tok, src_entry)
        outs = _fence(recv_x, recv_sf, recv_w, token)
        return outs, (meta, dst_row, topk_idx)
    (topk_idx,) = routing
    handle, src_tok, src_entry = _routing(cfg, topk_idx)
    recv_topk, psum_rank, psum_expert, count, meta, dst_row, num_recv, gsz = handle
    recv_x, recv_sf, recv_w = _move(cfg, x, w, sf, src_tok, src_entry)
    outs = _fence(recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, count, meta, dst_row, num_recv, gsz,
                  token)
    return outs, (meta, dst_row, topk_idx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def dispatch_p(cfg, zero_padding, cached, x, w, sf, routing, token):
    """The native dispatch at one rank (same operands, same outputs, same gradients)."""
    return _dispatch_impl(cfg, zero_padding, cached, x, w, sf, routing, token)[0]


def _dispatch_fwd(cfg, zero_padding, cached, x, w, sf, routing, token):
    outs, saved = _dispatch_impl(cfg, zero_padding, cached, x, w, sf, routing, token)
    return outs, (saved, x, w, routing, token)


def _zero_if_symbolic(g, shape, dtype):
    if g is None or (hasattr(g, "dtype") and g.dtype == jax.dtypes.float0):
        return jnp.zeros(shape, dtype)
    return g


def _dispatch_bwd(cfg, zero_padding, cached, saved, g):
    """d x = combine of the recv_x cotangent (float32 sums in the combine dtype, cast to x's dtype; none for
    float8), d w = its routing of the recv_topk_weights cotangent, the token's cotangent passes through."""
    (meta, dst_row, topk_idx), x, w, routing, token = saved
    g_x, g_w, g_tok = (g[0], g[2], g[3]) if cached else (g[0], g[3], g[-1])
    g_tok, _ = _guard(cfg, _zero_if_symbolic(g_tok, (), token.dtype), combine=True)  # the kernels: a combine
    g_x, g_w, g_tok = _fence(g_x, g_w, g_tok)
    g_x = _zero_if_symbolic(g_x, (cfg.rows, x.shape[1]), x.dtype)
    y = g_x.astype(_combine_dtype(g_x.dtype))
    has_w = w.shape[1] != 0
    wshape = (cfg.rows,) if cfg.expand else (cfg.token_rows, cfg.topk)
    gw = _zero_if_symbolic(g_w, wshape, jnp.float32) if has_w else jnp.zeros((0,), jnp.float32)
    dx, dw = _combine(cfg, y, gw, (), meta, dst_row, topk_idx)
    dx = None if np.dtype(x.dtype) == np.dtype(jnp.float8_e4m3fn) else dx.astype(x.dtype)
    dx, dw, g_tok = _fence(dx, dw, g_tok)
    return dx, (dw if has_w else None), None, tuple(None for _ in routing), g_tok


dispatch_p.defvjp(_dispatch_fwd, _dispatch_bwd)


# ---------------------------------------------------------------------------------------------- combine vjp
# The operands of the native combine (_ep_flat._combine_raw): harr = (meta, dst_row, topk_idx, psum_rank,
# psum_expert, unaligned, recv_topk).
def _combine_impl(cfg, y, w, biases, harr, token):
    token, _ = _guard(cfg, token, combine=True)
    y, w, biases, harr, token = _fence(y, w, tuple(biases), harr, token)
    meta, dst_row, topk_idx = harr[:3]
    cx, cw = _combine(cfg, y, w, biases, meta, dst_row, topk_idx)
    return _fence(cx, cw, token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_p(cfg, y, w, biases, harr, token):
    """The native combine at one rank (same operands, same outputs, same gradients)."""
    return _combine_impl(cfg, y, w, biases, harr, token)


def _combine_fwd(cfg, y, w, biases, harr, token):
    return _combine_impl(cfg, y, w, biases, harr, token), (y, w, biases, harr, token)


def _combine_bwd(cfg, saved, g):
    """d y = the cached dispatch of the combined_x cotangent (rows combine does not read are 0), d w = its
    routing, d bias = the cotangent (cast to the bias dtype)."""
    y, w, biases, harr, token = saved
    meta, _, _, psum_rank, _, _, recv_topk = harr
    g_x, g_w, g_tok = g
    g_tok, _ = _guard(cfg, _zero_if_symbolic(g_tok, (), token.dtype), combine=False)  # the kernels: a cached dispatch
    g_x, g_w, g_tok = _fence(g_x, g_w, g_tok)
    N, H, K = cfg.num_tokens, y.shape[1], cfg.topk
    g_x = _zero_if_symbolic(g_x, (N, H), y.dtype)
    src_tok, src_entry = _replay(cfg, meta, psum_rank)
    has_w = w.size != 0
    gw = _zero_if_symbolic(g_w, (N, K), jnp.float32) if has_w else jnp.zeros((N, 0), jnp.float32)
    dy, _, dw = _move(cfg, g_x, gw, jnp.zeros((N, 0), jnp.float32), src_tok, src_entry)
    if has_w and not cfg.expand:
        dw = jnp.where(recv_topk >= 0, dw, 0.0)
    db = tuple(g_x.astype(b.dtype) for b in biases)
    dy, dw, db, g_tok = _fence(dy, dw, db, g_tok)
    return dy, (dw if has_w else None), db, tuple(None for _ in harr), g_tok


combine_p.defvjp(_combine_fwd, _combine_bwd)
