"""The flat EP path: dispatch / combine over a one-axis context as custom calls of the native handlers, with
their gradients (``jax.custom_vjp``). Takes the validated arguments of :mod:`jax_engram._ep_args`; the
hierarchical path (:mod:`jax_engram._ep_hier`) runs its intra-node legs through :func:`dispatch` /
:func:`combine` here. Semantics: :mod:`jax_engram.ep`."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import _call, _ep_autodiff, _ep_local
from jax_engram._ep_args import CombineArgs, DispatchArgs, routing_errors
from jax_engram._ep_types import (CombineResult, DispatchConfig, DispatchResult, EPHandle, combine_staging_bytes,
                                  dispatch_staging_bytes)


# ------------------------------------------------------------------------------------------- helpers
def _vary(x, ctx):
    return _call.vary(x, ctx.axis_name)


def _vary_like(a, ref):
    """a marked as varying along every manual axis ref varies along (e.g. a data-parallel axis of a 2-D mesh
    besides the context's): the gradient rules return cotangents typed like the data, so the differentiable
    operands (token, weights, biases) must carry the data's varying axes."""
    extra = _call.varying_axes(ref) - _call.varying_axes(a)
    return jax.lax.pcast(a, tuple(sorted(extra)), to="varying") if extra else a


def _ffi_token(token, ctx):
    """The ordering token as the custom calls take it (float32, varying); a fresh one for None."""
    if token is None:
        return _call.new_token(ctx)
    return _vary(jnp.asarray(token).astype(jnp.float32), ctx)


def _empty(shape, dtype, ctx):
    return _vary(jnp.zeros(shape, dtype), ctx)


def _dispatch_plan(cfg: DispatchConfig, hidden: int, dtype) -> tuple[int, bool]:
    """(copy-engine pieces, graph target) of a dispatch-type call of this config, decided once at trace time: the
    pieces from the native policy (what ``ctx.dispatch_path`` reports; 0 = SM stores), passed to the handler as an
    attribute. The graph targets (``*_graph``) take the calls of a context with CUDA graphs that move rows by SM
    stores (copy-engine rows need the handler on every call). The region key says graph or not, so a region never
    serves both kinds of call."""
    ctx = cfg.ctx
    pieces = ctx._copy_pieces(cfg.max_tokens_per_rank, hidden * np.dtype(dtype).itemsize, cfg.topk, cfg.num_experts,
                              cfg.ep)
    return pieces, bool(ctx.cuda_graphs and ctx.platform != "cpu" and pieces == 0)


def _target(base: str, graph: bool) -> str:
    return base + "_graph" if graph else base


def _dispatch_region(cfg: DispatchConfig, hidden: int, dtype, num_scales: int, graph: bool = False):
    R, M, K, E = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.topk, cfg.num_experts
    nbytes = dispatch_staging_bytes(R, M, K, E, hidden * np.dtype(dtype).itemsize, num_scales,
                                    push=cfg.ctx.platform != "cpu")
    key = ("ep_dispatch", R, M, hidden, np.dtype(dtype).name, num_scales, K, E, "graph" if graph else "stream")
    return cfg.ctx.region(nbytes, "device", key=key, what="EP dispatch buffer")


def _combine_region(cfg: DispatchConfig, hidden: int, dtype):
    R, M, K = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.topk
    nbytes = combine_staging_bytes(R, M, K, hidden * np.dtype(dtype).itemsize, push=cfg.ctx.platform != "cpu")
    return cfg.ctx.region(nbytes, "device", key=("ep_combine", R, M, hidden, np.dtype(dtype).name, K),
                          what="EP combine buffer")


# ------------------------------------------------------------------------------------------ raw FFI calls
def _dispatch_raw(cfg: DispatchConfig, zero_padding: bool, x, w, sf, topk_idx, token):
    ctx = cfg.ctx
    N, H = x.shape
    K, R, E_loc, rows, rt = cfg.topk, cfg.num_ranks, cfg.num_local_experts, cfg.rows, cfg.token_rows
    P = sf.shape[1]
    pieces, graph = _dispatch_plan(cfg, H, x.dtype)
    region = _dispatch_region(cfg, H, x.dtype, P, graph)
    i32, f32 = jnp.int32, jnp.float32
    has_w = w.shape[1] != 0
    results = [
        _call.like(x, (rows, H)),                                         # recv_x
        _call.like(x, (rows, P), sf.dtype),                               # recv_x_scales
        _call.like(x, (0 if cfg.expand else rt, K), i32),                 # recv_topk_idx
        _call.like(x, ((rows,) if cfg.expand else (rt, K)) if has_w else (0,), f32),  # recv_topk_weights
        _call.like(x, (R,), i32),                                         # psum_rank
        _call.like(x, (E_loc,), i32),                                     # psum_expert
        _call.like(x, (E_loc,), i32),                                     # unaligned
        _call.like(x, (rt, K + 2), i32),                                  # recv_src_metadata
        _call.like(x, (N, R), i32),                                       # dst_row
        _call.like(x, (), i32),                                           # num_recv_tokens
        _call.like(x, (E_loc,), i32),                                     # group_sizes
        _call.like(x, (), token.dtype),                                   # token_out
    ]
    return _call.call(ctx, _target("jax_engram_ep_dispatch", graph), results, x, sf, topk_idx, w, token,
                      alloc_id=region.alloc_id, offset=region.offset, **cfg.dispatch_attrs(pieces, zero_padding))


def _cached_raw(cfg: DispatchConfig, zero_padding: bool, x, w, sf, meta, psum_rank, psum_expert, unaligned, dst_row,
                token):
    N, H = x.shape
    K, rows, rt = cfg.topk, cfg.rows, cfg.token_rows
    P = sf.shape[1]
    pieces, graph = _dispatch_plan(cfg, H, x.dtype)
    region = _dispatch_region(cfg, H, x.dtype, P, graph)
    has_w = w.shape[1] != 0
    results = [
        _call.like(x, (rows, H)),
        _call.like(x, (rows, P), sf.dtype),
        _call.like(x, ((rows,) if cfg.expand else (rt, K)) if has_w else (0,), jnp.float32),
        _call.like(x, (), token.dtype),
    ]
    return _call.call(cfg.ctx, _target("jax_engram_ep_dispatch_cached", graph), results, x, sf, w, meta, psum_rank, psum_expert,
                      unaligned, dst_row, token, alloc_id=region.alloc_id, offset=region.offset,
                      **cfg.dispatch_attrs(pieces, zero_padding))


def _combine_raw(cfg: DispatchConfig, y, w, b0, b1, meta, dst_row, topk_idx, psum_rank, token):
    H = y.shape[1]
    N, K = cfg.num_tokens, cfg.topk
    region = _combine_region(cfg, H, y.dtype)
    has_w = w.size != 0
    results = [
        _call.like(y, (N, H)),
        _call.like(y, (N, K if has_w else 0), jnp.float32),
        _call.like(y, (), token.dtype),
    ]
    graph = cfg.ctx.cuda_graphs and cfg.ctx.platform != "cpu"
    return _call.call(cfg.ctx, _target("jax_engram_ep_combine", graph), results, y, w, b0, b1, meta, dst_row, topk_idx, psum_rank,
                      token, alloc_id=region.alloc_id, offset=region.offset, **cfg.combine_attrs())


# ------------------------------------------------------------------------- the path (see jax_engram._ep_autodiff)
def dispatch_impl(cfg: DispatchConfig, zero_padding: bool, x, w, sf, topk_idx, token):
    """(recv_x, recv_sf, recv_w, handle) of a dispatch; w / sf None when absent (the handlers take [N, 0])."""
    ctx = cfg.ctx
    num_tokens = x.shape[0]
    w_in = w if w is not None else _vary_like(_empty((num_tokens, 0), jnp.float32, ctx), x)
    sf_in = sf if sf is not None else _empty((num_tokens, 0), jnp.float32, ctx)
    (recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, unaligned, meta, dst_row, num_recv, group_sizes,
     t) = _dispatch_raw(cfg, zero_padding, x, w_in, sf_in, topk_idx, token)
    handle = EPHandle(psum_num_recv_tokens_per_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
                      num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=meta, dst_row=dst_row,
                      topk_idx=topk_idx, num_recv_tokens=num_recv, group_sizes=group_sizes,
                      recv_topk_idx=None if cfg.expand else recv_topk, done=t, config=cfg)
    return recv_x, recv_sf if sf is not None else None, recv_w if w is not None else None, handle


def cached_impl(cfg: DispatchConfig, zero_padding: bool, x, w, sf, handle: EPHandle, token):
    """(recv_x, recv_sf, recv_w, token) of a cached dispatch through ``handle``."""
    ctx = cfg.ctx
    num_tokens = x.shape[0]
    w_in = w if w is not None else _vary_like(_empty((num_tokens, 0), jnp.float32, ctx), x)
    sf_in = sf if sf is not None else _empty((num_tokens, 0), jnp.float32, ctx)
    recv_x, recv_sf, recv_w, t = _cached_raw(
        cfg, zero_padding, x, w_in, sf_in, handle.recv_src_metadata, handle.psum_num_recv_tokens_per_rank,
        handle.psum_num_recv_tokens_per_expert, handle.num_unaligned_recv_tokens_per_expert, handle.dst_row, token)
    return recv_x, recv_sf if sf is not None else None, recv_w if w is not None else None, t


def combine_impl(cfg: DispatchConfig, y, w, biases, handle: EPHandle, token):
    """(combined_x, combined_w, token) of the combine through ``handle``; w None when absent, 0-2 biases."""
    no_bias = _empty((0, y.shape[1]), y.dtype, cfg.ctx)
    b = list(biases) + [no_bias] * (2 - len(biases))
    w_in = w if w is not None else _vary_like(_empty((0,), jnp.float32, cfg.ctx), y)
    cx, cw, t = _combine_raw(cfg, y, w_in, b[0], b[1], handle.recv_src_metadata, handle.dst_row, handle.topk_idx,
                             handle.psum_num_recv_tokens_per_rank, token)
    return cx, cw if w is not None else None, t


# ------------------------------------------------------------------------------------------- entry points
def dispatch(args: DispatchArgs) -> DispatchResult:
    """A (cached) dispatch over a flat context."""
    cfg = args.config
    ctx = cfg.ctx
    path = sys.modules[__name__]
    x = _vary(args.x, ctx)
    w = _vary_like(_vary(args.topk_weights, ctx), x) if args.topk_weights is not None else None
    sf = _vary(args.x_scales, ctx) if args.x_scales is not None else None
    tok = _vary_like(_ffi_token(args.token, ctx), x)
    if not args.cached:
        topk_idx = args.topk_idx
        if args.validate_routing:
            tok = tok + routing_errors(topk_idx, cfg.num_experts, ctx)
        topk_idx = _vary(topk_idx.astype(jnp.int32), ctx)
    if _ep_local.applies(ctx, cfg.ep):  # one rank: a local permutation in plain JAX (jax_engram/_ep_local.py)
        return _dispatch_local(args, x, w, sf, topk_idx if not args.cached else None, tok)
    if not args.cached:
        recv_x, recv_sf, recv_w, h = _ep_autodiff.dispatch_op(path, cfg, args.zero_padding, x, w, sf, topk_idx, tok)
    else:
        recv_x, recv_sf, recv_w, t = _ep_autodiff.cached_dispatch_op(path, cfg, args.zero_padding, x, w, sf,
                                                                     args.handle, tok)
        h = args.handle.replace(done=t, config=cfg)
    return DispatchResult(recv_x, recv_sf, h.recv_topk_idx, recv_w, h.num_recv_tokens, h.group_sizes, h, h.done)


def combine(args: CombineArgs) -> CombineResult:
    """The combine of a flat dispatch."""
    cfg = args.config
    ctx = cfg.ctx
    y = _vary(args.y, ctx)
    w = _vary_like(_vary(args.topk_weights, ctx), y) if args.topk_weights is not None else None
    biases = tuple(_vary_like(_vary(b, ctx), y) for b in args.biases)
    tok = _vary_like(_ffi_token(args.token, ctx), y)
    if _ep_local.applies(ctx, cfg.ep):  # one rank: a local permutation in plain JAX (jax_engram/_ep_local.py)
        h = args.handle
        handle_arrays = (h.recv_src_metadata, h.dst_row, h.topk_idx, h.psum_num_recv_tokens_per_rank,
                         h.psum_num_recv_tokens_per_expert, h.num_unaligned_recv_tokens_per_expert,
                         h.recv_topk_idx if h.recv_topk_idx is not None else _empty((0, cfg.topk), jnp.int32, ctx))
        w_in = w if w is not None else _vary_like(_empty((0,), jnp.float32, ctx), y)
        cx, cw, t = _ep_local.combine_p(cfg, y, w_in, biases, handle_arrays, tok)
        return CombineResult(cx, cw if w is not None else None, t)
    cx, cw, t = _ep_autodiff.combine_op(sys.modules[__name__], cfg, y, w, biases, args.handle, tok)
    return CombineResult(cx, cw, t)


def _dispatch_local(args: DispatchArgs, x, w, sf, topk_idx, tok) -> DispatchResult:
    """A (cached) dispatch of a one-rank context through _ep_local (operands and outputs as the native handlers':
    absent weights / scales are [N, 0] arrays; a fresh dispatch returns every handle array)."""
    cfg = args.config
    ctx = cfg.ctx
    num_tokens = x.shape[0]
    w_in = w if w is not None else _vary_like(_empty((num_tokens, 0), jnp.float32, ctx), x)
    sf_in = sf if sf is not None else _empty((num_tokens, 0), jnp.float32, ctx)
    if not args.cached:
        (recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, unaligned, meta, dst_row, num_recv, group_sizes,
         t) = _ep_local.dispatch_p(cfg, args.zero_padding, False, x, w_in, sf_in, (topk_idx,), tok)
        h = EPHandle(psum_num_recv_tokens_per_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
                     num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=meta, dst_row=dst_row,
                     topk_idx=topk_idx, num_recv_tokens=num_recv, group_sizes=group_sizes,
                     recv_topk_idx=None if cfg.expand else recv_topk, done=t, config=cfg)
    else:
        h = args.handle
        routing = (h.recv_src_metadata, h.psum_num_recv_tokens_per_rank, h.psum_num_recv_tokens_per_expert,
                   h.num_unaligned_recv_tokens_per_expert, h.dst_row, h.topk_idx)
        recv_x, recv_sf, recv_w, t = _ep_local.dispatch_p(cfg, args.zero_padding, True, x, w_in, sf_in, routing, tok)
        h = h.replace(done=t, config=cfg)
    return DispatchResult(recv_x, recv_sf if sf is not None else None, h.recv_topk_idx,
                          recv_w if w is not None else None, h.num_recv_tokens, h.group_sizes, h, t)
