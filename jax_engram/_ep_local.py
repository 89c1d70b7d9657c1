"""The one-rank EP path: dispatch / combine of a flat context of ONE rank as a local permutation (plain JAX and
small native calls for the expand layout).

At one rank nothing crosses a link: every token's destination is the rank itself, so dispatch moves x's rows into
the documented receive layout and combine is a gather (non-expand) or a gather-and-sum (expand) back. Non-expand
rows are a gather. A fresh expand dispatch is one native call (``jax_engram_ep_local_dispatch``: the layout, the
rows, each token's row read once, and the weights); a cached one takes its layout from the handle and its rows from a
native scatter (``jax_engram_ep_local_scatter``) that reads each token's row once. The expand layout of
:func:`_routing` (a stable sort by expert in JAX) is the same layout, which the tests compare the call with. This
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
dispatch computes its layout from the guard's copy of topk_idx, so none of it runs before the check. An expand
dispatch made by the dispatch call has no separate guard: that call takes the token and makes the guard's checks
itself, so the op is one custom call (a small op's time in a loop is mostly the host's cost per custom call). The guards of
cached dispatch and combine check only the context, at their handler, which fails the whole call wherever XLA
places it.

A sibling of the flat path (:mod:`jax_engram._ep_flat`), chosen by ``jax_engram.ep._path`` where
:func:`applies`: its raw calls (``_dispatch_raw``, ``_cached_raw``, ``_combine_raw``) take and return exactly what
the native calls of the flat path do, behind the flat path's entry points and wrappers, and the gradients are the
rules of :mod:`jax_engram._ep_autodiff` (one custom_vjp per op for every path): the backward of a dispatch is this
path's combine, the backward of a combine its cached dispatch. The choice is made per context and EPConfig, so the
handles of one dispatch config always come from one path. The handle's fields are the native path's, so either path
could read the other's handles, but nothing mixes them.

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

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import _call, _ep_flat
from jax_engram._ep_guard import applies, guard_call
from jax_engram._ep_types import local_dispatch_scratch_words

# Fresh expand dispatches of up to this many (token, k) entries (every layout the native calls' int32 rows allow) are
# one native call (jax_engram_ep_local_dispatch: the guard, the whole layout, the rows and the weights). The tests
# lower it to 0 to run the stable sort of _routing and the row scatter instead, and compare the two.
_NATIVE_LAYOUT_MAX_ENTRIES = (1 << 31) - 1
_NEG_ZERO = -0.0  # the exact additive identity: -0.0 + v == v for every v, so a fold may start from it
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


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
        # entry (t, k) of expert e goes to row start[e] + its rank among e's entries in (token, k) order: its
        # position after a stable sort by expert minus its expert's first position
        n = N * K
        key = jnp.where(valid, idx, E).reshape(-1)                               # [N*K], E = none
        j = jnp.arange(n, dtype=i32)
        order = jnp.argsort(key, stable=True).astype(i32)
        skey = key[order]
        first = start if cfg.expert_alignment == 1 else jnp.cumsum(count, dtype=i32) - count  # unaligned
        e = jnp.minimum(skey, E - 1)
        row_sorted = jnp.where(skey < E, start[e] + j - first[e], -1)
        exp_flat = jnp.full((n,), -1, i32).at[order].set(row_sorted, unique_indices=True)
        exp_row = exp_flat.reshape(N, K)
        src_entry = jnp.full((rows,), n, i32).at[jnp.where(exp_flat >= 0, exp_flat, rows)].set(j, mode="drop")
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
    return handle, src_tok, src_entry, (exp_row if cfg.expand else None)


def _uses_dispatch_call(cfg, topk_idx) -> bool:
    """Whether a fresh dispatch is one native call (an expand layout of at most ``_NATIVE_LAYOUT_MAX_ENTRIES``
    entries)."""
    N, K = topk_idx.shape
    return cfg.expand and 0 < N * K <= _NATIVE_LAYOUT_MAX_ENTRIES


def _dispatch_call(cfg, token, topk_idx, x, w):
    """(token, handle, src_tok, recv_x, recv_w) of a fresh expand dispatch in one native call
    (``jax_engram_ep_local_dispatch``; :func:`_uses_dispatch_call`) that is also its guard: it refuses a closed or
    failed context and checks and records the routing exactly as the guard does, then computes exactly the layout
    ``_routing``'s sort does, the receive rows ``_scatter_rows`` writes and the weights ``_move`` gathers (``w`` [N, K]
    or [N, 0]: none). The token comes back in its own buffer."""
    ctx = cfg.ctx
    N, K = topk_idx.shape
    M, E, rows = cfg.max_tokens_per_rank, cfg.num_experts, cfg.rows
    i32 = jnp.int32
    axes = ctx.axis_name
    token = _call.vary(token, axes)
    t = _call.vary(topk_idx.astype(i32), axes)
    w_flat = w.reshape(-1)
    shapes = ((N, K), (rows,), (rows,), (E,), (E,), (E,), (M, K + 2), (N, 1), (1,),
              (local_dispatch_scratch_words(N, K, E),))
    results = [_call.like(token), _call.like(x, (rows, x.shape[1])), _call.like(w_flat, (rows if w.size else 0,))]
    graph = ctx.cuda_graphs and ctx.platform != "cpu"  # as the guard: the graph target where XLA may capture it
    (token, recv_x, recv_w, exp_row, src_entry, src_tok, count, aligned, psum_expert, meta, dst_row, num_recv1,
     scratch) = _call.call(ctx, "jax_engram_ep_local_dispatch_graph" if graph else "jax_engram_ep_local_dispatch",
                             results + [_call.like(t, s, i32) for s in shapes], token, t, x, w_flat,
                             input_output_aliases={0: 0}, expert_alignment=cfg.expert_alignment)
    del exp_row, src_entry, scratch  # the handle's metadata holds the receive rows
    handle = (jnp.full((0, K), -1, i32), num_recv1, psum_expert, count, meta, dst_row, num_recv1[0], aligned)
    return token, handle, src_tok, recv_x, recv_w


def _replay(cfg, meta, psum_rank):
    """The source token of every receive row (``N`` = none) and, expand, its (token, k) entry and the receive row
    of every (token, k) entry ([N, K], -1 = none), from a handle."""
    N, K, rows, M = cfg.num_tokens, cfg.topk, cfg.rows, cfg.max_tokens_per_rank
    i32 = jnp.int32
    real = jnp.arange(M, dtype=i32) < psum_rank[-1]
    tok = jnp.where(real, meta[:, 0], N)                                         # gid = t at one rank
    if not cfg.expand:
        return tok, None, None
    r = meta[:, 2:]                                                              # [M, K]
    ok = real[:, None] & (r >= 0)
    entry = tok[:, None] * K + jnp.arange(K, dtype=i32)
    src_entry = jnp.full((rows,), N * K, i32).at[jnp.where(ok, r, rows).reshape(-1)].set(
        entry.reshape(-1), mode="drop")
    dest = jnp.full((N, K), -1, i32).at[jnp.where(real, tok, N)].set(jnp.where(ok, r, -1), mode="drop")
    return jnp.where(src_entry < N * K, src_entry // K, N), src_entry, dest


def _scatter_rows(cfg, x, dest, src_tok):
    """The expand layout's receive rows [rows, H]: row r is x[src_tok[r]] where that token lists r in ``dest``
    ([N, K], -1: none), else zero (``src_tok`` N: no source). One native call (``jax_engram_ep_local_scatter``)
    that reads each token's row once; a gather of the receive rows would read it once per written row."""
    rows = src_tok.shape[0]
    if x.shape[0] == 0 or x.shape[1] == 0 or rows == 0 or dest.shape[1] == 0:
        return _take_rows(x, src_tok)
    return _call.call(cfg.ctx, "jax_engram_ep_local_scatter", _call.like(x, (rows, x.shape[1])), x,
                      dest.astype(jnp.int32), src_tok.astype(jnp.int32))


def _move(cfg, x, w, sf, src_tok, src_entry, dest=None):
    """recv_x, recv_x_scales and recv_topk_weights of a layout (rows nobody fills are zero); ``dest`` [N, K]: the
    receive row of every (token, k) entry, for the expand layout's scatter."""
    N, K = w.shape
    recv_x = _scatter_rows(cfg, x, dest, src_tok) if dest is not None else _take_rows(x, src_tok)
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


# ---------------------------------------------------------------------------------------------- raw calls
# The signatures, operands and outputs of the flat path's native calls (_ep_flat._dispatch_raw, _cached_raw,
# _combine_raw): absent weights / scales are empty arrays, a fresh dispatch returns every handle array.
def _dispatch_raw(cfg, zero_padding, x, w, sf, topk_idx, token):
    del zero_padding  # rows nobody fills are zero, alignment padding included
    if _uses_dispatch_call(cfg, topk_idx):  # one call: the guard, the layout, the rows and the weights
        x, w, sf, topk_idx, token = _fence(x, w, sf, topk_idx, token)
        token, handle, src_tok, recv_x, recv_w = _dispatch_call(cfg, token, topk_idx, x, w)
        recv_sf = _take_rows(sf, src_tok)
    else:
        token, checked = _guard(cfg, token, topk_idx, combine=False)
        # the layout comes from the guard's copy of topk_idx: it cannot be computed before the check
        x, w, sf, checked, token = _fence(x, w, sf, checked, token)
        handle, src_tok, src_entry, dest = _routing(cfg, checked)
        recv_x, recv_sf, recv_w = _move(cfg, x, w, sf, src_tok, src_entry, dest)
    recv_topk, psum_rank, psum_expert, count, meta, dst_row, num_recv, group_sizes = handle
    return _fence(recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, count, meta, dst_row, num_recv,
                  group_sizes, token)


def _cached_raw(cfg, zero_padding, x, w, sf, meta, psum_rank, psum_expert, unaligned, dst_row, token):
    del zero_padding, psum_expert, unaligned, dst_row  # the layout is replayed from meta and psum_rank alone
    token, _ = _guard(cfg, token, combine=False)
    x, w, sf, meta, psum_rank, token = _fence(x, w, sf, meta, psum_rank, token)
    src_tok, src_entry, dest = _replay(cfg, meta, psum_rank)
    recv_x, recv_sf, recv_w = _move(cfg, x, w, sf, src_tok, src_entry, dest)
    return _fence(recv_x, recv_sf, recv_w, token)


def _combine_raw(cfg, y, w, biases, meta, dst_row, topk_idx, psum_rank, token):
    del psum_rank  # dst_row names the receive row of every token
    token, _ = _guard(cfg, token, combine=True)
    y, w, biases, meta, dst_row, topk_idx, token = _fence(y, w, tuple(biases), meta, dst_row, topk_idx, token)
    cx, cw = _combine(cfg, y, w, biases, meta, dst_row, topk_idx)
    return _fence(cx, cw, token)


# ------------------------------------------------------------------------- the path (see jax_engram._ep_autodiff)
def dispatch_impl(cfg, zero_padding, x, w, sf, topk_idx, token):
    """(recv_x, recv_sf, recv_w, handle) of a dispatch at one rank."""
    return _ep_flat.dispatch_with(_dispatch_raw, cfg, zero_padding, x, w, sf, topk_idx, token)


def cached_impl(cfg, zero_padding, x, w, sf, handle, token):
    """(recv_x, recv_sf, recv_w, token) of a cached dispatch at one rank through ``handle``."""
    return _ep_flat.cached_with(_cached_raw, cfg, zero_padding, x, w, sf, handle, token)


def combine_impl(cfg, y, w, biases, handle, token):
    """(combined_x, combined_w, token) of a combine at one rank through ``handle``."""
    return _ep_flat.combine_with(_combine_raw, cfg, y, w, biases, handle, token)


# ------------------------------------------------------------------------------------------- entry points
def dispatch(args):
    """``jax_engram.dispatch`` over a flat context of one rank (same arguments and results as the flat path)."""
    return _ep_flat.dispatch_on(sys.modules[__name__], args)


def combine(args):
    """``jax_engram.combine`` of a one-rank dispatch (same arguments and results as the flat path)."""
    return _ep_flat.combine_on(sys.modules[__name__], args)


def path(cfg):
    """The path of an op of a flat group of this dispatch config: this module where :func:`applies` (one rank,
    ``EPConfig.one_rank == "local"``), else the native kernels' (:mod:`jax_engram._ep_flat`)."""
    return sys.modules[__name__] if applies(cfg.ctx, cfg.ep) else _ep_flat
